"""A worker process's event loop: ``async def`` jobs run on it as asyncio tasks.

A job waiting on I/O then costs a coroutine (a few kilobytes), not a thread: one process
keeps ``async_jobs`` of them in flight beside its ``threads`` sync jobs, where running
them on threads took a thread (and its stack, and its share of the GIL's switches) per
waiting job. The worker's one claim loop feeds both (``Worker.capacity``); this lane only
runs what it is given and says how many more it can take.

The loop runs in a thread of its own. The synchronous steps of each job (its start, its
outcome, its ORM calls) run on one of ``orm_threads`` threads, each with its own database
connection, handed out to jobs least-busy first: the connection budget of the lane is
``orm_threads``, however many jobs are in flight (docs/running.md, "Connections").
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django_jobs.models import Job
from django_jobs.runtime.async_executor import execute_async_job
from django_jobs.runtime.context import ExecutionContext
from django_jobs.runtime.loop_monitor import LoopMonitor
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
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.serve, name="django-jobs-async", daemon=True)
        self.executors = [
            ThreadPoolExecutor(1, thread_name_prefix=f"django-jobs-async-orm-{i}")
            for i in range(orm_threads)
        ]
        # Jobs on each ORM thread (read and written on the loop only).
        self.load = [0] * orm_threads
        self.lock = threading.Lock()
        self.in_flight = 0
        self.closing = False
        # The body task of each job running, for the monitor to name the one that blocks.
        self.bodies: dict[asyncio.Task[Any], Job] = {}
        self.monitor = (
            LoopMonitor(self.loop, self.bodies, block_threshold, ctx.db, ctx.process_id)
            if block_threshold
            else None
        )

    def start(self) -> None:
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

    def free(self) -> int:
        """How many more async jobs this lane takes now."""
        with self.lock:
            return self.slots - self.in_flight

    def submit(self, job: Job, started: bool, done: Any) -> None:
        """Run ``job`` on the loop; ``done()`` is called (on the loop) once its outcome is
        recorded or handed to the completer."""
        with self.lock:
            self.in_flight += 1
        asyncio.run_coroutine_threadsafe(self.run(job, started, done), self.loop)

    async def run(self, job: Job, started: bool, done: Any) -> None:
        orm = min(range(len(self.load)), key=self.load.__getitem__)
        self.load[orm] += 1
        try:
            await execute_async_job(
                job, self.ctx, self.executors[orm], started=started, bodies=self.bodies
            )
        finally:
            self.load[orm] -= 1
            with self.lock:
                self.in_flight -= 1
            done()

    def stop(self, *, wait: bool) -> None:
        """End the loop, its monitor and its ORM threads. ``wait``: let the ORM threads end
        their call first (never, at a stop-now or with bodies left running: the process
        exits without them, as with sync threads)."""
        if self.monitor is not None:
            self.monitor.stop()
        self.closing = True
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass
        if wait:
            self.thread.join(5.0)
        for executor in self.executors:
            executor.shutdown(wait=wait, cancel_futures=True)
