"""Moving due scheduled jobs (``run_after``, retry backoff) into admission."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from django_jobs.core.admission import admit_jobs
from django_jobs.db import ops
from django_jobs.models import Job, ScheduledExecution


def promote_due_jobs(db: str, batch_size: int) -> int:
    """Admit up to ``batch_size`` due scheduled jobs; returns how many were moved.

    Rows are taken with SKIP LOCKED so several dispatchers share the work, and
    each batch is one transaction, so a crash leaves every row where it was.
    """
    with transaction.atomic(using=db):
        due_ids = list(
            ScheduledExecution.objects.using(db)
            .select_for_update(skip_locked=True)
            .filter(scheduled_at__lte=timezone.now())
            .order_by("scheduled_at", "-priority", "job_id")
            .values_list("job_id", flat=True)[:batch_size]
        )
        if not due_ids:
            return 0
        # By primary key where a DELETE ... IN would scan rows others hold (MariaDB).
        ops(db).delete_executions(db, ScheduledExecution, due_ids)
        jobs = list(Job.objects.using(db).filter(pk__in=due_ids))
        admit_jobs(db, jobs)
    return len(due_ids)


def promote_jobs(db: str, job_ids: list[int], *, due_by: datetime | None = None) -> int:
    """Admit the scheduled jobs of ``job_ids`` that are due, now rather than at the
    dispatcher's next round (a dependent with a concurrency key, just released: it could
    not take its semaphore in the transaction that released it). A row the dispatcher
    holds or has already moved is skipped.

    ``due_by``: the time a row must be due by, now if None (the test toolkit's time
    travel, ``django_jobs.testing``, passes a later one)."""
    with transaction.atomic(using=db):
        due_ids = list(
            ScheduledExecution.objects.using(db)
            .select_for_update(skip_locked=True)
            .filter(job_id__in=sorted(job_ids), scheduled_at__lte=due_by or timezone.now())
            .order_by("job_id")
            .values_list("job_id", flat=True)
        )
        if not due_ids:
            return 0
        ops(db).delete_executions(db, ScheduledExecution, due_ids)
        admit_jobs(db, list(Job.objects.using(db).filter(pk__in=due_ids)))
    return len(due_ids)
