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
from django_jobs.core.rows import ErrorInfo
from django_jobs.db.retry import retry_until_done
from django_jobs.models import Job
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.text import jobs_logger, safe_str, storable_text

if TYPE_CHECKING:
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


def fail_or_stop(ctx: ExecutionContext, job_id: int, error: ErrorInfo, *, retry: bool) -> None:
    """Record the failure of ``job_id`` where its outcome could not be recorded otherwise.

    If even that cannot be written, this process stops (``request_broken``): its
    claims are then settled by recovery, which writes nothing of the job's own,
    and a fresh process takes over. A worker that went on heartbeating would hold
    this claim, and its key's slot, forever.
    """
    try:
        persist(
            ctx,
            f"failing job {job_id}",
            lambda: fail_job(
                ctx.db, job_id, ctx.process_id, error, worker_id=ctx.worker_id, retry=retry
            ),
        )
    except Exception:
        logger.exception("job %s: its failure could not be recorded either", job_id)
        ctx.lifecycle.request_broken(f"the outcome of job {job_id} could not be recorded")
