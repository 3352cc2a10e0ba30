"""Recovering the claims of a dead process: each settled exactly once, whoever else
tries (two dispatchers, a falsely pruned worker finishing late).

A job that had started fails its attempt (``ProcessDied``; retried while attempts remain);
one that never started is handed back at no cost. One job whose row makes its recovery
raise is failed for good without reading that row, so it never stops the recovery of the
others, nor a process's start-up (docs/design.md invariant 10).
"""

from __future__ import annotations

from django.db import InterfaceError, OperationalError, transaction

from django_jobs.core.claimed import fail_claimed, lock_own_claim, release_claimed
from django_jobs.core.rows import ErrorInfo
from django_jobs.models import ClaimedExecution, Job, JobStatus
from django_jobs.text import jobs_logger, safe_str

logger = jobs_logger("django_jobs.recovery")


def recover_claim(db: str, job_id: int, process_id: int, reason: str) -> str | None:
    """Settle one claim of a dead process: hand back if never started, else fail it.

    The job's status is read under the claim's lock, so a falsely pruned worker
    that starts the job at the same moment is seen either before (running: a
    failed attempt) or after (the claim is gone: nothing to do).
    """
    with transaction.atomic(using=db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return None
        status, cancel_requested_at = (
            Job.objects.using(db)
            .filter(pk=job_id)
            .values_list("status", "cancel_requested_at")
            .get()
        )
        if status == JobStatus.RUNNING:
            error = ErrorInfo("django_jobs.exceptions.ProcessDied", reason, reason)
            if cancel_requested_at is not None:
                # Cancelled while it ran: never retried, even when its worker died first.
                message = f"cancelled; {reason}"
                error = ErrorInfo("django_jobs.exceptions.JobCancelled", message, message)
            retry = cancel_requested_at is None
            outcome = fail_claimed(db, claim, error, worker_id="", retry=retry)
            return "retried" if outcome.will_retry else "failed"
        release_claimed(db, claim)
        return "released"


def recover_process_claims(db: str, process_id: int, reason: str) -> dict[int, str]:
    """Recover every claim of ``process_id``; each exactly once, whoever else tries."""
    outcomes: dict[int, str] = {}
    job_ids = list(
        ClaimedExecution.objects.using(db)
        .filter(process_id=process_id)
        .values_list("job_id", flat=True)
    )
    for job_id in job_ids:
        try:
            outcome = recover_claim(db, job_id, process_id, reason)
        except (OperationalError, InterfaceError):
            raise  # the database, not the job: the caller rides out the outage
        except Exception as exc:
            # One job's row must not stop the recovery of the others, nor a process's
            # start-up (the supervisor recovers before it starts anything).
            logger.exception("job %s: its claim could not be recovered as usual", job_id)
            outcome = recover_without_retry(db, job_id, process_id, reason, exc)
        if outcome:
            outcomes[job_id] = outcome
    return outcomes


def recover_without_retry(
    db: str, job_id: int, process_id: int, reason: str, exc: Exception
) -> str | None:
    """The last resort of :func:`recover_process_claims`: fail the job for good, without
    reading anything of the row's (its backoff, its key's blocked jobs) that made the
    usual recovery raise. Left as it is (an orphan claim that the next prune tries
    again, logged each time) only if even this cannot be written."""
    message = f"{reason}; not retried: recovering it raised {type(exc).__name__}: {safe_str(exc)}"
    error = ErrorInfo("django_jobs.exceptions.ProcessDied", message, message)
    try:
        with transaction.atomic(using=db):
            claim = lock_own_claim(db, job_id, process_id)
            if claim is None:
                return None
            fail_claimed(db, claim, error, worker_id="", retry=False)
    except (OperationalError, InterfaceError):
        raise
    except Exception:
        logger.exception("job %s: its claim could not be recovered; left for the next try", job_id)
        return None
    return "failed"
