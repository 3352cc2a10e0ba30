"""Batches: items count down under the batch's lock in their own finalisation; the
transaction that reaches zero enqueues the callbacks, once, with the counts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.tasks.exceptions import InvalidTask
from django.utils import timezone

from django_jobs import enqueue_batch
from django_jobs.core import operator as operations
from django_jobs.core.batches import current_job_id
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.maintenance import clear_finished_jobs
from django_jobs.core.operator import discard_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import (
    Batch,
    BlockedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    ScheduledExecution,
)
from django_jobs.testing import run_enqueued_jobs
from tests import batch_tasks as bt

pytestmark = pytest.mark.django_db

DB = "default"
ALL = QueueSelector(("*",))
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def items(n: int, task=bt.item):
    return [(task, [i], {}) for i in range(n)]


def run(worker, job_id: int, *, fail: bool = False):
    """Claim (just this job), start and finish or fail it, as a worker would."""
    others = list(ReadyExecution.objects.exclude(job_id=job_id).values_list("job_id", flat=True))
    ReadyExecution.objects.filter(job_id__in=others).update(queue_name="parked")
    try:
        (job,) = claim_jobs(DB, worker.pk, QueueSelector(("default", "reports")), 1)
    finally:
        ReadyExecution.objects.filter(job_id__in=others).update(queue_name="default")
    assert job.pk == job_id
    assert start_job(DB, job, worker.pk, worker.name)
    if fail:
        return fail_job(DB, job_id, worker.pk, BOOM)
    return finish_job(DB, job_id, worker.pk, None)


def callbacks(batch_id: int) -> dict[str, Job]:
    batch = Batch.objects.get(pk=batch_id)
    return {name: Job.objects.get(pk=pk) for name, pk in batch.callback_jobs.items()}


def test_the_last_item_enqueues_on_finish_and_on_success_with_the_counts():
    made = enqueue_batch(
        items(3),
        on_finish=bt.callback,
        on_success=bt.report_callback,
        on_failure=bt.callback,
        description="import",
    )
    batch = made.refresh()
    assert (batch.total, batch.pending, batch.description) == (3, 3, "import")
    assert all(Job.objects.get(pk=int(r.id)).batch_id == made.id for r in made.results)
    assert run_enqueued_jobs(limit=2).outcomes == ["succeeded"] * 2
    assert made.refresh().pending == 1 and callbacks(made.id) == {}
    (last,) = run_enqueued_jobs(limit=1)
    assert (last.job_id, last.outcome) == (int(made.results[2].id), "succeeded")
    batch = made.refresh()
    assert (batch.pending, batch.succeeded, batch.failed) == (0, 3, 0)
    assert batch.finished_at is not None
    fired = callbacks(made.id)
    assert set(fired) == {"on_finish", "on_success"}
    expected = {"batch_id": made.id, "succeeded": 3, "failed": 0}
    assert fired["on_finish"].kwargs == expected
    assert fired["on_finish"].task_path == "tests.batch_tasks.callback"
    assert fired["on_finish"].status == JobStatus.READY
    # The callback keeps the queue and priority it was declared (or .using()'d) with.
    on_success = fired["on_success"]
    assert (on_success.queue_name, on_success.priority) == ("reports", 3)


def test_a_failed_item_fires_on_failure_not_on_success():
    made = enqueue_batch(
        [(bt.item, [0], {}), (bt.item, [1], {"fail": True})],
        on_success=bt.callback,
        on_failure=bt.callback,
    )
    assert run_enqueued_jobs(limit=2).outcomes == ["succeeded", "failed"]
    fired = callbacks(made.id)
    assert set(fired) == {"on_failure"}
    assert fired["on_failure"].kwargs == {"batch_id": made.id, "succeeded": 1, "failed": 1}


def test_a_retry_is_not_terminal():
    made = enqueue_batch(items(1, bt.flaky_item), on_finish=bt.callback)
    job_id = int(made.results[0].id)
    assert run_enqueued_jobs(limit=1).outcomes == ["will_retry"]
    batch = made.refresh()
    assert (batch.pending, batch.failed, batch.finished_at) == (1, 0, None)
    # backoff=0 readmits at once; the second failure is final.
    assert Job.objects.get(pk=job_id).status == JobStatus.READY
    assert run_enqueued_jobs(limit=1).outcomes == ["failed"]
    assert made.refresh().pending == 0
    assert callbacks(made.id)["on_finish"].kwargs["failed"] == 1


def test_discarding_the_last_waiting_item_completes_the_batch(worker):
    made = enqueue_batch(items(2), on_finish=bt.callback)
    assert run(worker, int(made.results[0].id))
    assert discard_job(DB, int(made.results[1].id))
    batch = made.refresh()
    assert (batch.pending, batch.succeeded, batch.failed) == (0, 1, 1)
    assert callbacks(made.id)["on_finish"].kwargs == {
        "batch_id": made.id,
        "succeeded": 1,
        "failed": 1,
    }


def test_an_empty_batch_completes_at_once():
    made = enqueue_batch([], on_finish=bt.callback, on_success=bt.callback)
    assert made.results == []
    assert set(callbacks(made.id)) == {"on_finish", "on_success"}
    assert made.refresh().finished_at is not None


def test_a_batch_concurrency_limit_admits_that_many_items_at_a_time():
    made = enqueue_batch(items(5), concurrency_limit=2, on_finish=bt.callback)
    ids = [int(r.id) for r in made.results]
    key = f"django_jobs.batch/{made.id}"
    assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == set(ids[:2])
    assert set(
        BlockedExecution.objects.filter(concurrency_key=key).values_list("job_id", flat=True)
    ) == set(ids[2:])
    for job_id in ids:
        assert Job.objects.get(pk=job_id).status == JobStatus.READY
        assert ReadyExecution.objects.filter(concurrency_key=key).count() <= 2
        (ran,) = run_enqueued_jobs(limit=1)
        assert (ran.job_id, ran.outcome) == (job_id, "succeeded")
    assert made.refresh().succeeded == 5
    assert "on_finish" in callbacks(made.id)


def test_bad_batches_are_refused_before_anything_is_written():
    with pytest.raises(InvalidTask):
        enqueue_batch(items(2), on_finish=bt.not_a_callback)
    with pytest.raises(InvalidTask, match="concurrency_limit"):
        enqueue_batch(items(2), concurrency_limit=0)
    with pytest.raises(InvalidTask, match="own concurrency_key"):
        enqueue_batch(
            [(bt.keyed_callback, [], {"batch_id": 1, "succeeded": 0, "failed": 0})],
            concurrency_limit=2,
        )
    with pytest.raises(InvalidTask, match="must be a task"):
        enqueue_batch(items(1), on_finish=print)
    assert not Batch.objects.exists() and not Job.objects.exists()


def test_a_keyed_callback_waits_for_the_dispatcher_to_admit_it(worker):
    made = enqueue_batch(items(1), on_finish=bt.keyed_callback)
    assert run(worker, int(made.results[0].id))
    fired = callbacks(made.id)["on_finish"]
    assert fired.status == JobStatus.SCHEDULED
    assert ScheduledExecution.objects.filter(job_id=fired.pk).exists()
    assert promote_due_jobs(DB, 10) == 1
    fired.refresh_from_db()
    assert fired.status == JobStatus.READY
    assert fired.concurrency_key == f"tests.batch_tasks.keyed_callback/batch:{made.id}"


def test_retrying_a_failed_item_reopens_an_unfinished_batch(worker):
    made = enqueue_batch(
        [(bt.item, [0], {"fail": True}), (bt.item, [1], {})], on_success=bt.callback
    )
    failed_id = int(made.results[0].id)
    run(worker, failed_id, fail=True)
    assert (made.refresh().pending, made.refresh().failed) == (1, 1)
    assert operations.retry_failed_job(DB, failed_id)
    assert (made.refresh().pending, made.refresh().failed) == (2, 0)
    Job.objects.filter(pk=failed_id).update(kwargs={})  # the retry succeeds
    assert run(worker, failed_id)
    assert run(worker, int(made.results[1].id))
    assert set(callbacks(made.id)) == {"on_success"}


def test_retrying_an_item_after_the_batch_finished_leaves_the_verdict(worker):
    made = enqueue_batch([(bt.item, [0], {"fail": True})], on_failure=bt.callback)
    failed_id = int(made.results[0].id)
    run(worker, failed_id, fail=True)
    before = made.refresh()
    assert operations.retry_failed_job(DB, failed_id)
    after = made.refresh()
    assert (after.pending, after.failed, after.finished_at) == (0, 1, before.finished_at)
    Job.objects.filter(pk=failed_id).update(kwargs={})  # the retry succeeds...
    assert run(worker, failed_id)
    final = made.refresh()  # ...and the completed batch's counts do not move
    assert (final.total, final.pending, final.succeeded, final.failed) == (1, 0, 0, 1)
    assert len(callbacks(made.id)) == 1


def test_an_item_lost_with_its_process_counts_once_when_recovered(worker):
    made = enqueue_batch(items(1), on_finish=bt.callback)
    job_id = int(made.results[0].id)
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert start_job(DB, job, worker.pk, worker.name)
    assert recover_process_claims(DB, worker.pk, "died") == {job_id: "failed"}
    assert recover_process_claims(DB, worker.pk, "died") == {}
    batch = made.refresh()
    assert (batch.pending, batch.failed) == (0, 1)
    assert Job.objects.filter(task_path="tests.batch_tasks.callback").count() == 1


def test_a_batch_enqueued_by_a_running_job_records_its_parent():
    token = current_job_id.set(12345)
    try:
        made = enqueue_batch(items(1))
    finally:
        current_job_id.reset(token)
    assert made.refresh().parent_job_id == 12345
    assert enqueue_batch(items(1)).refresh().parent_job_id is None


def test_maintenance_clears_completed_batches_with_the_finished_jobs(worker):
    done = enqueue_batch([], on_finish=bt.callback)
    open_batch = enqueue_batch(items(1))
    Batch.objects.update(created_at=timezone.now() - timedelta(days=30))
    long_ago = timezone.now() - timedelta(days=30)
    Batch.objects.filter(pk=done.id).update(finished_at=long_ago)
    # Kept while its callback has not ended: the callback reads its batch.
    clear_finished_jobs(DB, older_than=86400)
    assert sorted(Batch.objects.values_list("pk", flat=True)) == sorted([done.id, open_batch.id])
    callback = Job.objects.get(task_path="tests.batch_tasks.callback")
    ReadyExecution.objects.filter(job=callback).delete()  # as if it had run, long ago
    Job.objects.filter(pk=callback.pk).update(status=JobStatus.SUCCEEDED, finished_at=long_ago)
    clear_finished_jobs(DB, older_than=86400)
    assert list(Batch.objects.values_list("pk", flat=True)) == [open_batch.id]
