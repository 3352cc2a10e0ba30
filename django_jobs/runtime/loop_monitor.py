"""Finding the ``async def`` job that blocks its worker's event loop.

An async job that calls ``time.sleep(5)``, a blocking client or a long computation holds
the loop: every other async job of the process stalls with it, silently. A thread of
its own (so it runs while the loop does not) posts a tick to the loop every fraction of
the threshold; a tick not run within ``threshold`` seconds means the loop is blocked.
It then logs which job's body was running (the loop's current task, which is the body's
task while a body runs), once per stall, and again when the loop runs again, with how
long it was held. The counts go into the process row's metadata (``loop_stalls``,
``loop_stalled_seconds``), which ``manage.py jobs``, the admin and the metrics read.

The heartbeat and the sync threads are not held: they are threads of their own, and a
blocked loop holds the GIL no longer than any other thread does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from django.db import close_old_connections

from django_jobs.core.batches import current_job_id
from django_jobs.models import Job, Process
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.worker")


class LoopMonitor(threading.Thread):
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        bodies: dict[asyncio.Task[Any], Job],
        threshold: float,
        db: str,
        process_id: int,
    ) -> None:
        super().__init__(name="django-jobs-loop-monitor", daemon=True)
        self.loop = loop
        self.bodies = bodies
        self.threshold = threshold
        self.db = db
        self.process_id = process_id
        self.halt = threading.Event()
        self.last_tick = time.monotonic()
        self.stalls = 0
        self.stalled_seconds = 0.0

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def run(self) -> None:
        # From now, not from when the worker built the lane: the loop starts with its
        # first async job, which may block it at once (a stall counted from the worker's
        # start was seconds too long).
        self.last_tick = time.monotonic()
        interval = max(self.threshold / 4, 0.01)
        stalled_since: float | None = None
        culprit = "no job (the worker's own code)"
        while not self.halt.wait(interval):
            try:
                self.loop.call_soon_threadsafe(self.tick)
            except RuntimeError:  # the loop has closed
                return
            now = time.monotonic()
            held = now - self.last_tick
            if stalled_since is None and held > self.threshold + interval:
                stalled_since = self.last_tick
                culprit = self.running_job()
                logger.warning(
                    "the event loop of async jobs has been blocked for %.1fs by %s: every "
                    "other async job of this process waits; do blocking work in a sync task "
                    "or through sync_to_async",
                    held,
                    culprit,
                )
            elif stalled_since is not None and held <= interval * 2:
                length = self.last_tick - stalled_since
                stalled_since = None
                self.stalls += 1
                self.stalled_seconds += length
                logger.warning(
                    "the event loop of async jobs runs again after %.1fs blocked by %s",
                    length,
                    culprit,
                )
                self.record()

    def running_job(self) -> str:
        """The job whose body holds the loop: the loop's current task, read from this
        thread (a dict lookup; the loop thread is not running Python that changes it).

        That task is the body's own, or one the body made (``asyncio.gather`` and
        ``create_task`` run coroutines in tasks of their own), which carries the job's
        id in the context it copied from the body: named as that job too, where a
        lookup of the body's task alone blamed the worker's own code."""
        task = asyncio.current_task(self.loop)
        if task is None:
            return "no job (the worker's own code)"
        job = self.bodies.get(task)
        if job is None:
            job_id = task.get_context().get(current_job_id)
            try:
                job = next((body for body in self.bodies.values() if body.pk == job_id), None)
            except RuntimeError:  # the dict changed as we read it: the loop ran again
                job = None
            if job is None and job_id is not None:
                return f"job {job_id} (a task it made, still running after the job ended)"
            if job is None:
                return "no job (the worker's own code)"
        return f"job {job.pk} ({job.task_path})"

    def record(self) -> None:
        """The counts into this process's row (merged into its metadata)."""
        try:
            row = Process.objects.using(self.db).filter(pk=self.process_id)
            metadata = row.values_list("metadata", flat=True).first()
            if not isinstance(metadata, dict):
                metadata = {}
            metadata.update(
                loop_stalls=self.stalls, loop_stalled_seconds=round(self.stalled_seconds, 3)
            )
            row.update(metadata=metadata)
        except Exception:
            # Counting must never cost the process: the log line said it already.
            logger.exception("could not record the event loop's stalls")
        finally:
            close_old_connections()

    def stop(self) -> None:
        self.halt.set()
