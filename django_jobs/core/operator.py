"""What an operator may do to jobs and queues: the admin's actions, ``django_jobs.cancel``,
and a Python API (retry, discard, cancel, run a blocked job now, reconcile a key, pause and
resume a queue).

Each action is one short transaction that takes the same locks, in the same order, as the
worker's transitions (docs/design.md section 4): a job re-enters the queue only through
:func:`~django_jobs.core.admission.admit_jobs`, so an operator can never over-admit a key by
accident. The one deliberate exception, :func:`run_blocked_now`, still takes the key's
semaphore lock and records the extra holder, so the key admits nothing more until it is back
under its limit.

Every function returns whether (or how many times) it acted, and acts only on a job in the
state it expects, read under the lock: racing a worker or another operator, the loser gets
False and changes nothing.

A waiting job (ready, scheduled, blocked) is discarded or cancelled the same way
(:func:`end_waiting_job`). A cancel request for a claimed or running job is a column
(``Job.cancel_requested_at``), set first in a statement of its own, so it reaches whoever
holds the job next: the worker running it (its watchdog polls the column, see
runtime/watchdog.py), a worker that claims it an instant later, and recovery if that worker
dies. On PostgreSQL a NOTIFY sent once the request has committed (``notify.cancel_requested``)
makes the worker running the job look at once instead of at its next poll; it is only a hint,
so losing it delays the stop by one poll interval and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from enum import Enum, auto

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Coalesce
from django.utils import timezone

from django_jobs.core import admission
from django_jobs.core.batches import count_outcomes, reopen_item
from django_jobs.core.dependencies import (
    merge_outcomes,
    revive_dependents,
    settle_ended,
    unmet_dependencies,
    wait_again,
)
from django_jobs.db import notify, ops
from django_jobs.exceptions import JobAlreadyFinished, JobNotFound
from django_jobs.models import (
    FINISHED_STATUSES,
    WAITING_STATUSES,
    AwaitingExecution,
    BlockedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)

CANCELLED_ERROR = "django_jobs.exceptions.JobCancelled"
# What cancel_job() did: ended a waiting job, or asked the worker running it to stop.
CANCELLED, REQUESTED = "cancelled", "requested"

# The states each action acts on (each function re-checks under its locks): what the admin
# offers a button for and what ``manage.py jobs retry|discard|cancel`` selects. A job
# awaiting its dependencies is waiting like a blocked one.
RETRYABLE = frozenset({JobStatus.FAILED})
DISCARDABLE = frozenset({*WAITING_STATUSES, JobStatus.FAILED})
CANCELLABLE = frozenset({*WAITING_STATUSES, JobStatus.CLAIMED, JobStatus.RUNNING})

# --- retry --------------------------------------------------------------------------------


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
        failed, waiting = unmet_dependencies(db, job_id)
        if failed:
            # It would wait for a job that will never succeed: retry that one first.
            return False
        job.max_attempts = max(job.max_attempts, job.attempts + 1)
        job.finished_at = None
        job.run_after = None
        job.save(using=db, update_fields=["max_attempts", "finished_at", "run_after"])
        # What its failure ended waits again (job rows, before any semaphore).
        revived = revive_dependents(db, job_id)
        if waiting:
            wait_again(db, job, waiting)
        else:
            admission.admit_jobs(db, [job])
        # Lock order: job rows, semaphore (admission), then the batch rows.
        for batch_id in batches_of(db, [job_id, *revived]):
            reopen_item(db, batch_id)
    return True


# Why an action was refused, as the admin and ``manage.py jobs`` both say it.
NO_SUCH_JOB = "there is no such job"


def raced(done: str) -> str:
    """Why an action was refused to a job in a state it takes: the job was not in it when
    the action looked under its lock (a worker, or another operator, moved it meanwhile)."""
    return f"it changed while it was being {done}"


# Why a retry was refused when none of the reasons read after it holds: the job was failed
# and is still, but was not when the retry looked under its lock.
RETRY_RACED = raced("retried")


class Unread(Enum):
    """The job's status, not read yet (``None`` says there is no such job)."""

    STATUS = auto()


def retry_refusal(db: str, job_id: int, status: str | Unread | None = Unread.STATUS) -> str:
    """Why ``retry_failed_job`` said no, read after it did (for a message only: the retry
    itself decided under the job's lock). ``status``: the job's, if the caller has just
    read it (None: no such job), so that it is not read again."""
    if status is Unread.STATUS:
        status = Job.objects.using(db).filter(pk=job_id).values_list("status", flat=True).first()
    if status is None:
        return NO_SUCH_JOB
    if status != JobStatus.FAILED:
        return f"it is {status}, no longer failed"
    failed, _ = unmet_dependencies(db, job_id)
    if failed:
        listed = ", ".join(f"#{pk}" for pk in sorted(failed)[:5])
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        which = "that one" if len(failed) == 1 else "those"
        return f"it waits for {listed}{more}, which failed: retry {which} first"
    if Job.objects.using(db).filter(pk=job_id, unique_key__isnull=False).exists():
        return "another job holds its unique key"
    return RETRY_RACED


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


# --- discard ------------------------------------------------------------------------------
# Two pairs, for two promises: discard_job/discard_jobs (public since 0.x, docs/tasks.md)
# end waiting jobs only; discard/discard_many (the admin's action) also mark failed ones.


def discard_job(db: str, job_id: int) -> bool:
    """Discard one waiting job; False if it is running, finished or already gone."""
    return end_waiting_job(db, job_id, JobStatus.DISCARDED)


def discard_jobs(db: str, job_ids: Iterable[int]) -> int:
    """Discard each waiting job in its own transaction; returns how many were discarded."""
    return sum(discard_job(db, job_id) for job_id in sorted(set(job_ids)))


def discard(db: str, job_id: int) -> bool:
    """Discard a waiting (ready, scheduled, blocked, awaiting) or failed job; never a
    claimed one."""
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
    """:func:`discard` each job in its own transaction; returns how many were discarded."""
    return sum(discard(db, job_id) for job_id in sorted(set(job_ids)))


def batches_of(db: str, job_ids: list[int]) -> list[int]:
    """The batch of each of ``job_ids`` that has one, ascending (one entry per job)."""
    return sorted(
        Job.objects.using(db)
        .filter(pk__in=job_ids, batch__isnull=False)
        .values_list("batch_id", flat=True)
    )


def end_waiting_job(
    db: str,
    job_id: int,
    status: JobStatus,
    record: Callable[[int, datetime], None] | None = None,
) -> bool:
    """End one waiting job (ready, scheduled, blocked, awaiting its dependencies) as
    ``status``; False if it is not waiting (claimed, running, finished or gone). Serves
    discard and cancel.

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
            ops(db).delete_executions(db, table, [job_id])
            for table in (
                ReadyExecution,
                ScheduledExecution,
                BlockedExecution,
                AwaitingExecution,
            )
        )
        if not deleted:
            return False
        now = timezone.now()
        # The job's row before its error row: on InnoDB that row's foreign key check
        # takes a shared lock on the job, which this UPDATE would then have to upgrade.
        Job.objects.using(db).filter(pk=job_id).update(
            status=status, finished_at=now, unique_lock=None
        )
        if record is not None:
            record(attempts, now)
        if key:
            admission.reconcile_key(db, key)
        # What waits for it meets its policy (after the semaphore, before the batch).
        ended = settle_ended(db, {job_id: False})
        count_outcomes(db, merge_outcomes({batch_id: (0, 1)} if batch_id else {}, ended))
    return True


# --- cancel -------------------------------------------------------------------------------


def cancel_job(db: str, job_id: int) -> str:
    """Cancel job ``job_id``: ``"cancelled"`` if it was waiting and has ended now,
    ``"requested"`` if it is claimed or running and its worker will stop it.

    Either way it ends ``FAILED`` with a ``JobCancelled`` error and is never
    retried. Raises :class:`JobNotFound` for an unknown id and
    :class:`JobAlreadyFinished` for a job that has ended (nothing is changed either way).
    """
    if not request_cancel(db, job_id):
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
    notify.cancel_requested(db, job_id)  # once committed: its worker checks now, not at its poll
    return REQUESTED


def request_cancel(db: str, job_id: int) -> bool:
    """Write the cancel request of a job that has not ended (kept if one was written
    before); False if it has ended or does not exist."""
    return bool(
        Job.objects.using(db)
        .filter(pk=job_id)
        .exclude(status__in=FINISHED_STATUSES)
        .update(cancel_requested_at=Coalesce(F("cancel_requested_at"), timezone.now()))
    )


def cancel_waiting(db: str, job_id: int, attempts: int, now: datetime) -> None:
    message = "cancelled before it ran" if attempts == 0 else "cancelled while waiting"
    record_cancelled(db, job_id, attempts, now, message)


def record_cancelled(db: str, job_id: int, attempts: int, now: datetime, message: str) -> None:
    """The error row of a job cancelled before it ran (or while it waited again); also
    written by the claim's start (core.claims) for a job cancelled as it was claimed."""
    FailedExecution.objects.using(db).create(
        job_id=job_id,
        attempt=attempts,
        exception_class_path=CANCELLED_ERROR,
        message=message,
        traceback="",
        failed_at=now,
    )


# --- keys and queues ----------------------------------------------------------------------


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
