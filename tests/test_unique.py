"""Unique jobs: a duplicate enqueue returns the holder's result; the key is let go of
exactly when the job leaves the states it covers (``unique_until``)."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.tasks.exceptions import InvalidTask
from django.tasks.signals import task_enqueued
from django.utils import timezone

from django_jobs import bulk_enqueue, enqueue_batch
from django_jobs import task as jobs_task
from django_jobs.core import operator as operations
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.operator import discard_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import Job, JobStatus, ScheduledExecution
from tests import batch_tasks as bt
from tests import tasks

pytestmark = pytest.mark.django_db

DB = "default"
ALL = QueueSelector(("*",))
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def claim_and_start(worker, job_id: int, start: bool = True):
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert job.pk == job_id
    if start:
        assert start_job(DB, job, worker.pk, worker.name)
    return job


def test_a_duplicate_gets_the_holders_result_and_no_new_row():
    first = bt.unique_report.enqueue(7)
    second = bt.unique_report.enqueue(account_id=7)
    other = bt.unique_report.enqueue(8)
    assert second.id == first.id
    assert other.id != first.id
    assert Job.objects.filter(task_path="tests.batch_tasks.unique_report").count() == 2
    job = Job.objects.get(pk=int(first.id))
    assert job.unique_key == job.unique_lock == "tests.batch_tasks.unique_report/report:7"


def test_the_key_is_per_task():
    same_template = jobs_task(tasks.echo.func, unique_key="report:{value}")
    mine = bt.unique_report.enqueue(7)
    theirs = same_template.enqueue(7)
    assert mine.id != theirs.id


def test_a_duplicate_sends_no_enqueued_signal():
    seen: list[str] = []

    def receiver(sender, task_result, **kwargs):
        seen.append(task_result.id)

    task_enqueued.connect(receiver)
    try:
        first = bt.unique_report.enqueue(1)
        bt.unique_report.enqueue(1)
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [first.id]


def test_until_finish_covers_running_and_lets_go_at_success(worker):
    first = int(bt.unique_report.enqueue(3).id)
    claim_and_start(worker, first)
    assert int(bt.unique_report.enqueue(3).id) == first  # running: still covered
    assert finish_job(DB, first, worker.pk, 3)
    assert Job.objects.get(pk=first).unique_lock is None
    assert int(bt.unique_report.enqueue(3).id) != first


def test_until_start_covers_waiting_and_claimed_only(worker):
    first = int(bt.unique_while_waiting.enqueue(3).id)
    job = claim_and_start(worker, first, start=False)
    assert int(bt.unique_while_waiting.enqueue(3).id) == first  # claimed, not started
    assert start_job(DB, job, worker.pk, worker.name)
    assert Job.objects.get(pk=first).unique_lock is None
    second = int(bt.unique_while_waiting.enqueue(3).id)
    assert second != first
    assert Job.objects.get(pk=second).unique_lock is not None


def test_a_retry_keeps_the_key_and_failing_for_good_lets_go(worker):
    first = int(bt.unique_flaky.enqueue(5).id)
    claim_and_start(worker, first)
    outcome = fail_job(DB, first, worker.pk, BOOM)
    assert outcome is not None and outcome.will_retry
    assert Job.objects.get(pk=first).status == JobStatus.SCHEDULED
    assert int(bt.unique_flaky.enqueue(5).id) == first  # waiting for its retry: covered
    ScheduledExecution.objects.filter(job_id=first).update(scheduled_at=timezone.now())
    assert promote_due_jobs(DB, 10) == 1
    claim_and_start(worker, first)
    outcome = fail_job(DB, first, worker.pk, BOOM)
    assert outcome is not None and not outcome.will_retry
    assert Job.objects.get(pk=first).unique_lock is None
    assert int(bt.unique_flaky.enqueue(5).id) != first


def test_discarding_a_waiting_job_lets_go():
    first = int(bt.unique_report.enqueue(9).id)
    assert discard_job(DB, first)
    assert Job.objects.get(pk=first).unique_lock is None
    assert int(bt.unique_report.enqueue(9).id) != first


def test_a_job_discarded_by_its_full_key_lets_go():
    holder = int(bt.unique_discarding.enqueue(1, 1).id)
    dropped = int(bt.unique_discarding.enqueue(1, 2).id)
    assert Job.objects.get(pk=dropped).status == JobStatus.DISCARDED
    assert Job.objects.get(pk=dropped).unique_lock is None
    assert Job.objects.get(pk=holder).unique_lock is not None


def test_a_rolled_back_enqueue_leaves_the_key_free():
    with pytest.raises(RuntimeError), transaction.atomic():
        bt.unique_report.enqueue(4)
        raise RuntimeError("roll back")
    assert not Job.objects.exists()
    assert Job.objects.filter(pk=int(bt.unique_report.enqueue(4).id)).exists()


def test_duplicates_inside_one_bulk_enqueue_collapse_to_one_job():
    results = bulk_enqueue(
        [
            (bt.unique_report, [1], {}),
            (tasks.add, [1, 2], {}),
            (bt.unique_report, [1], {}),
            (bt.unique_report, [2], {}),
        ]
    )
    assert results[0].id == results[2].id
    assert len({r.id for r in results}) == 3
    assert Job.objects.count() == 3


def test_a_duplicate_inside_a_transaction_keeps_that_transaction_usable():
    with transaction.atomic():
        first = bt.unique_report.enqueue(6)
        again = bt.unique_report.enqueue(6)
        after = tasks.add.enqueue(1, 1)
    assert again.id == first.id
    assert Job.objects.filter(pk=int(after.id)).exists()


def test_bad_unique_options_fail_at_declaration():
    with pytest.raises(InvalidTask, match="names 'nope'"):
        jobs_task(tasks.echo.func, unique_key="{nope}")
    with pytest.raises(InvalidTask, match="unique_until"):
        jobs_task(tasks.echo.func, unique_key="{value}", unique_until="never")
    with pytest.raises(InvalidTask, match="unique_key"):
        jobs_task(tasks.echo.func, unique_key="")


def test_a_unique_task_cannot_be_a_batch_item():
    with pytest.raises(InvalidTask, match="unique"):
        enqueue_batch([(bt.unique_report, [1], {})], on_finish=bt.callback)
    assert not Job.objects.exists()


def test_an_operator_retry_takes_the_key_back_or_is_refused(worker):
    first = int(bt.unique_report.enqueue(7).id)
    claim_and_start(worker, first)
    assert fail_job(DB, first, worker.pk, BOOM, retry=False) is not None
    assert operations.retry_failed_job(DB, first)
    assert Job.objects.get(pk=first).unique_lock is not None
    assert int(bt.unique_report.enqueue(7).id) == first  # waiting again: covered again
    # Failed again, and meanwhile another job took the key: the retry is refused.
    claim_and_start(worker, first)
    assert fail_job(DB, first, worker.pk, BOOM, retry=False) is not None
    other = int(bt.unique_report.enqueue(7).id)
    assert other != first
    assert not operations.retry_failed_job(DB, first)
    assert Job.objects.get(pk=first).status == JobStatus.FAILED
    assert Job.objects.filter(unique_lock__isnull=False).get().pk == other
