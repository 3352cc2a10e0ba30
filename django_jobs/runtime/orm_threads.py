"""The threads that run the synchronous side of a worker's ``async def`` jobs.

A few threads, each with its own database connection, serve hundreds of jobs on the
event loop: the runtime's steps around each body (its start, its outcome) and the
job's own thread-sensitive calls (its ``sync_to_async``, Django's async ORM).

Two rules keep one job's slow call from holding the others up:

- the runtime's steps go to whichever thread is least busy at that instant (calls
  queued or running), never to a thread of the job's;
- a job's own calls stay on one thread (Django's async iteration reads a server-side
  cursor across calls, and a connection's session state is per thread), chosen at its
  first such call, the least busy then.

Pinned for the job's whole run at its start instead, every job that shared a thread with
one blocked in ``sync_to_async(time.sleep)(5)`` (the advice of the loop monitor's log
line) waited with it, to start and to record its outcome: 200 quick jobs took 4.6 s at
their 90th percentile instead of 0.45 s (PostgreSQL, one worker, 4 threads).

The runtime's steps travel in batches (:class:`RuntimeSteps`): the jobs of one claim start
in one turn of the loop, and their bodies, which began together, mostly end together, so
the steps asked for in one turn go to a thread as one call and come back as one callback.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async

# What sync_to_async does with the caller's context on both sides of the thread switch:
# every variable the call changed set again, asgiref's Local storage moved to the thread
# it is now on. Private to asgiref, used as sync_to_async uses it, so that a step sees and
# leaves the context exactly as one sent through sync_to_async did. An asgiref without it
# (a later version may rename it) gets each step sent through sync_to_async itself, one by
# one, as before the batches: slower, the same outcome.
try:
    from asgiref.sync import _restore_context
except ImportError:  # pragma: no cover (asgiref 3.13 has it)
    _restore_context = None  # type: ignore[assignment]

# Seconds a call may run before its thread counts as held: an ORM call or a runtime step
# takes milliseconds, a blocking call seconds.
HELD_AFTER = 0.1
# Seconds after which a running call makes its thread the last choice among those not held.
SLOWING_AFTER = 0.01


class OrmThread(ThreadPoolExecutor):
    """One thread for async jobs' synchronous calls, counting the calls it has queued or
    running (``busy``) and the jobs whose own calls it runs (``jobs``), and since when
    its current call has run (``since``)."""

    def __init__(self, name: str) -> None:
        super().__init__(1, thread_name_prefix=name)
        self.counts = threading.Lock()
        self.busy = 0
        self.jobs = 0
        self.since: float | None = None

    def held(self, now: float) -> bool:
        """Its current call has run for longer than an ORM call takes."""
        since = self.since
        return since is not None and now - since > HELD_AFTER

    def slowing(self, now: float) -> bool:
        """Its current call has run for longer than a quick ORM call: not held yet, but
        the thread to pass over while another is free of such a call. Without it, the
        jobs whose first call came in the first ``HELD_AFTER`` of another job's blocking
        call could pick its thread by queue length and wait out the whole block (1 run in
        2 of tests/test_async_runtime.py's held thread on MariaDB, once starts came in
        batches and so sooner)."""
        since = self.since
        return since is not None and now - since > SLOWING_AFTER

    def submit[T](self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self.counts:
            self.busy += 1
        try:
            future = super().submit(self.timed, fn, *args, **kwargs)
        except BaseException:
            self.one_done(None)
            raise
        future.add_done_callback(self.one_done)
        return future

    def one_done(self, _future: object) -> None:
        with self.counts:
            self.busy -= 1

    def timed[T](self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        self.since = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.since = None

    def run_steps(self, steps: list[Step], loop: asyncio.AbstractEventLoop) -> None:
        """Each step in its own context, timed on its own (a batch of quick steps is not a
        held thread), whatever it raises kept for its caller; then every outcome handed back
        to the loop in one callback."""
        for step in steps:
            self.since = time.monotonic()
            try:
                step.value = step.context.run(step.run)
            except BaseException as exc:  # the caller's to see, as if it had called it
                step.raised = exc
        self.since = None
        try:
            loop.call_soon_threadsafe(settle_steps, steps)
        except RuntimeError:  # the loop has closed: the process is going
            pass


class JobThread(Executor):
    """A job's thread-sensitive calls, all on one :class:`OrmThread`: the least busy at
    the first call (a job that makes none takes none). The executor a job's
    ``ThreadSensitiveContext`` is given; called on the event loop's thread only."""

    def __init__(self, threads: OrmThreads) -> None:
        self.threads = threads
        self.thread: OrmThread | None = None

    def submit[T](self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self.thread is None:
            self.thread = self.threads.least_busy()
            with self.thread.counts:
                self.thread.jobs += 1
        return self.thread.submit(fn, *args, **kwargs)

    def release(self) -> None:
        """The job has ended: its thread is one job lighter."""
        if self.thread is not None:
            with self.thread.counts:
                self.thread.jobs -= 1
            self.thread = None


class OrmThreads:
    def __init__(self, count: int) -> None:
        self.threads = [OrmThread(f"django-jobs-async-orm-{i}") for i in range(count)]

    def least_busy(self) -> OrmThread:
        """One not held by a slow call, then the fewest calls queued or running, then the
        fewest jobs. Queue lengths alone do not see a held thread: a burst of starts
        fills every queue evenly, the held one's too."""
        now = time.monotonic()
        return min(
            self.threads,
            key=lambda thread: (thread.held(now), thread.slowing(now), thread.busy, thread.jobs),
        )

    def for_job(self) -> JobThread:
        return JobThread(self)

    def shutdown(self, *, wait: bool) -> None:
        for thread in self.threads:
            thread.shutdown(wait=wait, cancel_futures=True)


class Step:
    """One runtime step of one job: the call, the context it runs in, its outcome."""

    __slots__ = ("args", "context", "func", "future", "raised", "value")

    def __init__(
        self, func: Callable[..., Any], args: tuple[Any, ...], future: asyncio.Future[Any]
    ) -> None:
        self.func = func
        self.args = args
        # The caller's context variables, as ``sync_to_async`` would give them: a copy, so
        # the thread never enters a context the loop may enter meanwhile.
        self.context = contextvars.copy_context()
        self.future = future
        self.value: Any = None
        self.raised: BaseException | None = None

    def run(self) -> Any:
        """In the copied context, on the ORM thread: asgiref's ``Local`` values of the
        caller moved to this thread first, as ``sync_to_async`` moves them (left tagged
        with the caller's thread, they were invisible here: Django's task backends, kept
        in one, were built anew at every step)."""
        _restore_context(self.context)
        return self.func(*self.args)


def settle_steps(steps: list[Step]) -> None:
    """On the loop: each step's caller gets its outcome (unless it stopped waiting). A
    ``StopIteration`` (a signal receiver's, say), which an asyncio future refuses, comes
    as a ``RuntimeError`` caused by it: refused, it would leave the batch's other callers
    waiting forever."""
    for step in steps:
        if step.future.done():
            continue
        raised = step.raised
        if raised is None:
            step.future.set_result(step.value)
            continue
        if isinstance(raised, StopIteration):
            wrapped = RuntimeError(f"a runtime step raised {raised!r}")
            wrapped.__cause__ = raised
            raised = wrapped
        step.future.set_exception(raised)


class RuntimeSteps:
    """The steps around async jobs' bodies (start, outcome), sent to the ORM threads in
    batches: those asked for in one turn of the loop go together, at most ``BATCH`` to a
    thread, each batch to the least busy thread at that instant.

    One call and one callback per batch, where ``sync_to_async`` made a thread pool call,
    an asyncio future wrapping it, a shield, and a wake-up of the loop through its
    self-pipe per step: 0.15 of the loop's 0.23 ms per job went there, and each step's
    wake-up was a system call. The steps of a batch run one after the other on one
    thread, as they did when several were queued on it.
    """

    # Steps per batch: enough to take a claim's jobs in a few calls, few enough that the
    # batches of one turn spread over the threads when the steps wait on the database.
    BATCH = 32

    def __init__(self, threads: OrmThreads, loop: asyncio.AbstractEventLoop) -> None:
        self.threads = threads
        self.loop = loop
        self.pending: list[Step] = []

    async def call[T](self, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` on an ORM thread, with the caller's context variables; those it
        sets are set in the caller's context once it returns, as ``sync_to_async`` sets
        them (the executor's ``mark_not_run`` is read there by the tracing hooks)."""
        if _restore_context is None:
            executor = self.threads.least_busy()
            return await sync_to_async(func, thread_sensitive=False, executor=executor)(*args)
        step = Step(func, args, self.loop.create_future())
        if not self.pending:
            self.loop.call_soon(self.send)
        self.pending.append(step)
        try:
            return await step.future
        finally:
            # Not when the caller stopped waiting: the thread may be running in it.
            if not step.future.cancelled():
                _restore_context(step.context)

    def send(self) -> None:
        steps, self.pending = self.pending, []
        for start in range(0, len(steps), self.BATCH):
            batch = steps[start : start + self.BATCH]
            thread = self.threads.least_busy()
            try:
                thread.submit(thread.run_steps, batch, self.loop)
            except RuntimeError as exc:  # shut down: the process is going
                for step in batch:
                    step.raised = exc
                settle_steps(batch)
