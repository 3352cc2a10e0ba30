"""What a worker's threads share to run jobs and record their outcomes.

A module of its own so that the executor (which runs a job) and the completer
(which records successes in batches) both use it without importing each other:
both import this module, and it imports neither (the completer is known here
only as a :class:`SuccessSink`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from django.tasks import Task, TaskResult

from django_jobs.conf import JobsSettings
from django_jobs.core.claimed import MAX_ERROR_MESSAGE, fail_job
from django_jobs.core.rows import ErrorInfo, FailOutcome
from django_jobs.db.retry import retry_until_done
from django_jobs.models import Job
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.signals import job_attempt_failed
from django_jobs.text import clip, jobs_logger, safe_str, storable_text

if TYPE_CHECKING:
    from django_jobs.exceptions import JobInterrupted
    from django_jobs.runtime.watchdog import Watchdog


@dataclass
class Success:
    """A job whose body returned, with its checked return value, not yet recorded."""

    job: Job
    task: Task
    result: TaskResult
    value: object
    duration: float


class SuccessSink(Protocol):
    """Where a job's thread hands its success to be recorded in a batch
    (``runtime.completer.Completer``)."""

    def submit(self, success: Success) -> None: ...


@dataclass
class ExecutionContext:
    db: str
    process_id: int
    worker_id: str
    lifecycle: Lifecycle
    db_retry_max_delay: float
    # The size limits of DJANGO_JOBS (conf.JobsSettings), read once per process.
    max_result_size: int = JobsSettings.max_result_size
    max_error_size: int = JobsSettings.max_error_size
    # Where successes go to be written in batches; None writes each in its own thread.
    completer: SuccessSink | None = None
    # Enforces timeouts and cancel requests; None runs jobs unwatched (tests).
    watchdog: Watchdog | None = None


logger = jobs_logger("django_jobs.worker")

# Characters of an exception's message shown in a log line.
MAX_LOGGED = 500


def describe(job: Job) -> str:
    return f"task={job.task_path} job={job.pk} attempt={job.attempts}"


def persist[T](ctx: ExecutionContext, what: str, action: Callable[[], T]) -> T | None:
    """Run ``action`` until it gets through a database outage, or an immediate stop
    (then None): the job ran, and losing its outcome would make recovery run it again."""
    return retry_until_done(
        ctx.db,
        what,
        action,
        give_up=ctx.lifecycle.immediate.is_set,
        max_delay=ctx.db_retry_max_delay,
    )


def error_info(exc: BaseException, max_size: int = JobsSettings.max_error_size) -> ErrorInfo:
    """The record of ``exc``, whatever it is: its ``__str__`` may raise, its message may
    hold a NUL or a megabyte (``fail_claimed`` cuts and cleans what it writes)."""
    kind = type(exc)
    try:
        trace = "".join(traceback.format_exception(exc))
    except Exception as problem:
        trace = f"(its traceback could not be formatted: {type(problem).__name__})"
    return ErrorInfo(
        exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
        message=storable_text(safe_str(exc), MAX_ERROR_MESSAGE),
        traceback=storable_text(trace, max_size),
    )


def fail_or_stop(
    ctx: ExecutionContext, job_id: int, error: ErrorInfo, *, retry: bool
) -> FailOutcome | None:
    """Record the failure of ``job_id`` where its outcome could not be recorded otherwise;
    what was recorded, or None if nothing was (the claim was no longer ours, or this
    process is stopping).

    If even that cannot be written, this process stops (``request_broken``): its
    claims are then settled by recovery, which writes nothing of the job's own,
    and a fresh process takes over. A worker that went on heartbeating would hold
    this claim, and its key's slot, forever.
    """
    try:
        return persist(
            ctx,
            f"failing job {job_id}",
            lambda: fail_job(
                ctx.db, job_id, ctx.process_id, error, worker_id=ctx.worker_id, retry=retry
            ),
        )
    except Exception:
        logger.exception("job %s: its failure could not be recorded either", job_id)
        ctx.lifecycle.request_broken(f"the outcome of job {job_id} could not be recorded")
        return None


def announce_failure(
    job: Job,
    exc: BaseException,
    error: ErrorInfo,
    attempt: int,
    outcome: FailOutcome,
    interrupted_by: type[JobInterrupted] | None,
) -> None:
    """Send ``job_attempt_failed`` (django_jobs/signals.py) for a failure just recorded,
    by the job's thread (executor) or by the completer's (a success the database refused).

    A receiver that raises (an error tracker that is down, a bug) is logged and nothing
    more: the outcome is already committed, and this thread runs the next job
    (docs/design.md invariant 10). ``send_robust`` catches a receiver's ``Exception``
    only: one that raises ``SystemExit`` (or any other ``BaseException``) ends the sending
    there, is logged, and ends neither the thread (a worker thread ended by a
    ``SystemExit`` would vanish without a word) nor what the caller does next
    (``task_finished``). ``KeyboardInterrupt`` is let through: it is the operator's
    Ctrl-C, delivered only to the main thread, where a job runs in a test or the testing
    toolkit, never in ``run_jobs``.
    """
    try:
        responses = job_attempt_failed.send_robust(
            sender=Job,
            job=job,
            exception=exc,
            error=error,
            attempt=attempt,
            will_retry=outcome.will_retry,
            retry_at=outcome.retry_at,
            interrupted_by=interrupted_by,
        )
    except KeyboardInterrupt:
        raise
    except BaseException:  # see above: a receiver's SystemExit included
        logger.exception("job %s: job_attempt_failed could not be sent to every receiver", job.pk)
        return
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.error(
                "job %s: the job_attempt_failed receiver %s raised %s: %s",
                job.pk,
                getattr(receiver, "__qualname__", receiver),
                type(response).__name__,
                clip(safe_str(response), MAX_LOGGED),
                exc_info=response,
            )
