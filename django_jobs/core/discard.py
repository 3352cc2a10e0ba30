"""Discarding waiting jobs (ready, scheduled, blocked), never a claimed or running one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from django_jobs.core.admission import reconcile_key
from django_jobs.core.batches import count_outcome
from django_jobs.db.deletion import delete_executions
from django_jobs.models import (
    BlockedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)


def discard_job(db: str, job_id: int) -> bool:
    """Discard one waiting job; False if it is running, finished or already gone."""
    return end_waiting_job(db, job_id, JobStatus.DISCARDED)


def end_waiting_job(
    db: str,
    job_id: int,
    status: JobStatus,
    record: Callable[[int, datetime], None] | None = None,
) -> bool:
    """End one waiting job (ready, scheduled, blocked) as ``status``; False if it is not
    waiting (claimed, running, finished or gone). Serves discard and cancel.

    A ready job of a key holds a slot: the key's semaphore is locked first
    (lock order: semaphore, then its ready/blocked rows), the slot recounted
    and the next blocked job promoted in the same transaction. A claimer that
    took the ready row first wins: the delete then finds nothing. ``record``
    writes what else the end needs (a cancel's error row), given the job's
    attempts and the time, before the job's row is updated.
    """
    with transaction.atomic(using=db):
        key, batch_id, attempts = (
            Job.objects.using(db)
            .filter(pk=job_id)
            .values_list("concurrency_key", "batch_id", "attempts")
            .first()
        ) or (None, None, 0)
        if key:
            list(Semaphore.objects.using(db).select_for_update().filter(key=key).values("pk"))
        deleted = sum(
            delete_executions(db, table, [job_id])
            for table in (ReadyExecution, ScheduledExecution, BlockedExecution)
        )
        if not deleted:
            return False
        now = timezone.now()
        if record is not None:
            record(attempts, now)
        Job.objects.using(db).filter(pk=job_id).update(
            status=status, finished_at=now, unique_lock=None
        )
        if key:
            reconcile_key(db, key)
        count_outcome(db, batch_id, succeeded=False)
    return True


def discard_jobs(db: str, job_ids: Iterable[int]) -> int:
    """Discard each waiting job in its own transaction; returns how many were discarded."""
    return sum(discard_job(db, job_id) for job_id in sorted(set(job_ids)))
