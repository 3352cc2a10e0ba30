"""``manage.py prune_jobs`` and the pruning it shares with the dispatcher, on a real database."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs.core.maintenance import clear_finished_jobs, prune_finished_jobs, prune_round
from django_jobs.core.operator import retry_failed_job
from django_jobs.models import Batch, FailedExecution, Job, JobStatus, ReadyExecution
from tests.factories import (
    ClaimedExecutionFactory,
    FailedExecutionFactory,
    FinishedJobFactory,
    JobFactory,
    ReadyExecutionFactory,
    ScheduledExecutionFactory,
)

DAY = timedelta(days=1)


def ago(delta: timedelta):
    return timezone.now() - delta


def finished(status: str, when, failures: int = 0) -> Job:
    """A finished job, with one failure row per failed attempt."""
    job = FinishedJobFactory(status=status, finished_at=when, attempts=max(1, failures))
    for attempt in range(1, failures + 1):
        FailedExecutionFactory(job=job, attempt=attempt)
    return job


def prune(*args: str) -> str:
    out = StringIO()
    call_command("prune_jobs", *args, stdout=out)
    return out.getvalue()


def plant_history() -> dict[str, list[Job]]:
    """Old and recent finished jobs of every status, and jobs still under way."""
    old = ago(8 * DAY)
    live_with_failure = ClaimedExecutionFactory(
        job=JobFactory(status=JobStatus.RUNNING, attempts=2, max_attempts=3)
    ).job
    FailedExecutionFactory(job=live_with_failure, attempt=1)  # attempt 1 failed, 2 running
    return {
        "old": [
            *(finished(JobStatus.SUCCEEDED, old) for _ in range(3)),
            finished(JobStatus.FAILED, old, failures=2),
            finished(JobStatus.FAILED, old, failures=1),
            finished(JobStatus.DISCARDED, old),
        ],
        "kept": [
            finished(JobStatus.SUCCEEDED, ago(DAY)),
            finished(JobStatus.FAILED, ago(DAY), failures=1),
            # Waiting or running jobs, enqueued long ago, stay whatever their age.
            ReadyExecutionFactory(job=JobFactory(enqueued_at=old)).job,
            ScheduledExecutionFactory(job__enqueued_at=old).job,
            live_with_failure,
        ],
    }


@pytest.mark.django_db
def test_prune_jobs_deletes_old_finished_jobs_and_their_failures_only():
    jobs = plant_history()
    output = prune("--older-than", "7d")
    assert set(Job.objects.values_list("pk", flat=True)) == {job.pk for job in jobs["kept"]}
    # The failure rows of the kept jobs stay: the recent failure's, the running job's attempt 1.
    assert set(FailedExecution.objects.values_list("job_id", flat=True)) == {
        jobs["kept"][1].pk,
        jobs["kept"][4].pk,
    }
    assert "Deleted 6 job(s) finished before " in output
    assert "(older than 7 days): succeeded 3, failed 2, discarded 1; 3 failure row(s); " in output
    assert output.rstrip().endswith("0 completed batch(es).")


@pytest.mark.django_db
def test_dry_run_counts_what_would_go_and_deletes_nothing():
    plant_history()
    before = (Job.objects.count(), FailedExecution.objects.count())
    output = prune("--older-than", "7d", "--dry-run")
    assert output.startswith("Would delete 6 job(s)")
    assert "succeeded 3, failed 2, discarded 1; 3 failure row(s)" in output
    assert (Job.objects.count(), FailedExecution.objects.count()) == before
    assert prune("--older-than", "7d").startswith("Deleted 6 job(s)")


@pytest.mark.django_db
def test_status_filter_prunes_only_those_and_leaves_batches_alone():
    old = ago(8 * DAY)
    succeeded = finished(JobStatus.SUCCEEDED, old)
    failed = finished(JobStatus.FAILED, old, failures=1)
    discarded = finished(JobStatus.DISCARDED, old)
    batch = Batch.objects.create(total=1, pending=0, succeeded=1, finished_at=old)
    output = prune("--older-than", "7d", "--status", "failed,discarded")
    assert set(Job.objects.values_list("pk", flat=True)) == {succeeded.pk}
    assert not Job.objects.filter(pk__in=[failed.pk, discarded.pk]).exists()
    assert Batch.objects.filter(pk=batch.pk).exists()
    assert "failed 1, discarded 1; 1 failure row(s)." in output
    assert "batch" not in output


@pytest.mark.django_db
def test_default_age_is_clear_finished_jobs_after(settings):
    settings.DJANGO_JOBS = {"clear_finished_jobs_after": 3600}
    older = finished(JobStatus.SUCCEEDED, ago(timedelta(hours=2)))
    newer = finished(JobStatus.SUCCEEDED, ago(timedelta(minutes=30)))
    assert "(older than 1 hour)" in prune()
    assert set(Job.objects.values_list("pk", flat=True)) == {newer.pk}
    assert not Job.objects.filter(pk=older.pk).exists()


@pytest.mark.django_db
def test_without_a_default_age_it_asks_for_one(settings):
    settings.DJANGO_JOBS = {"clear_finished_jobs_after": None}
    finished(JobStatus.SUCCEEDED, ago(400 * DAY))
    with pytest.raises(CommandError, match="--older-than"):
        prune()
    assert Job.objects.count() == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "7x"], "is not an age"),
        (["--older-than=-1d"], "is not an age"),
        (["--status", "running"], "not a finished status: running"),
        (["--batch-size", "0"], "at least 1"),
        (["--older-than", "0"], "a moment ago"),
        (["--older-than", "0d"], "a moment ago"),
        (["--older-than", "99999999999d"], "nothing is that old"),
        (["--older-than", "failed=30d,running=1d"], "not a finished status: running"),
        (["--older-than", "failed=30d,failed=1d"], "two ages"),
        (["--older-than", "failed=0"], "a moment ago"),
        (["--older-than", "failed=30d,1d"], "names no status"),
        (["--rest", "-1"], "--rest must be"),
        (["--rest", "nan"], "--rest must be"),
        (["--rest", "1e9"], "--rest must be"),
    ],
)
@pytest.mark.django_db
def test_bad_arguments_are_refused(args, message):
    finished(JobStatus.SUCCEEDED, ago(400 * DAY))
    with pytest.raises(CommandError, match=message):
        prune(*args)
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_an_age_per_status_on_the_command_line_keeps_the_statuses_left_out():
    old, older = ago(3 * DAY), ago(40 * DAY)
    jobs = {
        (status, when): finished(status, when, failures=int(status == JobStatus.FAILED))
        for status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DISCARDED)
        for when in (old, older)
    }
    output = prune("--older-than", "succeeded=1d,failed=30d")
    kept = {
        (job.status, when)
        for (_, when), job in jobs.items()
        if Job.objects.filter(pk=job.pk).exists()
    }
    assert kept == {
        (JobStatus.FAILED, old),
        (JobStatus.DISCARDED, old),
        (JobStatus.DISCARDED, older),
    }
    assert "Deleted 3 job(s): succeeded 2 finished before " in output
    assert "(older than 1 day), failed 1 finished before " in output
    assert "(older than 30 days); 1 failure row(s)." in output  # batches need all three


@pytest.mark.django_db
def test_retention_per_status_from_the_settings(settings):
    """A status left out keeps the default 7 days; None keeps it forever."""
    settings.DJANGO_JOBS = {"clear_finished_jobs_after": {"succeeded": 3600, "discarded": None}}
    jobs = {
        "succeeded 2h": finished(JobStatus.SUCCEEDED, ago(timedelta(hours=2))),
        "succeeded 30m": finished(JobStatus.SUCCEEDED, ago(timedelta(minutes=30))),
        "failed 6d": finished(JobStatus.FAILED, ago(6 * DAY)),
        "failed 8d": finished(JobStatus.FAILED, ago(8 * DAY)),
        "discarded 400d": finished(JobStatus.DISCARDED, ago(400 * DAY)),
    }
    assert clear_finished_jobs("default", settings.DJANGO_JOBS["clear_finished_jobs_after"]) == 2
    kept = {name for name, job in jobs.items() if Job.objects.filter(pk=job.pk).exists()}
    assert kept == {"succeeded 30m", "failed 6d", "discarded 400d"}
    finished(JobStatus.SUCCEEDED, ago(timedelta(hours=3)))
    assert "Deleted 1 job(s): succeeded 1 finished before" in prune()


@pytest.mark.parametrize(
    ("age", "seconds"), [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("45", 45)]
)
@pytest.mark.django_db
def test_ages_in_every_unit(age, seconds):
    just_older = finished(JobStatus.SUCCEEDED, ago(timedelta(seconds=seconds + 60)))
    just_newer = finished(JobStatus.SUCCEEDED, ago(timedelta(seconds=seconds - 30)))
    prune("--older-than", age)
    assert set(Job.objects.values_list("pk", flat=True)) == {just_newer.pk}
    assert just_older.pk not in set(Job.objects.values_list("pk", flat=True))


@pytest.mark.django_db
def test_completed_batches_go_unless_a_callback_has_not_ended():
    old = ago(8 * DAY)
    done = Batch.objects.create(total=2, pending=0, succeeded=2, finished_at=old)
    callback_done = finished(JobStatus.SUCCEEDED, old)
    with_done_callback = Batch.objects.create(
        total=1, pending=0, finished_at=old, callback_jobs={"on_finish": callback_done.pk}
    )
    waiting_callback = ReadyExecutionFactory().job
    with_waiting_callback = Batch.objects.create(
        total=1, pending=0, finished_at=old, callback_jobs={"on_finish": waiting_callback.pk}
    )
    counting = Batch.objects.create(total=3, pending=1, succeeded=2)
    recent = Batch.objects.create(total=1, pending=0, succeeded=1, finished_at=ago(DAY))
    assert "2 completed batch(es)" in prune("--older-than", "7d", "--dry-run")
    output = prune("--older-than", "7d")
    assert set(Batch.objects.values_list("pk", flat=True)) == {
        with_waiting_callback.pk,
        counting.pk,
        recent.pk,
    }
    assert not Batch.objects.filter(pk__in=[done.pk, with_done_callback.pk]).exists()
    assert "2 completed batch(es)." in output


@pytest.mark.django_db
def test_pruning_never_touches_the_execution_tables_workers_use():
    """A finished job has no ready, scheduled, blocked or claimed row: no statement on them.

    ``QuerySet.delete()`` on jobs ran a ``DELETE ... IN`` on each of them, which on InnoDB
    can scan and wait for rows that workers hold.
    """
    plant_history()
    with CaptureQueriesContext(connection) as queries:
        prune("--older-than", "7d")
    hot = ("readyexecution", "scheduledexecution", "blockedexecution", "claimedexecution")
    touched = [q["sql"] for q in queries.captured_queries if any(t in q["sql"] for t in hot)]
    assert touched == []


def other_connection(query):
    """Run ``query()`` in another thread, with its own database connection."""

    def run():
        try:
            return query()
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result(timeout=30)


@pytest.mark.django_db(transaction=True)
def test_each_batch_is_committed_on_its_own():
    """Other connections see the jobs go batch by batch: no transaction holds them all."""
    old = ago(8 * DAY)
    for _ in range(25):
        finished(JobStatus.FAILED, old, failures=1)
    seen: list[tuple[int, int]] = []

    def after_batch(counts):
        seen.append((counts.total_jobs, other_connection(Job.objects.count)))

    counts = prune_finished_jobs(
        "default", ago(7 * DAY), batch_size=10, batches=False, on_batch=after_batch
    )
    assert seen == [(10, 15), (20, 5), (25, 0)]
    assert (counts.total_jobs, counts.failures) == (25, 25)


@pytest.mark.django_db
def test_max_rounds_stops_early_and_the_next_call_goes_on():
    old = ago(8 * DAY)
    for _ in range(7):
        finished(JobStatus.SUCCEEDED, old)
    batch = Batch.objects.create(total=7, pending=0, succeeded=7, finished_at=old)
    first = prune_finished_jobs("default", ago(7 * DAY), batch_size=3, max_rounds=2)
    assert (first.total_jobs, first.batches) == (6, 0)
    assert Job.objects.count() == 1 and Batch.objects.filter(pk=batch.pk).exists()
    rest = prune_finished_jobs("default", ago(7 * DAY), batch_size=3, max_rounds=2)
    assert (rest.total_jobs, rest.batches) == (1, 1)
    assert not Job.objects.exists() and not Batch.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_job_retried_meanwhile_is_kept_with_its_history():
    old = ago(8 * DAY)
    failed = finished(JobStatus.FAILED, old, failures=1)
    other = finished(JobStatus.FAILED, old, failures=1)
    assert retry_failed_job("default", failed.pk)
    counts = prune_finished_jobs("default", ago(7 * DAY))
    assert counts.total_jobs == 1
    assert set(Job.objects.values_list("pk", flat=True)) == {failed.pk}
    assert not Job.objects.filter(pk=other.pk).exists()
    assert FailedExecution.objects.filter(job_id=failed.pk).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_job_row_someone_holds_is_skipped_not_waited_for():
    """An operator retrying an old failed job holds its row: the prune goes on without it."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: its transactions are serialised as a whole")
    old = ago(8 * DAY)
    held = finished(JobStatus.FAILED, old, failures=1)
    others = [finished(JobStatus.FAILED, old, failures=1) for _ in range(3)]
    locked = threading.Event()
    release = threading.Event()

    def hold():
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=held.pk)
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    def run_prune():
        try:
            return prune_finished_jobs("default", ago(7 * DAY))
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    pool = ThreadPoolExecutor(1)
    try:
        assert locked.wait(10)
        future = pool.submit(run_prune)
        try:
            # Waiting for the held row would take until release: 30 s.
            counts = future.result(timeout=10)
        finally:
            release.set()
    finally:
        pool.shutdown()
        holder.join(30)
    assert counts.total_jobs == 3
    assert set(Job.objects.values_list("pk", flat=True)) == {held.pk}
    assert not Job.objects.filter(pk__in=[job.pk for job in others]).exists()
    assert prune_finished_jobs("default", ago(7 * DAY)).total_jobs == 1
    assert not Job.objects.exists()


def retry_during_a_prune_round(monkeypatch, round_with_hook) -> Job:
    """An operator's retry of an old failed job holds its row, uncommitted, while a prune
    round reads the jobs; it commits only once the round has read them. Returns the job.

    No database constraint ties a ready row to its job (``Job``'s docstring): what keeps
    the retried job is the prune taking the row under its lock and reading the status
    there. ``round_with_hook(read_done, ...)`` is the round under test, calling
    ``read_done.set()`` once it has read the jobs it will delete.
    """
    old = ago(8 * DAY)
    retried_job = finished(JobStatus.FAILED, old, failures=1)
    other = finished(JobStatus.FAILED, old, failures=1)
    retried = threading.Event()
    read_done = threading.Event()

    def retry() -> None:
        try:
            with transaction.atomic():
                assert retry_failed_job("default", retried_job.pk)
                retried.set()
                assert read_done.wait(10), "the prune never read the jobs"
        finally:
            connection.close()

    def hooked(db, status, *args):
        if status != JobStatus.FAILED:  # the retried job's round only
            return prune_round(db, status, *args)
        return round_with_hook(read_done, db, status, *args)

    monkeypatch.setattr("django_jobs.core.maintenance.prune_round", hooked)
    retrier = threading.Thread(target=retry)
    retrier.start()
    try:
        assert retried.wait(10)
        counts = other_connection(lambda: prune_finished_jobs("default", ago(7 * DAY)))
    finally:
        read_done.set()
        retrier.join(30)
    assert not Job.objects.filter(pk=other.pk).exists()
    assert counts.jobs[JobStatus.FAILED] >= 1
    return retried_job


def ours_then_hook(read_done, *args):
    """Ours: one round, reading and deleting under its locks; the hook after it."""
    try:
        return prune_round(*args)
    finally:
        read_done.set()


def unguarded_round(read_done, db, status, cutoff, after, batch_size):
    """The unprotected twin: the ids read without a lock, deleted by id alone."""
    from django_jobs.db import ops
    from django_jobs.db.rows import PrunedRound

    ids = list(
        Job.objects.using(db)
        .filter(status=status, finished_at__lt=cutoff)
        .values_list("pk", flat=True)[:batch_size]
    )
    read_done.set()
    with transaction.atomic(using=db):
        failures = ops(db).delete_executions(db, FailedExecution, ids)
        deleted = ops(db).delete_by_pk(db, Job, ids)
    return PrunedRound(deleted, failures, None)


def needs_row_locks():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: a retry and a prune are serialised as a whole")


@pytest.mark.django_db(transaction=True)
def test_a_retry_in_flight_during_the_prune_keeps_its_job(monkeypatch):
    needs_row_locks()
    job = retry_during_a_prune_round(monkeypatch, ours_then_hook)
    assert Job.objects.get(pk=job.pk).status == JobStatus.READY
    assert ReadyExecution.objects.filter(job_id=job.pk).exists()
    assert FailedExecution.objects.filter(job_id=job.pk).count() == 1


@pytest.mark.django_db(transaction=True)
def test_unprotected_prune_deletes_a_job_retried_in_flight_leaving_its_ready_row(monkeypatch):
    needs_row_locks()
    job = retry_during_a_prune_round(monkeypatch, unguarded_round)
    assert not Job.objects.filter(pk=job.pk).exists()
    assert ReadyExecution.objects.filter(job_id=job.pk).exists()  # an orphan a worker would claim
