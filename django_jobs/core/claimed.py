"""Ending a claim: finish, fail, snooze, hand back.

Each runs in one transaction that first locks the claimed row *of this process* and returns
at once if it is gone: a job is finalised exactly once, whoever races for it (a worker
finishing late after a false prune, two dispatchers recovering the same dead process). The
slot of the job's concurrency key is freed in that same transaction, so a crash anywhere
rolls everything back and leaves the claim for recovery (docs/design.md section 4).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from datetime import datetime

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from django_jobs.conf import size_limit
from django_jobs.core.admission import (
    admit_jobs,
    hand_back_to_key,
    make_ready,
    release_slot,
    release_slots,
)
from django_jobs.core.batches import count_outcomes
from django_jobs.core.dependencies import batch_failures, merge_outcomes, settle_ended
from django_jobs.core.operator import record_cancelled
from django_jobs.core.rows import ErrorInfo, FailOutcome
from django_jobs.db import features, ops
from django_jobs.db.transactions import hot_transaction
from django_jobs.limits import later
from django_jobs.models import (
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    ScheduledExecution,
)
from django_jobs.tasks.retries import retry_delay
from django_jobs.text import storable_text

# Characters kept of an error's message (its traceback keeps max_error_size).
MAX_ERROR_MESSAGE = 2000


def finish_job(db: str, job_id: int, process_id: int, return_value: object) -> bool:
    """Record one success; False (and nothing written) if this process no longer holds it."""
    return job_id in finish_jobs(db, process_id, {job_id: return_value})


def finish_jobs(
    db: str,
    process_id: int,
    return_values: dict[int, object],
    known: Iterable[Job] = (),
) -> set[int]:
    """Record the success of many jobs in one transaction; return the ids finished.

    Only jobs whose claim this process still holds are finalised (under the
    claims' locks), so each is finalised exactly once however many paths race
    for it. Every key's semaphore is locked before any key's blocked jobs are
    promoted (:func:`~django_jobs.core.admission.release_slots`), and the batches are
    counted after every key (docs/design.md section 4's lock order).

    ``known``: the caller's copies of (some of) these jobs. Where the database can
    finish in one statement (``features(db).can_finish_in_one_statement``), those
    without a batch are finished so: the ones without a concurrency key in one
    statement, the keyed ones with their slots' release in one message. The copy
    is a hint the statement checks (a wrong one costs a statement, nothing else);
    every other job takes the general transaction, :func:`finish_locked`.
    """
    if not return_values:
        return set()
    done: set[int] = set()
    if features(db).can_finish_in_one_statement:
        done = finish_unbatched(db, process_id, return_values, known)
    else:
        done = finish_plain(db, process_id, return_values, known)
    if len(done) == len(return_values):
        return done
    return_values = {pk: value for pk, value in return_values.items() if pk not in done}
    return done | finish_locked(db, process_id, return_values)


def finish_plain(
    db: str, process_id: int, return_values: dict[int, object], known: Iterable[Job]
) -> set[int]:
    """The jobs of ``known`` with no concurrency key, no batch and no workflow, in one
    round trip where the database has a way (``ops.finish_plain``: MySQL/MariaDB's
    procedure, which checks the copy under the claims' locks); the ids finished."""
    plain = {
        job.pk: return_values[job.pk]
        for job in known
        if job.pk in return_values
        and not job.concurrency_key
        and job.batch_id is None
        and job.workflow_id is None
    }
    if not plain:
        return set()
    return ops(db).finish_plain(db, process_id, plain, timezone.now()) or set()


def finish_unbatched(
    db: str, process_id: int, return_values: dict[int, object], known: Iterable[Job]
) -> set[int]:
    """The one-statement finishes of :func:`finish_jobs`: the jobs of ``known`` with no
    batch, those without a key first, then the keyed ones with their slots."""
    unbatched = [job for job in known if job.batch_id is None and job.pk in return_values]
    nodes = {job.pk: return_values[job.pk] for job in unbatched if job.workflow_id is not None}
    unbatched = [job for job in unbatched if job.workflow_id is None]
    plain = {job.pk: return_values[job.pk] for job in unbatched if not job.concurrency_key}
    keyed = {job.pk: return_values[job.pk] for job in unbatched if job.concurrency_key}
    done: set[int] = set()
    if nodes:
        done |= finish_with_dependents(db, process_id, nodes)
    if plain:
        done |= set(ops(db).finish_unbatched(db, process_id, plain, timezone.now()))
    if keyed:
        keys = {job.concurrency_key for job in unbatched if job.concurrency_key}
        done |= finish_keyed_unbatched(db, process_id, keyed, keys)
    return done


def finish_keyed_unbatched(
    db: str, process_id: int, return_values: dict[int, object], keys: Collection[str]
) -> set[int]:
    """Jobs without a batch: their claims, then their keys' slots, in one round trip
    (``ops.finish_keyed``); where the connection cannot send several statements at
    once, in one transaction of five (BEGIN, the finish, the semaphores' lock, the
    recount and promotion, COMMIT)."""
    now = timezone.now()
    seam = ops(db)
    finished = seam.finish_keyed(db, process_id, return_values, keys, now)
    if finished is not None:
        return set(finished)
    with transaction.atomic(using=db):
        found = seam.finish_unbatched(db, process_id, return_values, now, keyed=True)
        release_slots(db, {key for key in found.values() if key})
    return set(found)


def finish_with_dependents(db: str, process_id: int, return_values: dict[int, object]) -> set[int]:
    """Jobs of a workflow without a batch, where the database finishes in one statement:
    that statement (which reads each job's workflow under its lock), then the keys'
    slots and the dependents, in one transaction: four round trips where
    :func:`finish_locked` takes six."""
    with hot_transaction(db):
        found = ops(db).finish_with_dependents(db, process_id, return_values, timezone.now())
        release_slots(db, {key for key, _ in found.values() if key})
        released = settle_ended(db, {pk: True for pk, (_, flow) in found.items() if flow})
        count_outcomes(db, released)
    return set(found)


def finish_locked(db: str, process_id: int, return_values: dict[int, object]) -> set[int]:
    """The portable :func:`finish_jobs`: any job, keys and batches included.

    Three statements in one transaction (the claims locked, deleted, the jobs
    updated: ``Operations.lock_held_claims``, ``delete_executions``,
    ``mark_succeeded``), then the keys' slots and the batches' counts.
    """
    seam = ops(db)
    with hot_transaction(db):
        claims = seam.lock_held_claims(db, process_id, list(return_values))
        if not claims:
            return set()
        done = [claim.job_id for claim in claims]
        seam.delete_executions(db, ClaimedExecution, done)
        seam.mark_succeeded(db, done, return_values, timezone.now())
        release_slots(db, {claim.concurrency_key for claim in claims if claim.concurrency_key})
        # A job of a workflow may have dependents: the mark was read under its row's lock.
        released = settle_ended(
            db, {claim.job_id: True for claim in claims if claim.workflow_id is not None}
        )
        per_batch: dict[int, int] = defaultdict(int)
        for claim in claims:
            if claim.batch_id is not None:
                per_batch[claim.batch_id] += 1
        count_outcomes(
            db, merge_outcomes({batch_id: (n, 0) for batch_id, n in per_batch.items()}, released)
        )
    return set(done)


def fail_job(
    db: str,
    job_id: int,
    process_id: int,
    error: ErrorInfo,
    *,
    worker_id: str = "",
    retry: bool = True,
    never_ran: bool = False,
) -> FailOutcome | None:
    """Record a failed attempt; retry after the backoff while attempts remain.

    ``never_ran``: the caller (the job's worker) knows its body never ran (its
    task could not be imported): a start counted by the claim is undone first.
    Returns None if this process no longer holds the job.
    """
    with hot_transaction(db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return None
        if never_ran:
            undo_start(db, job_id)
        return fail_claimed(db, claim, error, worker_id=worker_id, retry=retry)


def undo_start(db: str, job_id: int) -> None:
    """Uncount the start of a job whose body never ran; its caller holds its claim's lock.

    A worker's claim starts the jobs it claims (``claim_jobs``).
    When that worker then does not run one (a stop began, its task cannot be
    imported, its claim's commit seemed lost) the attempt was never made, so it
    is taken back: attempts are real starts (docs/design.md invariant 4). A job that
    is not ``RUNNING`` was never started and is left as it is. The previous
    attempt's ``last_attempted_at``, overwritten by the claim, is not restored.
    """
    job = (
        Job.objects.using(db)
        .filter(pk=job_id, status=JobStatus.RUNNING)
        .only("pk", "attempts", "worker_ids", "started_at", "last_attempted_at")
        .first()
    )
    if job is None:
        return
    attempts = max(0, job.attempts - 1)
    Job.objects.using(db).filter(pk=job_id).update(
        status=JobStatus.CLAIMED,
        attempts=attempts,
        worker_ids=list(job.worker_ids or [])[:-1],
        started_at=job.started_at if attempts else None,
        last_attempted_at=job.last_attempted_at if attempts else None,
    )


def fail_claimed(
    db: str, claim: ClaimedExecution, error: ErrorInfo, *, worker_id: str, retry: bool
) -> FailOutcome:
    """The body of :func:`fail_job`; the caller holds the lock on ``claim``."""
    # Locked (after its claim): its workflow mark, which says whether it has dependents,
    # is read as an enqueue waiting for it last wrote it (core/dependencies.py).
    job = Job.objects.using(db).select_for_update().get(pk=claim.job_id)
    now = timezone.now()
    # Whoever built the error, what is written fits every database: no NUL, cut to size.
    FailedExecution.objects.using(db).create(
        job_id=job.pk,
        attempt=job.attempts,
        worker_id=worker_id,
        exception_class_path=storable_text(error.exception_class_path, 255),
        message=storable_text(error.message, MAX_ERROR_MESSAGE),
        traceback=storable_text(error.traceback, size_limit("max_error_size")),
        failed_at=now,
    )
    delete_claim(db, claim)
    retry_at = None
    # A job whose cancel was requested is never retried, whatever ended this attempt (a
    # shutdown or a timeout can land before its worker has seen the request).
    if retry and job.attempts < job.max_attempts and job.cancel_requested_at is None:
        retry_at = later(now, retry_delay(job.backoff, job.attempts, job.task_path))
    if retry_at is None:
        Job.objects.using(db).filter(pk=job.pk).update(
            status=JobStatus.FAILED, finished_at=now, unique_lock=None
        )
    elif retry_at > now:
        ScheduledExecution.objects.using(db).create(
            job_id=job.pk, queue_name=job.queue_name, priority=job.priority, scheduled_at=retry_at
        )
        Job.objects.using(db).filter(pk=job.pk).update(status=JobStatus.SCHEDULED)
    if claim.concurrency_key:
        release_slot(db, claim.concurrency_key)
    if retry_at is None:
        ended = settle_ended(db, {job.pk: False}) if job.workflow_id is not None else {}
        count_outcomes(db, merge_outcomes(batch_failures([job]), ended))
    if retry_at is not None and retry_at <= now:
        # Due at once: through admission, after the slot was given back.
        job.status = JobStatus.SCHEDULED
        admit_jobs(db, [job])
    return FailOutcome(retry_at=retry_at)


def snooze_job(db: str, job_id: int, process_id: int, seconds: float) -> datetime | None:
    """Put a running job back to wait ``seconds``: the task asked (``Snooze``).

    Its start stays counted (attempts are real starts) and ``max_attempts`` grows
    by one, so the snooze uses up no retry. Its slot is freed like a failure's;
    a job due at once goes back through admission after that. Returns when it
    will run, or None if this process no longer holds it.
    """
    with transaction.atomic(using=db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return None
        job = Job.objects.using(db).get(pk=job_id)
        now = timezone.now()
        run_at = later(now, seconds)
        delete_claim(db, claim)
        job.max_attempts += 1
        job.status = JobStatus.SCHEDULED
        Job.objects.using(db).filter(pk=job_id).update(
            status=JobStatus.SCHEDULED, max_attempts=F("max_attempts") + 1
        )
        if seconds > 0:
            ScheduledExecution.objects.using(db).create(
                job_id=job_id, queue_name=job.queue_name, priority=job.priority, scheduled_at=run_at
            )
        if claim.concurrency_key:
            release_slot(db, claim.concurrency_key)
        if seconds <= 0:
            admit_jobs(db, [job])
    return run_at


def release_job(db: str, job_id: int, process_id: int) -> bool:
    """Hand back a claimed job whose function never started; it costs no attempt.

    With a concurrency key the job goes back through the limit (its slot is
    freed and it competes for it again with the blocked jobs), never around it
    (Solid Queue PR #689 items 3 and 6).
    """
    with transaction.atomic(using=db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return False
        # Its worker hands it back unrun: a start its claim counted is taken back.
        undo_start(db, job_id)
        release_claimed(db, claim)
    return True


def release_claimed(db: str, claim: ClaimedExecution) -> None:
    delete_claim(db, claim)
    job = Job.objects.using(db).get(pk=claim.job_id)
    if job.cancel_requested_at is not None:
        # Cancelled before it ever started: it ends here, costing no attempt, rather
        # than waiting to be claimed again only to be stopped at its start.
        end_cancelled(db, [job], {claim.concurrency_key})
        return
    if claim.concurrency_key:
        hand_back_to_key(db, claim.concurrency_key, job)
    else:
        make_ready(db, [job])


def end_cancelled(db: str, jobs: list[Job], keys: Iterable[str | None]) -> None:
    """Cancelled jobs whose claims were just deleted, never started: FAILED,
    JobCancelled. Then the slots of ``keys`` (the deleted claims' concurrency keys)
    are freed and the jobs' batches counted, in docs/design.md section 4's order."""
    now = timezone.now()
    if jobs:
        # The rows before their error rows (whose foreign key check, on InnoDB, takes a
        # shared lock this UPDATE would have to upgrade).
        Job.objects.using(db).filter(pk__in=[job.pk for job in jobs]).update(
            status=JobStatus.FAILED, finished_at=now, unique_lock=None
        )
    for job in jobs:
        record_cancelled(db, job.pk, job.attempts, now, "cancelled before it started")
    release_slots(db, {key for key in keys if key})
    ended = settle_ended(db, {job.pk: False for job in jobs})
    count_outcomes(db, merge_outcomes(batch_failures(jobs), ended))


def delete_claim(db: str, claim: ClaimedExecution) -> None:
    # A queryset delete, not claim.delete(): that one resets claim.job_id (the
    # primary key) to None, and callers still need it.
    ClaimedExecution.objects.using(db).filter(pk=claim.job_id).delete()


def lock_own_claim(db: str, job_id: int, process_id: int) -> ClaimedExecution | None:
    return (
        ClaimedExecution.objects.using(db)
        .select_for_update()
        .filter(job_id=job_id, process_id=process_id)
        .first()
    )
