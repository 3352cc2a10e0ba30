"""Periodic repairs: keys with blocked jobs reconciled, finished jobs cleared."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from .admission import reconcile_key
from .models import FINISHED_STATUSES, Batch, BlockedExecution, Job


def reconcile_blocked_keys(db: str) -> int:
    """Recount every key that has blocked jobs; promote as many as fit. Returns promoted."""
    keys = (
        BlockedExecution.objects.using(db)
        .order_by("concurrency_key")
        .values_list("concurrency_key", flat=True)
        .distinct()
    )
    promoted = 0
    for key in list(keys):
        with transaction.atomic(using=db):
            promoted += reconcile_key(db, key)
    return promoted


def clear_finished_jobs(db: str, older_than: float, batch_size: int = 500) -> int:
    """Delete finished jobs older than ``older_than`` seconds, one batch per transaction."""
    cutoff = timezone.now() - timedelta(seconds=older_than)
    deleted = 0
    while True:
        ids = list(
            Job.objects.using(db)
            .filter(status__in=FINISHED_STATUSES, finished_at__lt=cutoff)
            .values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            clear_finished_batches(db, cutoff, batch_size)
            return deleted
        with transaction.atomic(using=db):
            Job.objects.using(db).filter(pk__in=ids, status__in=FINISHED_STATUSES).delete()
        deleted += len(ids)


def clear_finished_batches(db: str, cutoff: datetime, batch_size: int = 500) -> int:
    """Delete batches completed before ``cutoff``, kept as long as their finished items.

    Only finished batches go: an unfinished one is still counting its items down.
    """
    deleted = 0
    while True:
        ids = list(
            Batch.objects.using(db)
            .filter(finished_at__lt=cutoff)
            .values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            return deleted
        Batch.objects.using(db).filter(pk__in=ids).delete()
        deleted += len(ids)
