"""A worker's claim that is also the start, and the start taken back when the worker
does not run the job after all: attempts stay real starts."""

from __future__ import annotations

import pytest
from django.db import connection

from django_jobs import cancel
from django_jobs.core.claimed import fail_job, finish_job, release_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_jobs
from django_jobs.models import ClaimedExecution, FailedExecution, Job, JobStatus
from tests import batch_tasks, rate_tasks, tasks
from tests import transition_tasks as tt
from tests.test_query_counts import count

pytestmark = pytest.mark.django_db(transaction=True)

ALL = QueueSelector(("*",))
DB = "default"


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def claim(worker, limit: int = 10) -> list[Job]:
    return claim_jobs(DB, worker.pk, ALL, limit, worker_id=worker.name)


def test_the_claim_starts_the_jobs_at_no_extra_round_trip(worker):
    """PostgreSQL: in the claim's one statement. Elsewhere: in the claim's transaction,
    at the cost of a claim that only claims (one UPDATE of the jobs either way)."""
    others = [int(tasks.add.enqueue(i, 2).id) for i in range(3)]
    only_claiming = count(lambda: claim_jobs(DB, worker.pk, ALL, 10))
    assert Job.objects.get(pk=others[0]).status == JobStatus.CLAIMED
    ids = [int(tasks.add.enqueue(i, 1).id) for i in range(3)]
    claimed: list[Job] = []
    expected = 1 if connection.vendor == "postgresql" else only_claiming
    assert count(lambda: claimed.extend(claim(worker))) == expected
    assert [job.pk for job in claimed] == ids
    for job in [*claimed, *Job.objects.filter(pk__in=ids)]:
        assert (job.status, job.attempts, job.worker_ids) == (
            JobStatus.RUNNING,
            1,
            [worker.name],
        )
        assert job.started_at == job.last_attempted_at is not None
    assert ClaimedExecution.objects.filter(process_id=worker.pk, job_id__in=ids).count() == 3
    # Nothing is left for start_jobs to do, and the finish is the usual one.
    assert all(finish_job(DB, pk, worker.pk, None) for pk in ids)


def test_jobs_whose_start_decides_something_are_only_claimed(worker):
    """A rate limit is decided under its own lock, and a key unique until the start
    could not be taken back by a hand-back: both wait for start_jobs."""
    rated = int(rate_tasks.once_a_minute.enqueue(1).id)
    unique = int(batch_tasks.unique_while_waiting.enqueue(7).id)
    plain = int(tasks.add.enqueue(1, 1).id)
    jobs = {job.pk: job for job in claim(worker)}
    assert {pk: job.status for pk, job in jobs.items()} == {
        rated: JobStatus.CLAIMED,
        unique: JobStatus.CLAIMED,
        plain: JobStatus.RUNNING,
    }
    assert Job.objects.get(pk=unique).unique_lock is not None
    started = start_jobs(DB, [jobs[rated], jobs[unique]], worker.pk, worker.name)
    assert sorted(job.pk for job in started) == sorted([rated, unique])
    assert Job.objects.get(pk=unique).unique_lock is None
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}


def test_a_job_handed_back_unrun_costs_no_attempt(worker):
    """Claimed (and on PostgreSQL started) by a worker that then stops before running
    it: the hand-back takes the start back."""
    job_id = int(tasks.add.enqueue(1, 1).id)
    (job,) = claim(worker)
    assert release_job(DB, job_id, worker.pk)
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts, job.worker_ids, job.started_at) == (
        JobStatus.READY,
        0,
        [],
        None,
    )
    # Claimed again and run: its first attempt is attempt 1.
    (again,) = claim(worker)
    if again.status == JobStatus.CLAIMED:
        (again,) = start_jobs(DB, [again], worker.pk, worker.name)
    assert again.attempts == 1


def test_a_retried_job_handed_back_keeps_its_earlier_attempts(worker):
    job_id = int(tt.retried_at_once.enqueue().id)
    (job,) = claim(worker)
    if job.status == JobStatus.CLAIMED:
        start_jobs(DB, [job], worker.pk, worker.name)
    boom = ErrorInfo("builtins.ValueError", "boom", "boom")
    assert fail_job(DB, job_id, worker.pk, boom).will_retry
    first = Job.objects.get(pk=job_id)
    (job,) = claim(worker)
    assert release_job(DB, job_id, worker.pk)
    job = Job.objects.get(pk=job_id)
    assert (job.attempts, job.worker_ids, job.started_at) == (
        1,
        [worker.name],
        first.started_at,
    )


def test_a_job_whose_task_is_gone_fails_without_an_attempt(worker):
    job_id = int(tasks.add.enqueue(1, 1).id)
    Job.objects.filter(pk=job_id).update(task_path="tests.tasks.no_such_task")
    claim(worker)
    gone = ErrorInfo("django_jobs.exceptions.TaskNotFound", "gone", "gone")
    outcome = fail_job(DB, job_id, worker.pk, gone, retry=False, never_ran=True)
    assert outcome is not None and not outcome.will_retry
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 0)
    assert FailedExecution.objects.get(job_id=job_id).attempt == 0


def test_only_the_worker_claim_starts(worker):
    """Without a worker id (tests, tools) the claim only claims, on every database."""
    tasks.add.enqueue(1, 1)
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert (job.status, job.attempts) == (JobStatus.CLAIMED, 0)


def test_a_job_whose_cancel_was_requested_is_never_retried(worker):
    """Its attempt ended some other way (a shutdown, a timeout) before its worker saw the
    request: the request still holds."""
    job_id = int(tt.retried_at_once.enqueue().id)
    (job,) = claim(worker)
    if job.status == JobStatus.CLAIMED:
        start_jobs(DB, [job], worker.pk, worker.name)
    assert cancel(str(job_id)) == "requested"
    shutdown = ErrorInfo("django_jobs.exceptions.WorkerShutdown", "stop", "stop")
    assert not fail_job(DB, job_id, worker.pk, shutdown).will_retry
    assert Job.objects.get(pk=job_id).status == JobStatus.FAILED
