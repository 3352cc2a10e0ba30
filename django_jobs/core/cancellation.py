"""Cancelling a job: at once while it waits, by asking its worker while it runs.

The request is a column (``Job.cancel_requested_at``), set first in a statement
of its own, so it reaches whoever holds the job next: the worker running it
(its watchdog polls the column, see runner/watchdog.py), a worker that claims
it an instant later, and recovery if that worker dies. On PostgreSQL a NOTIFY
sent once the request has committed (``notify.cancel_requested``) makes the
worker running the job look at once instead of at its next poll; it is only a
hint, so losing it delays the stop by one poll interval and nothing else.

A waiting job (ready, scheduled, blocked) is then ended in the same transaction
shape as a discard: its key's semaphore locked first, its waiting row deleted,
its slot recounted and the next blocked job promoted, its batch counted. It
ends ``FAILED`` with a ``JobCancelled`` error and is never retried.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import F
from django.db.models.functions import Coalesce
from django.utils import timezone

from django_jobs.core.discard import end_waiting_job
from django_jobs.db.notify import cancel_requested
from django_jobs.exceptions import JobAlreadyFinished, JobNotFound
from django_jobs.models import FINISHED_STATUSES, FailedExecution, Job, JobStatus

CANCELLED_ERROR = "django_jobs.exceptions.JobCancelled"
CANCELLED, REQUESTED = "cancelled", "requested"


def cancel_job(db: str, job_id: int) -> str:
    """Cancel job ``job_id``: ``"cancelled"`` if it was waiting and has ended now,
    ``"requested"`` if it is claimed or running and its worker will stop it.

    Raises :class:`JobNotFound` for an unknown id and :class:`JobAlreadyFinished`
    for a job that has ended (nothing is changed either way).
    """
    requested = (
        Job.objects.using(db)
        .filter(pk=job_id)
        .exclude(status__in=FINISHED_STATUSES)
        .update(cancel_requested_at=Coalesce(F("cancel_requested_at"), timezone.now()))
    )
    if not requested:
        status = Job.objects.using(db).filter(pk=job_id).values_list("status", flat=True).first()
        if status is None:
            raise JobNotFound(f"no job with id {job_id}")
        raise JobAlreadyFinished(f"job {job_id} has already ended ({status}): nothing to cancel")
    ended = end_waiting_job(
        db,
        job_id,
        JobStatus.FAILED,
        lambda attempts, when: cancel_waiting(db, job_id, attempts, when),
    )
    if ended:
        return CANCELLED
    cancel_requested(db, job_id)  # once committed: its worker checks now, not at its poll
    return REQUESTED


def record_cancelled(db: str, job_id: int, attempts: int, now: datetime, message: str) -> None:
    """The error row of a job cancelled before it ran (or while it waited again)."""
    FailedExecution.objects.using(db).create(
        job_id=job_id,
        attempt=attempts,
        exception_class_path=CANCELLED_ERROR,
        message=message,
        traceback="",
        failed_at=now,
    )


def cancel_waiting(db: str, job_id: int, attempts: int, now: datetime) -> None:
    message = "cancelled before it ran" if attempts == 0 else "cancelled while waiting"
    record_cancelled(db, job_id, attempts, now, message)
