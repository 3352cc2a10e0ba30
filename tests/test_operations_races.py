"""Operator actions racing the worker and each other, forced with two real connections.

Same method as ``test_races``: one transaction is paused at the dangerous point,
the other path runs and is seen blocking on the row lock (or finishing, which is
the buggy order), then the first resumes. PostgreSQL and MariaDB only.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction  # noqa: F401  (skipif reads connection)

from django_jobs.core import admission
from django_jobs.core import operator as operations
from django_jobs.core.claimed import finish_job
from django_jobs.core.processes import register_process
from django_jobs.models import Job, JobStatus, ReadyExecution, Semaphore
from tests.test_operations import run_and_fail
from tests.test_races import (
    DB,
    KEY,
    Paused,
    Runner,
    holders,
    one_at_a_time,
    started_job,
    stranded,
    wait_for,
)


@pytest.fixture
def worker():
    return register_process(DB, "worker")


pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
    ),
]


def race_retry_against_finish(monkeypatch, worker):
    """A failed job of a full key is retried while the key's holder finishes."""
    failed = run_and_fail(one_at_a_time, 1, worker)
    holder = started_job(one_at_a_time, 1, worker)
    paused = Paused(monkeypatch, admission, "lock_semaphore")
    retry = Runner(lambda: operations.retry_failed_job(DB, failed), paused)
    retry.start()
    assert paused.reached.wait(10)  # the retry has read the semaphore: full
    finish = Runner(lambda: finish_job(DB, holder.pk, worker.pk, None))
    finish.start()
    wait_for(finish.blocked_or_done, "the finish to block or end")
    paused.resume.set()
    assert retry.finish() is True
    assert finish.finish() is True
    return failed


def test_a_retry_racing_a_finish_never_strands_the_retried_job(monkeypatch, worker):
    failed = race_retry_against_finish(monkeypatch, worker)
    assert Job.objects.get(pk=failed).status == JobStatus.READY
    assert not stranded()
    assert holders() == 1 and Semaphore.objects.get(key=KEY).value == 0


def test_a_retry_unprotected_strands_the_retried_job(monkeypatch, worker):
    """Without the semaphore lock in the retry's admission, the same order strands it."""

    def unlocked(db, key, limit):
        found = Semaphore.objects.using(db).filter(key=key).first()
        return found or Semaphore.objects.using(db).create(key=key, limit=limit, value=limit)

    monkeypatch.setattr(admission, "lock_semaphore", unlocked)
    failed = race_retry_against_finish(monkeypatch, worker)
    assert Job.objects.get(pk=failed).status == JobStatus.BLOCKED
    assert stranded()


def race_two_retries(monkeypatch, worker, retry):
    failed = run_and_fail(one_at_a_time, 2, worker)
    paused = Paused(monkeypatch, operations.admission, "admit_jobs")
    first = Runner(lambda: retry(DB, failed), paused)
    first.start()
    assert paused.reached.wait(10)  # the first retry has admitted the job, not committed
    second = Runner(lambda: retry(DB, failed))
    second.start()
    wait_for(second.blocked_or_done, "the second retry to block or end")
    paused.resume.set()
    return failed, first, second


def test_two_operators_retrying_one_job_retry_it_once(monkeypatch, worker):
    failed, first, second = race_two_retries(monkeypatch, worker, operations.retry_failed_job)
    assert (first.finish(), second.finish()) == (True, False)
    job = Job.objects.get(pk=failed)
    assert (job.status, job.attempts, job.max_attempts) == (JobStatus.READY, 1, 2)
    assert ReadyExecution.objects.filter(job_id=failed).count() == 1
    assert Semaphore.objects.get(key="tests.tasks.echo/acct:2").value == 0


def test_two_retries_unprotected_both_act(monkeypatch, worker):
    """A retry that checks the status without locking the job row lets both through."""

    def unlocked_retry(db, job_id):
        with transaction.atomic(using=db):
            job = Job.objects.using(db).get(pk=job_id)
            if job.status != JobStatus.FAILED:
                return False
            job.max_attempts = job.attempts + 1
            job.save(using=db, update_fields=["max_attempts"])
            operations.admission.admit_jobs(db, [job])
        return True

    failed, first, second = race_two_retries(monkeypatch, worker, unlocked_retry)
    assert first.finish() is True
    # The second read "failed" before the first committed: it admitted the job again
    # (blocked behind its own first admission), so one job holds two execution rows.
    assert second.finish() is True
    assert Job.objects.get(pk=failed).status == JobStatus.BLOCKED
    assert ReadyExecution.objects.filter(job_id=failed).exists()


def test_run_now_racing_the_finish_that_promotes_the_same_job_admits_it_once(monkeypatch, worker):
    holder = started_job(one_at_a_time, 1, worker)
    blocked = int(one_at_a_time.enqueue(1).id)
    paused = Paused(monkeypatch, admission, "lock_existing_semaphore", before=True)
    run_now = Runner(lambda: operations.run_blocked_now(DB, blocked), paused)
    run_now.start()
    assert paused.reached.wait(10)  # it saw the job blocked, before taking the key's lock
    assert finish_job(DB, holder.pk, worker.pk, None)  # promotes that same job
    paused.resume.set()
    assert run_now.finish() is False  # re-read under the lock: no longer blocked
    assert Job.objects.get(pk=blocked).status == JobStatus.READY
    assert holders() == 1 and Semaphore.objects.get(key=KEY).value == 0
