"""A worker's record of the jobs its threads run, against a job claimed again by the same
process while the thread of its previous attempt is still on its way out."""

from __future__ import annotations

import pytest

from django_jobs.conf import JobsSettings
from django_jobs.core.claimed import fail_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.models import ClaimedExecution, Job, JobStatus, Process
from django_jobs.runtime import worker as worker_module
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.worker import Worker
from tests import tasks

pytestmark = pytest.mark.django_db(transaction=True)

DB = "default"
ALL = QueueSelector(("*",))


def test_the_end_of_an_attempt_leaves_the_next_attempts_claim_alone(monkeypatch):
    """Attempt 1 fails and is retried at once (no backoff); this process claims the job
    again (attempt 2) before attempt 1's thread has left ``run_one``. That thread must not
    take attempt 2 out of ``running``: the check for orphaned claims would then hand back
    a job that is running, undoing its attempt, and attempt 2 would run twice."""
    process = register_process(DB, Process.Kind.WORKER)
    worker = Worker(JobsSettings.load(threads=2), process.pk, process.name, Lifecycle(), once=True)
    try:
        job_id = int(tasks.always_fails.enqueue().id)
        (first,) = claim_jobs(DB, process.pk, ALL, 1, worker_id=process.name)
        error = ErrorInfo("builtins.ValueError", "boom", "boom")
        outcome = fail_job(DB, job_id, process.pk, error, worker_id=process.name, retry=True)
        assert outcome is not None and outcome.retry_at is not None
        (second,) = claim_jobs(DB, process.pk, ALL, 1, worker_id=process.name)
        assert (second.pk, second.attempts) == (job_id, 2)
        worker.running[second.pk] = second  # as claim_and_submit records it
        # Attempt 1's thread, its failure already written, now leaves run_one.
        monkeypatch.setattr(worker_module, "execute_job", lambda job, ctx, started: None)
        worker.run_one(first, started=True)
        assert worker.running == {job_id: second}
        worker.release_orphaned_claims()
        job = Job.objects.get(pk=job_id)
        assert (job.status, job.attempts) == (JobStatus.RUNNING, 2)
        assert ClaimedExecution.objects.filter(job_id=job_id, process_id=process.pk).exists()
        # The second attempt's own end takes its entry out.
        worker.run_one(second, started=True)
        assert worker.running == {}
    finally:
        worker.pool.shutdown()
