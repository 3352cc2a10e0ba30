"""The README's first command, ``testproject/manage.py demo``, run as a user runs it.

A real subprocess on a fresh SQLite file (the demo's own database, not the test
database): it must stop by itself, log each job event once, and close with the
summary and the way into the admin. What the log says is checked against the
jobs table the demo leaves behind.
"""

from __future__ import annotations

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
    assert {job for _, _, job, _ in events} == new_ids, output
    for job_id in new_ids:
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
    # The summary, from the database's own counts.
    statuses = Counter(jobs[i][1] for i in new_ids)
    assert (
        f"Jobs by status: succeeded {statuses['succeeded']}, failed {statuses['failed']}" in output
    )
    assert "Every job of the tour has ended" in output
    assert "testproject/manage.py runserver" in output
    assert "http://127.0.0.1:8000/admin/django_jobs/" in output


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
