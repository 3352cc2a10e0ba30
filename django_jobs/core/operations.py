"""What an operator may do to jobs and queues (the admin's actions, and a Python API).

Each operation is one short transaction that takes the same locks, in the same
order, as the worker's transitions (docs/design.md section 4): a job re-enters the
queue only through :func:`~django_jobs.core.admission.admit_jobs`, so an operator can
never over-admit a key by accident. The one deliberate exception,
:func:`run_blocked_now`, still takes the key's semaphore lock and records the
extra holder, so the key admits nothing more until it is back under its limit.

Every function returns whether (or how many times) it acted, and acts only on a
job in the state it expects, read under the lock: racing a worker or another
operator, the loser gets False and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import IntegrityError, transaction
from django.utils import timezone

from django_jobs.core import admission
from django_jobs.core.batches import reopen_item
from django_jobs.core.discard import discard_job
from django_jobs.models import BlockedExecution, Job, JobStatus, Pause, Semaphore


def retry_failed_job(db: str, job_id: int) -> bool:
    """Give a failed job one more attempt; it waits for its key's limit like any other.

    The attempt count and every earlier error are kept; ``max_attempts`` grows
    to allow exactly one more attempt (the worker's own retry rules still apply
    to it, so a job that fails again is failed again, not retried forever).
    A unique job takes its key back, and is not retried (False) while another
    job holds that key.
    """
    with transaction.atomic(using=db):
        job = Job.objects.using(db).select_for_update().filter(pk=job_id).first()
        if job is None or job.status != JobStatus.FAILED:
            return False
        if job.unique_key and not retake_unique_key(db, job):
            return False
        job.max_attempts = max(job.max_attempts, job.attempts + 1)
        job.finished_at = None
        job.run_after = None
        job.save(using=db, update_fields=["max_attempts", "finished_at", "run_after"])
        admission.admit_jobs(db, [job])
        # Lock order: job row, semaphore (admission), then the batch row.
        reopen_item(db, job.batch_id)
    return True


def retake_unique_key(db: str, job: Job) -> bool:
    """Set the failed job's ``unique_lock`` again; False if another job holds the key."""
    if Job.objects.using(db).filter(unique_lock=job.unique_key).exists():
        return False
    try:
        with transaction.atomic(using=db):
            Job.objects.using(db).filter(pk=job.pk).update(unique_lock=job.unique_key)
    except IntegrityError:
        return False
    job.unique_lock = job.unique_key
    return True


def retry_failed_jobs(db: str, job_ids: Iterable[int]) -> int:
    """Each in its own transaction (one lock at a time); returns how many were retried."""
    return sum(retry_failed_job(db, job_id) for job_id in sorted(set(job_ids)))


def discard(db: str, job_id: int) -> bool:
    """Discard a waiting (ready, scheduled, blocked) or failed job; never a claimed one."""
    if discard_job(db, job_id):
        return True
    # A failed job has no execution row and holds no slot: only its status changes.
    changed = (
        Job.objects.using(db)
        .filter(pk=job_id, status=JobStatus.FAILED)
        .update(status=JobStatus.DISCARDED)
    )
    return bool(changed)


def discard_many(db: str, job_ids: Iterable[int]) -> int:
    return sum(discard(db, job_id) for job_id in sorted(set(job_ids)))


def run_blocked_now(db: str, job_id: int) -> bool:
    """Make a blocked job ready at once, past its key's limit: an explicit bypass.

    The semaphore is locked first, as every admission does, and the job becomes
    one more holder of the key (its free count goes to zero or below), so the
    key promotes no other blocked job until its holders fall under the limit
    again. The bypass admits this one job and nothing else.
    """
    with transaction.atomic(using=db):
        key = (
            BlockedExecution.objects.using(db)
            .filter(job_id=job_id)
            .values_list("concurrency_key", flat=True)
            .first()
        )
        if key is None:
            return False
        semaphore = admission.lock_existing_semaphore(db, key)
        # Read again under the key's lock: a finishing holder may have promoted it meanwhile.
        if not BlockedExecution.objects.using(db).filter(job_id=job_id).delete()[0]:
            return False
        job = Job.objects.using(db).get(pk=job_id)
        admission.make_ready(db, [job])
        if semaphore is not None:
            Semaphore.objects.using(db).filter(pk=semaphore.pk).update(
                value=semaphore.value - 1, updated_at=timezone.now()
            )
    return True


def reconcile(db: str, key: str) -> int:
    """Recount ``key``'s holders under its lock, repair its free count, promote what fits."""
    with transaction.atomic(using=db):
        return admission.reconcile_key(db, key)


def pause_queue(db: str, queue_name: str) -> bool:
    """Stop workers claiming from ``queue_name``; jobs already running finish. False if paused."""
    try:
        with transaction.atomic(using=db):
            Pause.objects.using(db).create(queue_name=queue_name)
    except IntegrityError:
        return False
    return True


def resume_queue(db: str, queue_name: str) -> bool:
    """Let workers claim from ``queue_name`` again; False if it was not paused."""
    return bool(Pause.objects.using(db).filter(queue_name=queue_name).delete()[0])
