"""The README's first command, ``testproject/manage.py demo``, run as a user runs it.

A real subprocess on a fresh SQLite file (the demo's own database, not the test
database): it must stop by itself, log each job event once (but the async fan-out's
starts and finishes, which it leaves out), and close with the summary and the way into
the admin. What the log says is checked against the jobs table the demo leaves behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from django.db import connection

from tests.harness import MANAGE, REPO_ROOT, wait_until

pytestmark = [
    pytest.mark.workers,
    # The demo always runs on its own SQLite file, whatever the suite's database: once is
    # enough (tox's sqlite environments).
    pytest.mark.skipif(
        connection.vendor != "sqlite", reason="the demo runs on SQLite in any environment"
    ),
]

EVENT = re.compile(r"job (started|finished|failed) task=(\S+) job=(\d+) attempt=(\d+)")
# Generous: the demo takes about 5 s; a loaded CI machine may take several times that.
TIMEOUT = 90
# The async step: 200 fetches from a stub server that answers each after 1 s.
FETCH_TASK = "testproject.demo.tasks.fetch_page"
FETCHES = 200
FETCH_DELAY = 1.0
# Their span, from the first start to the last end, must stay under this to show that they
# overlapped: one after another they take 200 s, and on the worker's 3 threads (where an
# async job would run without the event loop) 67 s. Far above the 1-2 s they take, so a
# slow machine does not fail it: it tells overlap from none, not fast from slow.
FETCH_SPAN_BOUND = 50.0


def demo_env(db_path: Path) -> dict[str, str]:
    """The environment of a user's shell: no test settings, no fast test clocks."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("JOBS_") and key != "TEST_DATABASE_NAME"
    }
    env.update(DATABASE_URL=f"sqlite:///{db_path}", PYTHONUNBUFFERED="1")
    return env


def run_demo(db_path: Path) -> str:
    try:
        done = subprocess.run(
            [sys.executable, str(MANAGE), "demo"],
            cwd=REPO_ROOT,
            env=demo_env(db_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"the demo did not stop by itself within {TIMEOUT}s; output:\n{exc.output}"
        ) from None
    assert done.returncode == 0, done.stdout
    return done.stdout


def jobs_of(db_path: Path) -> dict[int, tuple[str, str, int, datetime, datetime | None]]:
    """{id: (task path, status, attempts, enqueued_at, started_at)} from the demo's database."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute(
            "SELECT id, task_path, status, attempts, enqueued_at, started_at FROM django_jobs_job"
        ).fetchall()
    return {
        row[0]: (
            row[1],
            row[2],
            row[3],
            datetime.fromisoformat(row[4]),
            datetime.fromisoformat(row[5]) if row[5] else None,
        )
        for row in rows
    }


def fetches_of(db_path: Path, ids: set[int]) -> list[tuple]:
    """(id, status, attempts, is_async, args, return value, started_at, finished_at) of the
    fetch jobs among ``ids``."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute(
            "SELECT id, status, attempts, is_async, args, return_value, started_at, finished_at "
            "FROM django_jobs_job WHERE task_path = ? ORDER BY id",
            [FETCH_TASK],
        ).fetchall()
    return [
        (
            job_id,
            status,
            attempts,
            bool(is_async),
            json.loads(args),
            json.loads(value) if value is not None else None,
            datetime.fromisoformat(started) if started else None,
            datetime.fromisoformat(finished) if finished else None,
        )
        for job_id, status, attempts, is_async, args, value, started, finished in rows
        if job_id in ids
    ]


def errors_of(db_path: Path) -> dict[int, list[str]]:
    """{job id: the class names of its failed attempts, in order} from the demo's database."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute(
            "SELECT job_id, exception_class_path FROM django_jobs_failedexecution "
            "ORDER BY job_id, attempt, id"
        ).fetchall()
    errors: dict[int, list[str]] = {}
    for job_id, path in rows:
        errors.setdefault(job_id, []).append(path.rsplit(".", 1)[-1])
    return errors


def progress_of(db_path: Path, job_id: int) -> tuple:
    with sqlite3.connect(db_path) as db:
        return db.execute(
            "SELECT progress_done, progress_total, progress_message FROM django_jobs_job "
            "WHERE id = ?",
            [job_id],
        ).fetchone()


def events_of(output: str) -> list[tuple[str, str, int, int]]:
    return [
        (event, task, int(job), int(attempt)) for event, task, job, attempt in EVENT.findall(output)
    ]


def check_run(output: str, jobs: dict, new_ids: set[int], db_path: Path) -> None:
    """Every event of every job of this run logged once, in an order that makes sense."""
    assert "Task id=" not in output, "Django's django.tasks duplicate of our log lines"
    assert "Traceback" not in output, output
    events = events_of(output)
    counts = Counter((event, job, attempt) for event, _, job, attempt in events)
    assert [key for key, n in counts.items() if n > 1] == [], output
    fetch_ids = {i for i in new_ids if jobs[i][0] == FETCH_TASK}
    logged = new_ids - fetch_ids  # the fetches' starts and finishes are left out of the log
    assert {job for _, _, job, _ in events} == logged, output
    for job_id in logged:
        task, status, attempts, _, _ = jobs[job_id]
        expected = {("started", job_id, n) for n in range(1, attempts + 1)}
        expected |= {("failed", job_id, n) for n in range(1, attempts)}
        expected.add(("finished" if status == "succeeded" else "failed", job_id, attempts))
        assert {key for key in counts if key[1] == job_id} == expected, task

    def jobs_named(name: str) -> list[int]:
        return sorted(i for i in new_ids if jobs[i][0] == f"testproject.demo.tasks.{name}")

    # The retry: attempt 1 fails, attempt 2 succeeds.
    (retry,) = jobs_named("flaky_report")
    assert jobs[retry][1:3] == ("succeeded", 2)
    # The failure: failed, once.
    (failing,) = jobs_named("parse_upload")
    assert jobs[failing][1:3] == ("failed", 1)
    # The deferred job waited for its run_after.
    (deferred,) = jobs_named("send_reminder")
    assert (jobs[deferred][4] - jobs[deferred][3]).total_seconds() >= 3
    # The keyed pair: the second starts only after the first has finished.
    first, second = jobs_named("sync_account")
    lines = output.splitlines()
    finished_first = next(i for i, line in enumerate(lines) if f"finished {first}" in norm(line))
    started_second = next(i for i, line in enumerate(lines) if f"started {second}" in norm(line))
    assert finished_first < started_second
    # The unique job enqueued twice is one job; the batch's callback ran once.
    assert len(jobs_named("rebuild_index")) == 1
    assert len(jobs_named("import_done")) == 1
    assert len(re.findall(r"batch \d+ done: 4 imported, 0 failed", output)) == 1
    # The workflow: the fan-in started only after both quotes had finished, once, and read
    # what they returned.
    quotes = jobs_named("fetch_quote")
    (cheapest,) = jobs_named("pick_cheapest")
    assert [jobs[i][1:3] for i in [*quotes, cheapest]] == [("succeeded", 1)] * 3
    finished_quotes = [
        next(i for i, line in enumerate(lines) if f"finished {quote}" in norm(line))
        for quote in quotes
    ]
    started_cheapest = next(
        i for i, line in enumerate(lines) if f"started {cheapest}" in norm(line)
    )
    assert max(finished_quotes) < started_cheapest
    assert len(re.findall(r"cheapest of 2 quotes: south at 11\.00", output)) == 1
    assert re.search(
        rf"workflow #{cheapest} started [\d.]+ s after the last quote: "
        r"'south at 11\.00, of 2 quotes'; workflow #\d+ succeeded",
        flat(output),
    )
    # Job control: the export reported its progress to the end; the slow sync timed out;
    # the endless import was cancelled while it ran, and stopped by itself.
    text = flat(output)
    errors = errors_of(db_path)
    (export,) = jobs_named("export_orders")
    assert jobs[export][1:3] == ("succeeded", 1)
    assert progress_of(db_path, export) == (3, 3, "done")
    assert f"Demo: progress(#{export}) -> " in text
    assert f"progress #{export} succeeded; progress() reads 100% · 3 of 3 (done)" in text
    (slow,) = jobs_named("sync_catalogue")
    assert jobs[slow][1:3] == ("failed", 1) and errors[slow] == ["JobTimeout"]
    assert f"timeout #{slow} failed: JobTimeout on attempt 1 of 1" in text
    (endless,) = jobs_named("import_products")
    assert jobs[endless][1:3] == ("failed", 1) and errors[endless] == ["JobCancelled"]
    assert f"Demo: cancel(#{endless}) -> 'requested'" in text
    assert f"job {endless}: cancel requested" in output
    assert re.search(r"import_products stopped after \d+ rows: cancel requested", output)
    assert f"job {endless} cancelled: interrupting" not in output  # it stopped by itself
    assert f"cancel #{endless} failed: JobCancelled on attempt 1 of 1" in text
    check_fetches(output, fetch_ids, db_path)
    # The summary, from the database's own counts.
    statuses = Counter(jobs[i][1] for i in new_ids)
    assert (
        f"Jobs by status: succeeded {statuses['succeeded']}, failed {statuses['failed']}" in output
    )
    assert "Every job of the tour has ended" in output
    assert "testproject/manage.py runserver" in output
    assert "http://127.0.0.1:8000/admin/django_jobs/" in output


def check_fetches(output: str, fetch_ids: set[int], db_path: Path) -> None:
    """The async step: 200 async jobs, each waited its full second on the stub server, all
    succeeded, and they overlapped: the sum of their runs is 200 s or more, their span a
    small part of it. The figures the demo prints are those of the jobs' own rows."""
    text = flat(output)
    assert len(fetch_ids) == FETCHES
    fetches = fetches_of(db_path, fetch_ids)
    assert [row[1:4] for row in fetches] == [("succeeded", 1, True)] * FETCHES
    port = None
    for _, _, _, _, (url,), value, started, finished in fetches:
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/item/\d+", url)
        assert match, url
        assert port in (None, match[1]), "one stub server for the whole fan-out"
        port = match[1]
        assert value == {"url": url, "status": 200, "bytes": value["bytes"]} and value["bytes"]
        # The stub answers 1 s after it has read the request: a shorter run never reached it.
        assert (finished - started).total_seconds() >= FETCH_DELAY * 0.95, (url, started, finished)
    first = min(row[6] for row in fetches)
    last = max(row[7] for row in fetches)
    span = (last - first).total_seconds()
    busy = sum((row[7] - row[6]).total_seconds() for row in fetches)
    assert busy >= FETCHES * FETCH_DELAY * 0.95
    assert span < FETCH_SPAN_BOUND, f"the fetches took {span:.1f} s: they did not overlap"
    # What the demo says, before and after.
    assert (
        f"{FETCHES} fetches that each wait {FETCH_DELAY:g} s finish in about a second or two, "
        f"on one event loop, not {FETCHES} threads" in text
    )
    assert f"http://127.0.0.1:{port}/" in text
    assert f"#{min(fetch_ids)} to #{max(fetch_ids)} fetch_page" in text
    said = re.findall(
        rf"(?:Demo: the fetches have ended:|async) {FETCHES} of {FETCHES} succeeded, "
        r"([\d.]+) s from the first start to the last end \(their started_at and finished_at\), "
        r"up to (\d+) running at once",
        text,
    )
    assert len(said) == 2, text  # once as they end, once in the summary
    # The most running at once: at some fetch's start, how many had started and not ended.
    runs = [(row[6], row[7]) for row in fetches]
    peak = max(sum(1 for s, f in runs if s <= start < f) for start, _ in runs)
    for seconds, printed_peak in said:
        assert abs(float(seconds) - span) <= 0.051, (seconds, span)
        assert int(printed_peak) == peak
    assert re.search(r"The stub server held up to (\d+) requests at once", text)
    assert f"?task_path={FETCH_TASK}" in text


def flat(output: str) -> str:
    """The demo wraps its own lines; phrases are looked for with whitespace collapsed."""
    return " ".join(output.split())


def norm(line: str) -> str:
    """'job finished task=x job=12 attempt=1' -> 'finished 12', for finding one event's line."""
    match = EVENT.search(line)
    return f"{match[1]} {match[3]}" if match else ""


def test_the_demo_runs_every_job_logs_each_event_once_and_stops_by_itself(tmp_path):
    db_path = tmp_path / "demo.sqlite3"
    output = run_demo(db_path)
    jobs = jobs_of(db_path)
    check_run(output, jobs, set(jobs), db_path)
    assert "log in as admin / admin (a superuser the demo created)" in flat(output)
    with sqlite3.connect(db_path) as db:
        assert db.execute("SELECT is_superuser FROM auth_user WHERE username = 'admin'").fetchall()
    # Run again on the same database, as a user running the README's command twice does.
    again = run_demo(db_path)
    jobs_after = jobs_of(db_path)
    check_run(again, jobs_after, set(jobs_after) - set(jobs), db_path)
    assert "log in as admin / admin." in flat(again)


def test_ctrl_c_stops_the_demo_early_and_cleanly(tmp_path):
    log_path = tmp_path / "demo.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(MANAGE), "demo"],
            cwd=REPO_ROOT,
            env=demo_env(tmp_path / "demo.sqlite3"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            # The keyed pair takes turns for 2 s and the deferred job waits 3 s: a Ctrl-C
            # once the first job has started comes before the tour has ended.
            wait_until(lambda: "job started" in log_path.read_text(), TIMEOUT, what="a job started")
            proc.send_signal(signal.SIGINT)
            code = proc.wait(TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = log_path.read_text()
    assert code == 0, output
    text = flat(output)
    assert "shutting down gracefully (SIGINT)" in text
    assert "Stopped early:" in text
    assert "Every job of the tour has ended" not in text
    assert "Traceback" not in text, output
    assert "http://127.0.0.1:8000/admin/django_jobs/" in text
    # The fetches' stub server stops with the demo: none is left to fail later against it.
    # Those the stop came before are cancelled (the rest had succeeded), and the demo says so.
    db_path = tmp_path / "demo.sqlite3"
    fetches = fetches_of(db_path, set(jobs_of(db_path)))
    assert len(fetches) == FETCHES
    outcomes = Counter(row[1] for row in fetches)
    assert set(outcomes) <= {"succeeded", "failed"}, outcomes
    errors = errors_of(db_path)
    cancelled = [row[0] for row in fetches if row[1] == "failed"]
    assert all(errors[job_id] == ["JobCancelled"] for job_id in cancelled)
    if cancelled:
        assert re.search(
            rf"The {len(cancelled)} fetch(es)? that had not ended (is|are) cancelled", text
        )
        assert (
            f"async {outcomes['succeeded']} of {FETCHES} fetches succeeded before the demo "
            f"stopped, {len(cancelled)} w"
        ) in text
    else:  # all had been claimed before the Ctrl-C: the graceful stop let them end
        assert f"async {FETCHES} of {FETCHES} succeeded, " in text
