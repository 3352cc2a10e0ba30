"""Batches over real ``run_jobs`` worker processes: the fan-in holds across processes."""

from __future__ import annotations

import signal

import pytest

from django_jobs import enqueue_batch
from django_jobs.models import Batch, Job, JobStatus
from tests import batch_tasks as bt
from tests.harness import wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def test_items_ending_on_different_workers_fire_each_callback_once_and_nest(run_jobs):
    """Two worker processes x 4 threads end 40 short items at nearly the same instants;
    the on_finish callback enqueues a child batch (nesting), whose own callback runs."""
    calls = [(bt.item, [n], {"pause": 0.01 * (n % 4), "fail": n % 10 == 0}) for n in range(40)]
    made = enqueue_batch(
        calls,
        on_finish=bt.next_stage,
        on_success=bt.callback,
        on_failure=bt.report_callback,
        description="parent",
    )
    proc = run_jobs("--processes", "2", "--threads", "4")

    def child_done():
        child = Batch.objects.filter(description="child").first()
        return (
            child is not None
            and child.finished_at is not None
            and child.callback_jobs
            and (
                Job.objects.filter(
                    pk=child.callback_jobs["on_finish"], status=JobStatus.SUCCEEDED
                ).exists()
            )
        )

    wait_until(child_done, timeout=60, what="the child batch's callback to succeed")
    proc.send(signal.SIGTERM)
    assert proc.wait() == 0, proc.output()

    parent = Batch.objects.get(pk=made.id)
    assert (parent.pending, parent.succeeded, parent.failed) == (0, 36, 4)
    assert set(parent.callback_jobs) == {"on_finish", "on_failure"}
    # Exactly one job per callback, whatever the interleaving of the 40 finishes.
    assert Job.objects.filter(task_path="tests.batch_tasks.next_stage").count() == 1
    assert Job.objects.filter(task_path="tests.batch_tasks.report_callback").count() == 1
    stage = Job.objects.get(pk=parent.callback_jobs["on_finish"])
    assert stage.kwargs == {"batch_id": made.id, "succeeded": 36, "failed": 4}
    assert stage.status == JobStatus.SUCCEEDED

    child = Batch.objects.get(description="child")
    assert child.parent_job_id == stage.pk
    assert stage.return_value == child.id
    assert (child.pending, child.succeeded, child.failed) == (0, 3, 0)
    # bt.callback runs once: for the child's on_finish (the parent had a failure).
    (callback_job,) = Job.objects.filter(task_path="tests.batch_tasks.callback")
    assert callback_job.return_value == {"batch_id": child.id, "succeeded": 3, "failed": 0}
