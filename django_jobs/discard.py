"""Discarding waiting jobs (ready, scheduled, blocked), never a claimed or running one."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction
from django.utils import timezone

from .admission import reconcile_key
from .batches import count_outcome
from .models import BlockedExecution, Job, JobStatus, ReadyExecution, ScheduledExecution, Semaphore


def discard_job(db: str, job_id: int) -> bool:
    """Discard one waiting job; False if it is running, finished or already gone.

    A ready job of a key holds a slot: the key's semaphore is locked first
    (lock order: semaphore, then its ready/blocked rows), the slot recounted
    and the next blocked job promoted in the same transaction. A claimer that
    took the ready row first wins: the delete then finds nothing.
    """
    with transaction.atomic(using=db):
        row = (
            Job.objects.using(db)
            .filter(pk=job_id)
            .values_list("concurrency_key", "batch_id")
            .first()
        )
        key, batch_id = row or (None, None)
        if key:
            list(Semaphore.objects.using(db).select_for_update().filter(key=key).values("pk"))
        deleted = 0
        for table in (ReadyExecution, ScheduledExecution, BlockedExecution):
            deleted += table.objects.using(db).filter(job_id=job_id).delete()[0]
        if not deleted:
            return False
        Job.objects.using(db).filter(pk=job_id).update(
            status=JobStatus.DISCARDED, finished_at=timezone.now(), unique_lock=None
        )
        if key:
            reconcile_key(db, key)
        count_outcome(db, batch_id, succeeded=False)
    return True


def discard_jobs(db: str, job_ids: Iterable[int]) -> int:
    """Discard each waiting job in its own transaction; returns how many were discarded."""
    return sum(discard_job(db, job_id) for job_id in sorted(set(job_ids)))
