"""Running one claimed ``async def`` job as an asyncio task on its worker's event loop.

The twin of ``runtime/executor.py``'s :func:`~django_jobs.runtime.executor.execute_job`,
sharing every step but the body: the start, the signals, the outcome and its checks are the
same synchronous code, run on the job's ORM thread (the event loop must never wait for the
database, and Django refuses synchronous ORM calls from it); only the body is awaited on
the loop. Each job's thread-sensitive calls (its own ``sync_to_async`` and Django's async
ORM, ``aget()`` and the like) go to the ORM thread it was given, one of a few the lane
keeps: a handful of database connections serve hundreds of jobs (docs/running.md,
"Connections"), where asgiref's default would funnel every job of the process through one
thread, or give each job a thread of its own.

The body runs in an asyncio task of its own, so that a cancel or a timeout (the watchdog
cancels that task) never lands in the bookkeeping around it, and whatever it raises,
``KeyboardInterrupt`` and ``SystemExit`` included (asyncio would re-raise those out of the
loop, ending every job of the process), is caught in that task and recorded as the job's
failure (docs/design.md invariant 10).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, cast

from asgiref.sync import ThreadSensitiveContext
from django.db import close_old_connections
from django.tasks import TaskContext

from django_jobs.core.batches import current_job_id
from django_jobs.core.current_job import current_control
from django_jobs.core.progress import flush_progress
from django_jobs.models import Job
from django_jobs.observability.tracing import execution_scope, execution_span
from django_jobs.runtime.context import ExecutionContext
from django_jobs.runtime.executor import Attempt, begin_attempt, settle_after_error
from django_jobs.runtime.orm_threads import RuntimeSteps
from django_jobs.runtime.watchdog import Control
from django_jobs.tasks.serialization import json_return_value
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.worker")


@dataclass
class BodyOutcome:
    """What the body's task ended with: its value, or what it raised."""

    value: object = None
    raised: BaseException | None = None


async def execute_async_job(
    job: Job,
    ctx: ExecutionContext,
    steps: RuntimeSteps,
    *,
    started: bool = False,
    bodies: dict[asyncio.Task[Any], Job] | None = None,
) -> None:
    """Start (unless the claim did), run and finalise ``job`` on the running loop; never
    raises. ``steps``: the lane's way to its ORM threads (the job's own calls go to one
    of them, the steps around its body, batched with other jobs' steps, to the least
    busy). ``bodies``: where the body's task is registered while it runs (the lane's loop
    monitor names the job that blocks it).

    Two trips to an ORM thread per job, one before the body and one after: each trip is
    a thread switch, and at hundreds of jobs a second they were what bounded the lane
    (now shared by the jobs that start or end in the same turn of the loop)."""
    own = steps.threads.for_job()
    try:
        async with ThreadSensitiveContext(executor=own):
            with execution_scope(job):
                try:
                    attempt = await steps.call(begin_fresh, job, ctx, started)
                    if attempt is None:
                        return
                    outcome = await run_body(attempt, ctx, bodies)
                    await steps.call(conclude, attempt, ctx, outcome)
                except Exception as exc:
                    # A bug of ours, or an outcome the database refused: the job must not
                    # stay claimed by a live process forever.
                    logger.exception("internal error while running job %s", job.pk)
                    await steps.call(settle_and_close, job, ctx, exc)
    finally:
        own.release()


def begin_fresh(job: Job, ctx: ExecutionContext, started: bool) -> Attempt | None:
    """On the ORM thread: a usable connection, then everything before the body."""
    close_old_connections()
    attempt = begin_attempt(job, ctx, started=started)
    if attempt is None:
        close_old_connections()
    return attempt


def conclude(attempt: Attempt, ctx: ExecutionContext, outcome: BodyOutcome) -> None:
    """On the ORM thread: the body's last progress, then its outcome recorded (a value
    the database would refuse fails this job, as in a thread), then the connection left
    as a job's end leaves it."""
    try:
        flush_progress(attempt.job.pk)
        control = attempt.control
        try:
            if outcome.raised is not None:
                raise own_cancellation(outcome.raised, control)
            if control is not None and control.cancelled:
                # It saw cancel_requested() and returned: cancelled all the same.
                raise control.exception()
            value = json_return_value(outcome.value, ctx.db, ctx.max_result_size)
        except BaseException as exc:  # the body's, or a value that cannot be stored
            attempt.settle(ctx, exc)
            return
        attempt.succeed(ctx, value)
    finally:
        close_old_connections()


def own_cancellation(raised: BaseException, control: Control | None) -> BaseException:
    """What the body raised; a ``CancelledError`` that no cancel request, timeout or
    shutdown of ours sent (the job cancelled its own task, or code it called did) said
    so: its message alone was empty, or whatever the code that cancelled it wrote."""
    if not isinstance(raised, asyncio.CancelledError):
        return raised
    if control is not None and control.reason is not None:
        return raised
    said = str(raised)
    clear = asyncio.CancelledError(
        "the job's asyncio task was cancelled by the job itself or code it called, not by "
        "django-jobs (no cancel(), timeout or shutdown)" + (f": {said}" if said else "")
    )
    clear.__cause__ = raised
    return clear


def settle_and_close(job: Job, ctx: ExecutionContext, exc: Exception) -> None:
    try:
        settle_after_error(job, ctx, exc)
    finally:
        close_old_connections()


async def run_body(
    attempt: Attempt, ctx: ExecutionContext, bodies: dict[asyncio.Task[Any], Job] | None
) -> BodyOutcome:
    """The body in a task of its own under the watchdog's control; what it ended with."""
    job, control = attempt.job, attempt.control
    control_token = current_control.set(control)
    job_token = current_job_id.set(job.pk)
    try:
        if control is not None and control.reason is not None:
            # Cancelled before its body began.
            return BodyOutcome(raised=control.exception()())
        body = asyncio.get_running_loop().create_task(guarded_body(attempt, control))
        if bodies is not None:
            bodies[body] = job
        try:
            return await body
        finally:
            if bodies is not None:
                bodies.pop(body, None)
    finally:
        # The body has ended: nothing may cancel it any more.
        if control is not None and ctx.watchdog is not None:
            ctx.watchdog.forget(control)
        current_job_id.reset(job_token)
        current_control.reset(control_token)


async def guarded_body(attempt: Attempt, control: Control | None) -> BodyOutcome:
    """The task's function awaited in this task (the one a cancel or a timeout cancels),
    in the job's execution span; whatever it raises comes back as the outcome."""
    if control is not None:
        task = asyncio.current_task()
        assert task is not None  # create_task runs us in a task
        control.attach(asyncio.get_running_loop(), cast("asyncio.Task[object]", task))
    try:
        with execution_span(attempt.job):
            return BodyOutcome(value=await call_async_task(attempt))
    except BaseException as exc:  # the job's, recorded as its failure
        return BodyOutcome(raised=exc)
    finally:
        if control is not None:
            control.detach()


async def call_async_task(attempt: Attempt) -> object:
    """The task's function called as ``Task.call`` would, its coroutine awaited. What
    does not give a coroutine (a function that is not ``async def`` after all, an async
    generator) fails the job, saying what it gave."""
    task, job = attempt.task, attempt.job
    args: list[Any] = list(job.args)
    if task.takes_context:
        args.insert(0, TaskContext(task_result=attempt.result))
    made = task.func(*args, **job.kwargs)
    if inspect.isasyncgen(made):
        raise TypeError(
            f"{job.task_path} is an async generator function: a task must be a coroutine "
            "function (async def ... return), not one that yields"
        )
    if not inspect.isawaitable(made):
        raise TypeError(
            f"{job.task_path} returned {type(made).__name__}, not a coroutine: the job was "
            "taken for an async def task"
        )
    return await made
