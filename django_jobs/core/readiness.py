"""Writing ready rows: the one place a job becomes claimable.

Its own module, below both admission (which decides *whether* a job may be
ready, under its key's semaphore) and batches (whose callbacks without a key are
ready at once), so that neither has to import the other to reach it.
"""

from __future__ import annotations

from django.utils import timezone

from django_jobs.db.notify import jobs_ready
from django_jobs.models import Job, JobStatus, ReadyExecution


def make_ready(db: str, jobs: list[Job]) -> None:
    now = timezone.now()
    ReadyExecution.objects.using(db).bulk_create(
        [
            ReadyExecution(
                job_id=job.pk,
                queue_name=job.queue_name,
                priority=job.priority,
                concurrency_key=job.concurrency_key,
                created_at=now,
            )
            for job in jobs
        ]
    )
    set_status(db, jobs, JobStatus.READY)
    jobs_ready(db, (job.queue_name for job in jobs))


def set_status(db: str, jobs: list[Job], status: JobStatus) -> None:
    changed = [job.pk for job in jobs if job.status != status]
    if changed:
        Job.objects.using(db).filter(pk__in=changed).update(status=status)
    for job in jobs:
        job.status = status
