"""Progress (docs/control.md): ``set_progress`` inside a job, throttled writes of the job's
progress columns alone, ``progress()`` to read it; in this process and in real workers.

The in-process tests stand in for a running job by setting the running job's id as the
executor does (``current_job_id``). They use committed rows (``transaction=True``): the
progress writer is a thread of its own, with its own connection.
"""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext

import django_jobs
from django_jobs.core import progress as job_progress
from django_jobs.core.batches import current_job_id
from django_jobs.core.progress import WRITER, flush_progress
from django_jobs.exceptions import JobNotFound
from django_jobs.models import ClaimedExecution, Job, JobStatus, Semaphore
from tests import progress_tasks
from tests.factories import JobFactory, ProcessFactory
from tests.harness import job_row, wait_until

PROGRESS_COLUMNS = {"progress_done", "progress_total", "progress_message", "progress_at"}


@pytest.fixture(autouse=True)
def writer_closed_after_each_test():
    """The writer thread's connection is closed before the test database is flushed or
    dropped (PostgreSQL refuses to drop a database someone is connected to)."""
    yield
    with WRITER.changed:
        WRITER.changed.notify()  # a test's interval is undone: the writer re-reads it
    assert WRITER.close_when_idle(10), "the progress writer still had values to write"


@pytest.fixture
def in_job():
    """Run the test's body as if it were job ``job``'s task, as the executor does."""
    tokens = []

    def enter(job: Job) -> int:
        tokens.append(current_job_id.set(job.pk))
        return job.pk

    yield enter
    for token in reversed(tokens):
        current_job_id.reset(token)


def stored(job_id: int) -> tuple:
    report = django_jobs.progress(job_id)
    return None if report is None else (report.done, report.total, report.message)


def counting_writes(monkeypatch) -> list[tuple]:
    """Every write the writer makes, in order: (job id, done, thread name)."""
    writes: list[tuple] = []
    real = job_progress.write_report

    def write(db, job_id, report):
        writes.append((job_id, report.done, threading.current_thread().name))
        return real(db, job_id, report)

    monkeypatch.setattr(job_progress, "write_report", write)
    return writes


# --- the API --------------------------------------------------------------------------


def test_set_progress_outside_a_job_is_a_clear_error():
    with pytest.raises(RuntimeError, match="outside a running job"):
        django_jobs.set_progress(1, 10)
    assert WRITER.pending() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-1,), ValueError),
        ((math.nan,), ValueError),
        ((math.inf, 10), ValueError),
        ((True,), ValueError),
        (("3",), ValueError),
        ((3, 0), ValueError),
        ((3, -5), ValueError),
        ((3, "10"), ValueError),
        ((3, 10, None), TypeError),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(in_job, args, error):
    job_id = in_job(JobFactory(status=JobStatus.RUNNING))
    with pytest.raises(error, match=r"set_progress\(\)"):
        django_jobs.set_progress(*args)
    assert WRITER.pending() == 0
    assert django_jobs.progress(job_id) is None


@pytest.mark.django_db(transaction=True)
def test_progress_reads_the_last_report_and_none_before_the_first(in_job):
    job_id = in_job(JobFactory(status=JobStatus.RUNNING))
    assert django_jobs.progress(job_id) is None
    with pytest.raises(JobNotFound):
        django_jobs.progress(10**9)
    django_jobs.set_progress(42, 168, "x" * 300)
    flush_progress(job_id)
    report = django_jobs.progress(str(job_id))  # a TaskResult's id is a string
    assert (report.done, report.total, report.message) == (42, 168, "x" * 255)
    assert isinstance(report.done, int) and report.fraction == 0.25 and report.percent == 25
    assert report.summary == "25% · 42 of 168"
    assert report.updated_at is not None
    django_jobs.set_progress(2.5)  # no total: no fraction
    flush_progress(job_id)
    report = django_jobs.progress(job_id)
    assert (report.done, report.total, report.fraction, report.summary) == (
        2.5,
        None,
        None,
        "2.5 done",
    )
    django_jobs.set_progress(12, 10)  # past its total: counted as all of it
    flush_progress(job_id)
    assert django_jobs.progress(job_id).fraction == 1.0


# --- the writes -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_write_is_one_update_of_the_progress_columns_by_primary_key(in_job, monkeypatch):
    monkeypatch.setattr(job_progress, "PROGRESS_INTERVAL", 60.0)
    job = JobFactory(status=JobStatus.RUNNING, attempts=1, max_attempts=3)
    other = JobFactory(status=JobStatus.RUNNING)
    in_job(job)
    django_jobs.set_progress(1, 3, "first")  # written at once, by the writer thread
    wait_until(lambda: stored(job.pk) == (1, 3, "first"), 10, what="the first report")
    django_jobs.set_progress(2, 3, "second")  # within the interval: kept for later
    assert WRITER.pending() == 1
    with CaptureQueriesContext(connection) as queries:
        flush_progress(job.pk)  # in this thread, as the executor does when the body ends
    (query,) = [q["sql"] for q in queries]
    assert re.match(r'UPDATE [`"]django_jobs_job[`"] SET ', query), query
    set_clause, _, where = query.partition(" SET ")[2].partition(" WHERE ")
    assert set(re.findall(r'[`"](\w+)[`"] = ', set_clause)) == PROGRESS_COLUMNS, query
    assert re.fullmatch(rf'[`"]django_jobs_job[`"]\.[`"]id[`"] = {job.pk}', where), query
    assert WRITER.pending() == 0
    assert stored(job.pk) == (2, 3, "second")
    after = job_row(job.pk)
    assert (after.status, after.attempts, after.max_attempts) == (JobStatus.RUNNING, 1, 3)
    assert django_jobs.progress(other.pk) is None


@pytest.mark.django_db(transaction=True)
def test_a_tight_loop_is_written_at_most_once_per_interval_and_its_last_value_always(
    in_job, monkeypatch
):
    monkeypatch.setattr(job_progress, "PROGRESS_INTERVAL", 0.25)
    writes = counting_writes(monkeypatch)
    job_id = in_job(JobFactory(status=JobStatus.RUNNING))
    calls, began = 0, time.monotonic()
    while time.monotonic() - began < 1.5:
        calls += 1
        django_jobs.set_progress(calls, 10**9, f"row {calls}")
    elapsed = time.monotonic() - began
    flush_progress(job_id)
    assert calls > 1000, calls
    # One write at once, then at most one per interval, and the flush of the last value.
    assert 2 <= len(writes) <= elapsed / 0.25 + 2, (len(writes), calls)
    assert writes[-1] == (job_id, calls, threading.current_thread().name)
    assert stored(job_id) == (calls, 10**9, f"row {calls}")
    assert [done for _, done, _ in writes] == sorted(done for _, done, _ in writes)


@pytest.mark.django_db(transaction=True)
def test_a_report_before_a_long_step_is_written_within_the_interval_without_another_call(
    in_job, monkeypatch
):
    monkeypatch.setattr(job_progress, "PROGRESS_INTERVAL", 0.5)
    job_id = in_job(JobFactory(status=JobStatus.RUNNING))
    django_jobs.set_progress(1, 3, "step 1: downloading")
    wait_until(lambda: stored(job_id) == (1, 3, "step 1: downloading"), 5, what="step 1")
    reported = time.monotonic()
    django_jobs.set_progress(2, 3, "step 2: converting (takes an hour)")
    # The task is now busy for an hour and calls nothing: the writer writes it anyway.
    wait_until(
        lambda: stored(job_id) == (2, 3, "step 2: converting (takes an hour)"), 5, what="step 2"
    )
    assert time.monotonic() - reported >= 0.2  # not at once: the interval held it back
    assert WRITER.pending() == 0


@pytest.mark.django_db(transaction=True)
def test_jobs_are_throttled_each_on_its_own(in_job, monkeypatch):
    monkeypatch.setattr(job_progress, "PROGRESS_INTERVAL", 60.0)
    first, second = JobFactory(status=JobStatus.RUNNING), JobFactory(status=JobStatus.RUNNING)
    in_job(first)
    django_jobs.set_progress(1)
    in_job(second)
    django_jobs.set_progress(2)  # the first job's write does not hold back the second's
    wait_until(lambda: (stored(first.pk), stored(second.pk)) == ((1, None, ""), (2, None, "")))


@pytest.mark.django_db(transaction=True)
def test_a_value_the_database_refused_is_written_later(in_job, monkeypatch):
    monkeypatch.setattr(job_progress, "PROGRESS_INTERVAL", 0.2)
    job_id = in_job(JobFactory(status=JobStatus.RUNNING))
    real, failures = job_progress.write_report, []

    def flaky(db, pk, report):
        if len(failures) < 2:
            failures.append(report.done)
            raise OperationalError("simulated outage")
        return real(db, pk, report)

    monkeypatch.setattr(job_progress, "write_report", flaky)
    django_jobs.set_progress(3, 4, "almost")
    flush_progress(job_id)  # refused: left to the writer, never raised into the job
    wait_until(lambda: stored(job_id) == (3, 4, "almost"), 5, what="the retried write")
    assert failures == [3, 3]  # refused in the job's thread, then once by the writer


@pytest.mark.django_db(transaction=True)
def test_the_writer_closes_its_connection_once_the_last_reporting_job_has_ended(in_job):
    """Its connection would otherwise outlive the jobs (a test database could not be
    dropped after ``run_jobs --once`` in a test, say)."""
    # The writer is the process's: an earlier test's job (on this xdist worker, in any
    # order) may still have an entry, which the writer forgets only once its interval has
    # passed. Each is flushed as its job's end would flush it, so that this job is the
    # last one reporting; waiting for them to age out alone once took more than 5 s.
    for earlier in list(WRITER.entries):
        flush_progress(earlier)
    wait_until(lambda: not WRITER.entries, 10, what="the earlier tests' jobs forgotten")
    job_id = in_job(JobFactory(status=JobStatus.RUNNING))
    django_jobs.set_progress(1)
    wait_until(lambda: stored(job_id) == (1, None, ""), 5, what="the writer's write")
    assert WRITER.databases == {"default"}  # the writer thread's own connection
    flush_progress(job_id)  # the body ended; no other job of this process reports
    wait_until(lambda: not WRITER.databases, 2, what="the writer to close its connection")


@pytest.mark.django_db(transaction=True)
def test_a_write_neither_waits_for_nor_takes_the_locks_of_claims_and_finishes(in_job):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises every write: a progress write waits like any other")
    worker = ProcessFactory()
    job = JobFactory(status=JobStatus.RUNNING, concurrency_key="acct:1", concurrency_limit=1)
    neighbour = JobFactory(status=JobStatus.RUNNING)
    ClaimedExecution.objects.create(job=job, process=worker, concurrency_key="acct:1")
    Semaphore.objects.create(key="acct:1", limit=1, value=0)
    locked, release = threading.Event(), threading.Event()

    def hold_what_a_finish_holds() -> None:
        # A finish's locks, the job row's aside: the claim, the key, and other jobs' rows.
        try:
            with transaction.atomic():
                list(ClaimedExecution.objects.select_for_update().filter(job_id=job.pk))
                list(Semaphore.objects.select_for_update().filter(key="acct:1"))
                Job.objects.filter(pk=neighbour.pk).update(status=JobStatus.SUCCEEDED)
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_what_a_finish_holds)
    holder.start()
    try:
        assert locked.wait(10)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET lock_timeout = '3s'")
            else:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 3")
        in_job(job)
        django_jobs.set_progress(1, 2, "while the claim and the key are locked")
        began = time.monotonic()
        flush_progress(job.pk)
        assert time.monotonic() - began < 2
        assert stored(job.pk) == (1, 2, "while the claim and the key are locked")
    finally:
        release.set()
        holder.join(30)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET lock_timeout = 0")
            else:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 50")


# --- real workers -----------------------------------------------------------------------


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_a_worker_writes_what_sync_and_async_tasks_report(run_jobs, tmp_path):
    gate = tmp_path / "go"
    steps = progress_tasks.reports_steps.enqueue(str(gate))
    rows = progress_tasks.reports_from_async.enqueue(str(gate))
    proc = run_jobs("--processes", "1", "--threads", "2")
    wait_until(
        lambda: (
            (stored(steps.id), stored(rows.id))
            == ((1, 4, "step 1: downloading"), (5, None, "rows imported"))
        ),
        30,
        what="the first reports of both jobs",
    )
    assert {job_row(r).status for r in (steps, rows)} == {JobStatus.RUNNING}
    gate.write_text("go")
    wait_until(
        lambda: {job_row(r).status for r in (steps, rows)} == {JobStatus.SUCCEEDED},
        30,
        what="both jobs to succeed",
    )
    # The last reports came within the interval of the ones before: written all the same.
    wait_until(
        lambda: (stored(steps.id), stored(rows.id)) == ((4, 4, "done"), (7, None, "rows imported")),
        5,
        what="the last reports",
    )
    assert "could not write the progress" not in proc.output()
    assert "Traceback" not in proc.output(), proc.output()


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_the_last_report_is_on_the_row_by_the_time_the_job_reads_as_finished(run_jobs, tmp_path):
    gate = tmp_path / "go"
    result = progress_tasks.reports_steps.enqueue(str(gate))
    run_jobs("--processes", "1", "--threads", "1")
    wait_until(lambda: stored(result.id) == (1, 4, "step 1: downloading"), 30, what="step 1")
    # Steps 2 to 4 come well within the interval after step 1's write: the writer would
    # write them a second after it, long after the job's outcome is recorded.
    gate.write_text("go")

    def finished_row():
        row = (
            Job.objects.filter(pk=int(result.id))
            .values_list("status", "progress_done", "progress_message")
            .get()
        )
        return row if row[0] == JobStatus.SUCCEEDED else None

    # Status and progress read in one query: the outcome is never ahead of the progress.
    assert wait_until(finished_row, 30, interval=0.005, what="the job to succeed") == (
        JobStatus.SUCCEEDED,
        4,
        "done",
    )
