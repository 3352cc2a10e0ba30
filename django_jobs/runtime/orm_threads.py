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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async

# Seconds a call may run before its thread counts as held: an ORM call or a runtime step
# takes milliseconds, a blocking call seconds.
HELD_AFTER = 0.1


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
        return min(self.threads, key=lambda thread: (thread.held(now), thread.busy, thread.jobs))

    def for_job(self) -> JobThread:
        return JobThread(self)

    async def call[T](self, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` on the least busy thread, with the caller's context variables."""
        return await sync_to_async(func, thread_sensitive=False, executor=self.least_busy())(*args)

    def shutdown(self, *, wait: bool) -> None:
        for thread in self.threads:
            thread.shutdown(wait=wait, cancel_futures=True)
