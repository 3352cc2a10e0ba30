"""The dispatcher's periodic repairs, on rows planted with the factories."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from django_jobs.core.maintenance import clear_finished_jobs, reconcile_blocked_keys
from django_jobs.models import (
    Batch,
    BlockedExecution,
    FailedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    Semaphore,
)
from tests.factories import (
    BlockedExecutionFactory,
    ClaimedExecutionFactory,
    FailedExecutionFactory,
    FinishedJobFactory,
    JobFactory,
    ReadyExecutionFactory,
    SemaphoreFactory,
)

pytestmark = pytest.mark.django_db


def test_clear_finished_jobs_deletes_only_old_finished_ones_in_batches():
    old = timezone.now() - timedelta(days=8)
    old_jobs = FinishedJobFactory.create_batch(7, finished_at=old)
    failed_old = FailedExecutionFactory(job__finished_at=old).job
    recent = FinishedJobFactory()
    waiting = ReadyExecutionFactory().job
    assert clear_finished_jobs("default", older_than=86400 * 7, batch_size=3) == 8
    remaining = set(Job.objects.values_list("pk", flat=True))
    assert remaining == {recent.pk, waiting.pk}
    assert not remaining & {job.pk for job in [*old_jobs, failed_old]}
    assert FailedExecution.objects.count() == 0  # cascaded with their job


def test_the_dispatchers_prune_stops_after_max_rounds_and_the_next_goes_on():
    """A first prune of a big backlog must not hold the dispatcher for minutes."""
    old = timezone.now() - timedelta(days=8)
    FinishedJobFactory.create_batch(7, finished_at=old)
    assert clear_finished_jobs("default", older_than=86400 * 7, batch_size=2, max_rounds=2) == 4
    assert Job.objects.count() == 3
    assert clear_finished_jobs("default", older_than=86400 * 7, batch_size=2, max_rounds=2) == 3
    assert not Job.objects.exists()


def test_reconcile_repairs_a_drifted_semaphore_and_fills_every_free_slot():
    key = "drifted"
    SemaphoreFactory(key=key, limit=3, value=0)  # says full, but only one holder exists
    ClaimedExecutionFactory(
        job=JobFactory(status=JobStatus.RUNNING, concurrency_key=key, concurrency_limit=3),
    )
    blocked = [
        BlockedExecutionFactory(
            job__concurrency_key=key, job__concurrency_limit=3, concurrency_key=key
        ).job_id
        for _ in range(4)
    ]
    assert reconcile_blocked_keys("default") == 2
    assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == set(blocked[:2])
    assert set(BlockedExecution.objects.values_list("job_id", flat=True)) == set(blocked[2:])
    assert Semaphore.objects.get(key=key).value == 0
    assert set(Job.objects.filter(pk__in=blocked[:2]).values_list("status", flat=True)) == {
        JobStatus.READY
    }


def test_reconcile_never_admits_past_the_limit():
    key = "over"
    SemaphoreFactory(key=key, limit=1, value=5)  # says five free: wrong
    ReadyExecutionFactory(job=JobFactory(concurrency_key=key, concurrency_limit=1))
    BlockedExecutionFactory(job__concurrency_key=key, concurrency_key=key)
    assert reconcile_blocked_keys("default") == 0
    assert Semaphore.objects.get(key=key).value == 0
    assert BlockedExecution.objects.count() == 1


def test_the_dispatchers_prune_is_prune_jobs_pruning_batches_included():
    """clear_finished_jobs (the dispatcher's) goes through prune_finished_jobs: completed
    batches go with the jobs, except one whose callback has not ended yet."""
    old = timezone.now() - timedelta(days=8)
    FinishedJobFactory.create_batch(2, finished_at=old)
    done = Batch.objects.create(total=2, pending=0, succeeded=2, finished_at=old)
    waiting_callback = ReadyExecutionFactory().job
    callback_pending = Batch.objects.create(
        total=1, pending=0, finished_at=old, callback_jobs={"on_finish": waiting_callback.pk}
    )
    assert clear_finished_jobs("default", older_than=86400 * 7) == 2
    assert set(Batch.objects.values_list("pk", flat=True)) == {callback_pending.pk}
    assert not Batch.objects.filter(pk=done.pk).exists()
    assert set(Job.objects.values_list("pk", flat=True)) == {waiting_callback.pk}
