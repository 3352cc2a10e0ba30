"""Running one claimed job in a worker thread, and recording its outcome exactly once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from inspect import iscoroutinefunction
from typing import Any, cast

from asgiref.sync import async_to_sync
from django.db import close_old_connections
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.signals import task_finished, task_started

from django_jobs.core.batches import current_job_id
from django_jobs.core.claimed import MAX_ERROR_MESSAGE, fail_job, release_job, snooze_job
from django_jobs.core.current_job import current_control
from django_jobs.core.progress import flush_progress
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_jobs
from django_jobs.db.json_values import Unreadable
from django_jobs.db.retry import reset_connection
from django_jobs.exceptions import (
    JobInterrupted,
    ResultNotStored,
    Snooze,
    TaskNotFound,
    UnreadableJob,
)
from django_jobs.models import Job, JobStatus
from django_jobs.observability.tracing import execution_scope, mark_not_run, traced_execution
from django_jobs.runtime.completer import write_isolated
from django_jobs.runtime.context import (
    MAX_LOGGED,
    ExecutionContext,
    Success,
    announce_failure,
    describe,
    error_info,
    fail_or_stop,
    persist,
)
from django_jobs.runtime.watchdog import Control
from django_jobs.signals import ATTEMPT_FAILED_LOG_MARK
from django_jobs.tasks.loading import load_task
from django_jobs.tasks.results import build_result
from django_jobs.tasks.serialization import json_return_value
from django_jobs.text import clip, jobs_logger, storable_text

logger = jobs_logger("django_jobs.worker")


def execute_job(job: Job, ctx: ExecutionContext, *, started: bool = False) -> None:
    """Start (unless the caller already did: ``started``), run and finalise ``job``;
    never raises, whatever the task does. All of it runs in the tracing hooks' scopes
    (``execution_scope``, which cannot raise either), so what is logged or reported about
    the job, up to its recorded outcome, is in the job's trace."""
    with execution_scope(job):
        close_old_connections()
        try:
            run_claimed_job(job, ctx, started=started)
        except Exception as exc:
            # A bug of ours, or an outcome the database refused: the job must not stay
            # claimed by a live process forever.
            logger.exception("internal error while running job %s", job.pk)
            settle_after_error(job, ctx, exc)
        finally:
            close_old_connections()


def settle_after_error(job: Job, ctx: ExecutionContext, exc: Exception) -> None:
    """Fail ``job`` (retried while attempts remain) after an error that stopped its
    outcome from being recorded, or stop this process (``fail_or_stop``)."""
    reset_connection(ctx.db)  # whatever state the failed statement left it in
    fail_or_stop(ctx, job.pk, error_info(exc, ctx.max_error_size), retry=True)


def start_once(jobs: list[Job], ctx: ExecutionContext) -> Callable[[], list[Job]]:
    """``start_jobs`` made safe to retry after an error that hid a successful commit.

    A connection lost during COMMIT leaves us not knowing whether the attempts
    were counted; counting them again would make ``attempts`` lie. Only our own
    start turns our claimed jobs RUNNING, and it turns all of them in one
    transaction, so on a retry any of them RUNNING means that it did.
    """
    tried = False

    def action() -> list[Job]:
        nonlocal tried
        if tried:
            rows = {
                row["pk"]: row
                for row in Job.objects.using(ctx.db)
                .filter(
                    pk__in=[job.pk for job in jobs],
                    status=JobStatus.RUNNING,
                    claimed_execution__process_id=ctx.process_id,
                )
                .values("pk", "attempts", "worker_ids", "started_at", "last_attempted_at")
            }
            if rows:
                for job in jobs:
                    for name, value in rows.get(job.pk, {}).items():
                        setattr(job, name, value)
                        job.status = JobStatus.RUNNING
                return [job for job in jobs if job.pk in rows]
        tried = True
        return start_jobs(ctx.db, jobs, ctx.process_id, ctx.worker_id)

    return action


def start_claimed(jobs: list[Job], ctx: ExecutionContext) -> list[Job]:
    """Count the attempts of ``jobs`` in one transaction, riding out outages."""
    return persist(ctx, f"starting {len(jobs)} job(s)", start_once(jobs, ctx)) or []


def interrupted(control: Control, exc: BaseException, duration: float) -> ErrorInfo:
    """The error of an attempt that was cancelled, timed out or interrupted at its
    worker's shutdown deadline, whatever it raised (an ``async def`` body raises
    asyncio's ``CancelledError``; the record names the reason all the same)."""
    kind = control.exception()
    if control.cancelled:
        what = "cancelled"
    elif (waited := control.shutdown_timeout) is not None:
        what = f"interrupted: still running after the {waited:g}s shutdown timeout"
    else:
        what = f"timed out: still running after its timeout of {control.timeout:g}s"
    message = f"{what} (ran {duration:.3f}s)"
    raised = error_info(exc)
    if not isinstance(exc, JobInterrupted):
        message += f"; it raised {type(exc).__name__}: {raised.message}"
    return ErrorInfo(
        f"{kind.__module__}.{kind.__qualname__}",
        storable_text(message, MAX_ERROR_MESSAGE),
        raised.traceback,
    )


def snooze(
    job: Job, task: Task, result: TaskResult, ctx: ExecutionContext, seconds: float, duration: float
) -> None:
    """The task raised ``Snooze``: wait ``seconds``, then run again, no attempt used up."""
    run_at = persist(
        ctx,
        f"snoozing job {job.pk}",
        lambda: snooze_job(ctx.db, job.pk, ctx.process_id, seconds),
    )
    if run_at is None:
        logger.warning("job %s snoozed but its claim was already settled elsewhere", job.pk)
        return
    logger.info(
        "job snoozed %s duration=%.3fs run_at=%s", describe(job), duration, run_at.isoformat()
    )
    object.__setattr__(result, "status", TaskResultStatus.READY)
    task_finished.send(type(task.get_backend()), task_result=result)


def is_async(task: Task) -> bool:
    """An ``async def`` task (the test ``Task.call`` makes to pick ``async_to_sync``)."""
    return iscoroutinefunction(task.func)


# OpenTelemetry, when installed: the run's span (django_jobs/observability/tracing.py).
@traced_execution
def call_task(task: Task, job: Job, result: TaskResult) -> object:
    """The task's function, called with the job as the running one (for nested batches)."""
    running = current_job_id.set(job.pk)
    try:
        args = [TaskContext(task_result=result), *job.args] if task.takes_context else job.args
        if is_async(task):
            return run_async_body(task.func, *args, **job.kwargs)
        return task.call(*args, **job.kwargs)
    finally:
        current_job_id.reset(running)


def run_async_body(
    func: Callable[..., Coroutine[Any, Any, object]], *args: object, **kwargs: object
) -> object:
    """Run an ``async def`` body as ``Task.call`` does (``async_to_sync``: an event loop
    in a thread of its own, this thread serving its thread-sensitive sync calls such as
    the ORM's), with its asyncio task handed to the watchdog so that a cancel or a
    timeout cancels it. Its ``CancelledError`` comes out here like any exception."""
    # The executor set it: the watchdog's Control of this job (a StopFlag to the core).
    control = cast(Control | None, current_control.get())

    async def body() -> object:
        if control is not None:
            task = asyncio.current_task()
            assert task is not None  # async_to_sync runs us in a task
            control.attach(asyncio.get_running_loop(), task)
        try:
            return await func(*args, **kwargs)
        finally:
            if control is not None:
                control.detach()

    return async_to_sync(body)()


@dataclass
class Attempt:
    """A started job about to run its body: what its outcome is recorded with."""

    job: Job
    task: Task
    result: TaskResult
    control: Control | None
    began: float

    def settle(self, ctx: ExecutionContext, exc: BaseException) -> None:
        """The body raised ``exc`` (or its value cannot be stored): record it."""
        if self.control is not None and ctx.watchdog is not None:
            ctx.watchdog.forget(self.control)
        settle_failure(
            self.job,
            self.task,
            self.result,
            ctx,
            self.control,
            exc,
            time.monotonic() - self.began,
        )

    def succeed(self, ctx: ExecutionContext, value: object) -> None:
        """The body returned ``value`` (checked): hand it to the completer."""
        success = Success(self.job, self.task, self.result, value, time.monotonic() - self.began)
        if ctx.completer is not None:
            ctx.completer.submit(success)
        else:
            write_isolated(ctx, [success])


def begin_attempt(job: Job, ctx: ExecutionContext, *, started: bool = False) -> Attempt | None:
    """Everything before a claimed job's body: its task loaded, the job started (unless
    the claim did it), ``task_started`` sent, the watchdog watching; None when it must not
    run (its task cannot be imported: failed; a stop began or its claim was lost)."""
    unreadable = unreadable_input(job)
    if unreadable is not None:
        fail_unloadable(job, ctx, unreadable, started=started)
        return None
    try:
        task = load_task(job.task_path)
    except TaskNotFound as exc:
        fail_unloadable(job, ctx, exc, started=started)
        return None
    if not started and not start_or_hand_back(job, ctx):
        return None
    result = build_result(job)
    task_started.send(type(task.get_backend()), task_result=result)
    logger.info("job started %s", describe(job))
    began = time.monotonic()
    watchdog = ctx.watchdog
    control = watchdog.watch(job, asynchronous=is_async(task)) if watchdog is not None else None
    return Attempt(job, task, result, control, began)


def run_claimed_job(job: Job, ctx: ExecutionContext, *, started: bool = False) -> None:
    """Run one claimed job to its outcome: started (unless the claim did it), watched, its
    success handed to the completer or its failure recorded. Nothing the job does or
    returns escapes: its outcome is recorded, or the worker stops (docs/design.md
    invariant 10)."""
    attempt = begin_attempt(job, ctx, started=started)
    if attempt is None:
        return
    try:
        value = run_watched(attempt.task, job, attempt.result, ctx, attempt.control)
    except BaseException as exc:  # SystemExit/KeyboardInterrupt of a task must not kill us
        attempt.settle(ctx, exc)
        return
    attempt.succeed(ctx, value)


def unreadable_input(job: Job) -> UnreadableJob | None:
    """Why ``job`` cannot run on what its row holds, or None: arguments whose JSON Python
    could not decode (``db/json_values.py``); retrying would read the same text again. (An
    unreadable backoff is a backoff of no known form: ``retry_delay`` logs it and uses the
    default, as for any other.)"""
    for name in ("args", "kwargs"):
        value = getattr(job, name)
        if isinstance(value, Unreadable):
            return UnreadableJob(f"job {job.pk}: its {name} cannot be read ({value.reason})")
    return None


def fail_unloadable(
    job: Job, ctx: ExecutionContext, exc: TaskNotFound | UnreadableJob, *, started: bool = False
) -> None:
    """A job whose task cannot be imported, or whose input cannot be read, fails for good,
    its body never run.

    ``started``: its claim counted the attempt, which the failure takes back.
    """
    logger.error(
        "job failed %s error=%s (not retried)",
        describe(job),
        exc,
        extra={ATTEMPT_FAILED_LOG_MARK: job.pk},
    )
    error = error_info(exc)
    outcome = persist(
        ctx,
        f"failing job {job.pk}",
        lambda: fail_job(
            ctx.db,
            job.pk,
            ctx.process_id,
            error,
            worker_id=ctx.worker_id,
            retry=False,
            never_ran=True,  # a start its claim counted is taken back
        ),
    )
    if outcome is not None:
        attempt = job.attempts if started else job.attempts + 1
        announce_failure(job, exc, error, attempt, outcome, None)


def start_or_hand_back(job: Job, ctx: ExecutionContext) -> bool:
    """Start a job the claim did not start; False if it must not run: a stop began (it is
    handed back, costing nothing) or its claim was lost."""
    if ctx.lifecycle.stopping.is_set():
        persist(
            ctx,
            f"handing back job {job.pk}",
            lambda: release_job(ctx.db, job.pk, ctx.process_id),
        )
        logger.info("job handed back %s (shutting down before it started)", describe(job))
        mark_not_run(job)
        return False
    if not start_claimed([job], ctx):
        logger.warning("job %s: claim lost before start (process pruned?); not running it", job.pk)
        mark_not_run(job)
        return False
    return True


def run_watched(
    task: Task, job: Job, result: TaskResult, ctx: ExecutionContext, control: Control | None
) -> object:
    """The job's body under its watchdog's ``control``; its return value, checked in the
    job's own thread: a value the database would refuse fails this job, not the shared
    finish of every job beside it."""
    token = current_control.set(control)
    try:
        if control is not None and control.reason is not None:
            raise control.exception()  # cancelled before its body began
        value = call_task(task, job, result)
    finally:
        # The body has ended: nothing may interrupt this thread for it any more.
        if control is not None and ctx.watchdog is not None:
            ctx.watchdog.forget(control)
        current_control.reset(token)
        flush_progress(job.pk)  # its last set_progress() value, before the outcome
    if control is not None and control.cancelled:
        # It saw cancel_requested() and returned: cancelled all the same.
        raise control.exception()
    return json_return_value(value, ctx.db, ctx.max_result_size)


def settle_failure(
    job: Job,
    task: Task,
    result: TaskResult,
    ctx: ExecutionContext,
    control: Control | None,
    exc: BaseException,
    duration: float,
) -> None:
    """Record what ended a job's body by raising: a snooze, or a failed attempt (retried
    while attempts remain, unless it was cancelled or its value cannot be stored)."""
    if isinstance(exc, Snooze) and (control is None or control.reason is None):
        snooze(job, task, result, ctx, exc.seconds, duration)
        return
    error = error_info(exc, ctx.max_error_size)
    if control is not None and control.reason is not None:
        error = interrupted(control, exc, duration)
    # A cancelled job is never retried, whatever its body raised on the way out; nor one
    # whose body ran to its end but whose value cannot be stored.
    may_retry = (control is None or not control.cancelled) and not isinstance(exc, ResultNotStored)
    outcome = persist(
        ctx,
        f"failing job {job.pk}",
        lambda: fail_job(
            ctx.db, job.pk, ctx.process_id, error, worker_id=ctx.worker_id, retry=may_retry
        ),
    )
    if outcome is None:
        logger.warning("job %s failed but its claim was already settled elsewhere", job.pk)
        return
    retry = (
        f" retry_at={outcome.retry_at.isoformat()}"
        if outcome.retry_at is not None
        else " (no retries left)"
    )
    logger.error(
        "job failed %s duration=%.3fs error=%s: %s%s",
        describe(job),
        duration,
        type(exc).__name__,
        clip(error.message, MAX_LOGGED),
        retry,
        extra={ATTEMPT_FAILED_LOG_MARK: job.pk},
    )
    stopped_by = control.exception() if control is not None and control.reason else None
    announce_failure(job, exc, error, job.attempts, outcome, stopped_by)
    status = TaskResultStatus.READY if outcome.will_retry else TaskResultStatus.FAILED
    object.__setattr__(result, "status", status)
    task_finished.send(type(task.get_backend()), task_result=result)
