"""A worker process's event loop: ``async def`` jobs run on it as asyncio tasks.

A job waiting on I/O then costs a coroutine (a few kilobytes), not a thread: one process
keeps ``async_jobs`` of them in flight beside its ``threads`` sync jobs, where running
them on threads took a thread (and its stack, and its share of the GIL's switches) per
waiting job. The worker's one claim loop feeds both (``Worker.capacity``); this lane only
runs what it is given and says how many more it can take.

The loop runs in a thread of its own. The synchronous steps of each job (its start, its
outcome, its ORM calls) run on ``orm_threads`` threads, each with its own database
connection (``runtime/orm_threads.py``: a job's own calls on one of them, the steps
around its body on the least busy): the connection budget of the lane is
``orm_threads``, however many jobs are in flight (docs/running.md, "Connections"). A
job's ``sync_to_async(thread_sensitive=False)`` calls run on the loop's default
executor, whose calls close the connections they open (:class:`ClosingPool`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.db import connections

from django_jobs.models import Job
from django_jobs.runtime.async_executor import execute_async_job
from django_jobs.runtime.context import ExecutionContext
from django_jobs.runtime.loop_monitor import LoopMonitor
from django_jobs.runtime.orm_threads import OrmThreads, RuntimeSteps
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.worker")


class AsyncLane:
    """The event loop of one worker process, its ORM threads and its loop monitor."""

    def __init__(
        self,
        ctx: ExecutionContext,
        slots: int,
        orm_threads: int,
        *,
        block_threshold: float | None,
    ) -> None:
        self.ctx = ctx
        self.slots = slots
        self.orm_threads = orm_threads
        self.block_threshold = block_threshold
        self.lock = threading.Lock()
        self.started = False
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        # The body task of each job running, for the monitor to name the one that blocks.
        self.bodies: dict[asyncio.Task[Any], Job] = {}
        # Built by start(), with the first async job.
        self.loop: asyncio.AbstractEventLoop
        self.stop_loop: Callable[[], None]
        self.thread: threading.Thread
        self.orm: OrmThreads
        self.steps: RuntimeSteps
        self.pool: ClosingPool
        self.monitor: LoopMonitor | None = None

    def start(self) -> None:
        """Build and start the loop, its threads and its monitor, once, with the first
        async job: a process that never runs one costs what it did before the lane (built
        with the process, the lane made each sync worker 2.6 MB larger (PSS, MariaDB), and
        its two threads woke 8 times a second each)."""
        with self.lock:
            if self.started:
                return
            self.started = True
        self.loop = asyncio.new_event_loop()
        # A job may not stop the loop every async job of the process runs on: its call
        # raises in the job (docs/tasks.md, "Async jobs").
        self.stop_loop = self.loop.stop
        setattr(self.loop, "stop", self.refuse_stop_from_tasks)  # noqa: B010 (a method)
        self.thread = threading.Thread(target=self.serve, name="django-jobs-async", daemon=True)
        self.orm = OrmThreads(self.orm_threads)
        self.steps = RuntimeSteps(self.orm, self.loop)
        # The loop's default executor: ``sync_to_async(thread_sensitive=False)`` and
        # ``run_in_executor(None, ...)`` of the jobs.
        self.pool = ClosingPool(thread_name_prefix="django-jobs-async-pool")
        self.loop.set_default_executor(self.pool)
        if self.block_threshold:
            self.monitor = LoopMonitor(
                self.loop, self.bodies, self.block_threshold, self.ctx.db, self.ctx.process_id
            )
        self.thread.start()
        if self.monitor is not None:
            self.monitor.start()

    def serve(self) -> None:
        """Run the loop until :meth:`stop`. A job that stops the loop (``loop.stop()``)
        only makes ``run_forever`` return: it is started again, the jobs on it go on."""
        asyncio.set_event_loop(self.loop)
        while True:
            self.loop.run_forever()
            if self.closing:
                break
            logger.warning("a job stopped the event loop of async jobs; it runs again")

    def refuse_stop_from_tasks(self) -> None:
        """``loop.stop()``, refused inside a task (a job's body, or a task it made), let
        through from a callback (this lane's own :meth:`stop`, asyncio's internals).

        A job that stopped the loop would hold up every other async job of the process
        until :meth:`serve` ran it again, and it would succeed as if nothing had
        happened; now its call raises, and the job fails saying why."""
        if asyncio.current_task(self.loop) is not None:
            raise RuntimeError(
                "a job must not stop the event loop of async jobs: it runs every async job "
                "of this worker process"
            )
        self.stop_loop()

    def free(self) -> int:
        """How many more async jobs this lane takes now."""
        with self.lock:
            return self.slots - self.in_flight

    def submit(self, jobs: list[tuple[Job, bool, Callable[[], None]]]) -> None:
        """Run each ``(job, started, done)`` on the loop; ``done()`` is called (on the loop)
        once its outcome is recorded or handed to the completer. One wake-up of the loop
        for a claim's jobs, where one each was a write to the loop's self-pipe and a turn
        of the loop to read it."""
        if not jobs:
            return
        self.start()
        with self.lock:
            self.in_flight += len(jobs)
        try:
            self.loop.call_soon_threadsafe(self.start_jobs, jobs)
        except BaseException:
            with self.lock:
                self.in_flight -= len(jobs)
            raise

    def start_jobs(self, jobs: list[tuple[Job, bool, Callable[[], None]]]) -> None:
        """On the loop: a task per job, held until it ends (the loop keeps only weak
        references to its tasks)."""
        for job, started, done in jobs:
            task = self.loop.create_task(self.run(job, started, done))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def run(self, job: Job, started: bool, done: Any) -> None:
        try:
            await execute_async_job(job, self.ctx, self.steps, started=started, bodies=self.bodies)
        finally:
            with self.lock:
                self.in_flight -= 1
            done()

    def stop(self, *, wait: bool) -> None:
        """End the loop, its monitor and its ORM threads. ``wait``: let the ORM threads end
        their call first (never, at a stop-now or with bodies left running: the process
        exits without them, as with sync threads)."""
        if not self.started:
            return
        if self.monitor is not None:
            self.monitor.stop()
        self.closing = True
        try:
            self.loop.call_soon_threadsafe(self.stop_loop)
        except RuntimeError:  # already closed
            pass
        if wait:
            self.thread.join(5.0)
        self.orm.shutdown(wait=wait)
        self.pool.shutdown(wait=wait, cancel_futures=True)


class ClosingPool(ThreadPoolExecutor):
    """A thread pool whose every call closes the database connections it opened.

    asyncio's own default executor keeps up to ``min(32, CPUs + 4)`` threads, and each one
    that ran a query for a job (``sync_to_async(thread_sensitive=False)``) kept its
    connection open for ``CONN_MAX_AGE``, idle, as long as the process lived: 6 more
    connections on 2 CPUs, 32 on a large machine, beyond the lane's budget of
    ``async_orm_threads`` (tests/test_async_runtime.py). Closed after each call, such a
    connection lives only while its query runs; the ORM belongs on the job's ORM thread
    (``thread_sensitive=True``, the default), where connections are reused."""

    def submit[T](self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(closing_connections, fn, *args, **kwargs)


def closing_connections[T](fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        connections.close_all()
