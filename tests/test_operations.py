"""Operator actions (``django_jobs.core.operator``): each acts only on the state it expects,
goes through the key's semaphore, and leaves the limit and the free count right."""

from __future__ import annotations

import pytest

from django_jobs import task as jobs_task
from django_jobs.core import operator as operations
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_job
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    ReadyExecution,
    Semaphore,
)
from tests import tasks
from tests.test_races import holders

pytestmark = pytest.mark.django_db(transaction=True)

DB = "default"
ALL = QueueSelector(("*",))
one_at_a_time = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_limit=1)
KEY = "tests.tasks.echo/acct:1"
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


def run_and_fail(task, value, worker) -> int:
    """Enqueue, claim, start and fail one job for good; return its id."""
    job_id = int(task.enqueue(value).id)
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert job.pk == job_id and start_job(DB, job, worker.pk, worker.name)
    outcome = fail_job(DB, job_id, worker.pk, BOOM, worker_id=worker.name)
    assert outcome is not None and not outcome.will_retry
    return job_id


def test_retry_gives_a_failed_job_exactly_one_more_attempt_and_keeps_its_history(worker):
    job_id = run_and_fail(tasks.echo, "x", worker)
    assert operations.retry_failed_job(DB, job_id)
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts, job.max_attempts, job.finished_at) == (
        JobStatus.READY,
        1,
        2,
        None,
    )
    assert ReadyExecution.objects.filter(job_id=job_id).exists()
    assert FailedExecution.objects.filter(job_id=job_id).count() == 1
    # Not failed any more: a second retry does nothing.
    assert not operations.retry_failed_job(DB, job_id)
    assert Job.objects.get(pk=job_id).max_attempts == 2

    # It fails again: failed for good again, not retried forever.
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert start_job(DB, job, worker.pk, worker.name)
    assert not fail_job(DB, job_id, worker.pk, BOOM).will_retry
    assert status(job_id) == JobStatus.FAILED
    assert list(
        FailedExecution.objects.filter(job_id=job_id).values_list("attempt", flat=True)
    ) == [1, 2]


def test_retry_waits_for_its_key_like_any_other_job(worker):
    failed = run_and_fail(one_at_a_time, 1, worker)
    holder = int(one_at_a_time.enqueue(1).id)
    assert operations.retry_failed_job(DB, failed)
    # The key is full (the holder is ready): the retried job is blocked, not ready.
    assert (status(holder), status(failed)) == (JobStatus.READY, JobStatus.BLOCKED)
    assert holders() == 1
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert job.pk == holder and start_job(DB, job, worker.pk, worker.name)
    assert finish_job(DB, holder, worker.pk, None)
    assert status(failed) == JobStatus.READY
    assert Semaphore.objects.get(key=KEY).value == 0


def test_only_finished_or_waiting_jobs_are_retried_or_discarded(worker):
    running = int(tasks.echo.enqueue("r").id)
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert start_job(DB, job, worker.pk, worker.name)
    ready = int(tasks.add.enqueue(1, 2).id)
    assert not operations.retry_failed_job(DB, running)
    assert not operations.retry_failed_job(DB, ready)
    assert not operations.discard(DB, running)
    assert status(running) == JobStatus.RUNNING
    assert ClaimedExecution.objects.filter(job_id=running).exists()
    assert operations.discard(DB, ready)
    assert status(ready) == JobStatus.DISCARDED
    assert not ReadyExecution.objects.filter(job_id=ready).exists()
    assert not operations.discard(DB, ready)
    assert not operations.retry_failed_job(DB, 10**9)


def test_discarding_a_failed_job_marks_it_and_keeps_its_errors(worker):
    job_id = run_and_fail(tasks.echo, "x", worker)
    finished_at = Job.objects.get(pk=job_id).finished_at
    assert operations.discard_many(DB, [job_id, job_id]) == 1
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.finished_at) == (JobStatus.DISCARDED, finished_at)
    assert FailedExecution.objects.filter(job_id=job_id).count() == 1
    assert not operations.retry_failed_job(DB, job_id)


def test_discarding_a_blocked_job_frees_nothing_and_a_ready_holder_frees_its_slot(worker):
    holder, blocked, next_one = (int(one_at_a_time.enqueue(1).id) for _ in range(3))
    assert operations.discard(DB, blocked)
    assert (status(holder), status(next_one)) == (JobStatus.READY, JobStatus.BLOCKED)
    assert operations.discard(DB, holder)
    assert status(next_one) == JobStatus.READY
    assert holders() == 1 and Semaphore.objects.get(key=KEY).value == 0


def test_run_now_admits_one_job_past_the_limit_and_nothing_more_until_under_it(worker):
    holder, bypass, waiting = (int(one_at_a_time.enqueue(1).id) for _ in range(3))
    assert operations.run_blocked_now(DB, bypass)
    assert (status(bypass), status(waiting)) == (JobStatus.READY, JobStatus.BLOCKED)
    assert holders() == 2 and Semaphore.objects.get(key=KEY).value == -1
    assert not operations.run_blocked_now(DB, bypass)  # not blocked any more
    assert not operations.run_blocked_now(DB, holder)

    first, second = claim_jobs(DB, worker.pk, ALL, 2)
    for job in (first, second):
        assert start_job(DB, job, worker.pk, worker.name)
    # One holder done: the key is back at its limit, so the waiting job still waits.
    assert finish_job(DB, first.pk, worker.pk, None)
    assert status(waiting) == JobStatus.BLOCKED
    assert finish_job(DB, second.pk, worker.pk, None)
    assert status(waiting) == JobStatus.READY
    assert holders() == 1 and Semaphore.objects.get(key=KEY).value == 0


def test_reconcile_repairs_a_drifted_count_and_promotes_what_fits(worker):
    holder, blocked = (int(one_at_a_time.enqueue(1).id) for _ in range(2))
    # Drift: the holder is gone without its slot being given back.
    ReadyExecution.objects.filter(job_id=holder).delete()
    Job.objects.filter(pk=holder).update(status=JobStatus.DISCARDED)
    assert status(blocked) == JobStatus.BLOCKED
    assert operations.reconcile(DB, KEY) == 1
    assert status(blocked) == JobStatus.READY
    assert not BlockedExecution.objects.exists()
    assert Semaphore.objects.get(key=KEY).value == 0
    assert operations.reconcile(DB, KEY) == 0
    assert operations.reconcile(DB, "no such key") == 0


def test_pause_and_resume_a_queue_and_say_whether_anything_changed(worker):
    job_id = int(tasks.add.enqueue(1, 2).id)
    assert operations.pause_queue(DB, "default")
    assert not operations.pause_queue(DB, "default")
    assert list(Pause.objects.values_list("queue_name", flat=True)) == ["default"]
    assert claim_jobs(DB, worker.pk, ALL, 5) == []
    assert operations.resume_queue(DB, "default")
    assert not operations.resume_queue(DB, "default")
    assert [job.pk for job in claim_jobs(DB, worker.pk, ALL, 5)] == [job_id]
