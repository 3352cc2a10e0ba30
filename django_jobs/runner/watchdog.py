"""Stopping running jobs: timeouts and cancel requests, cooperative first, then forced.

Each running job registers a :class:`Control` for its thread. One watchdog
thread per worker process:

- marks a job whose attempt has run past its ``timeout`` as timed out, and polls
  the database every ``CANCEL_POLL_INTERVAL`` seconds for cancel requests
  (``Job.cancel_requested_at``) of the jobs it runs;
- lets the task see it (``django_jobs.cancel_requested()``), then raises
  :class:`~django_jobs.exceptions.JobTimeout` at once, or
  :class:`~django_jobs.exceptions.JobCancelled` after ``interrupt_grace``
  seconds, inside the job's thread (``PyThreadState_SetAsyncExc``: delivered at
  the thread's next Python bytecode, the way Dramatiq's time limits work);
- if the body still runs ``interrupt_grace`` seconds later (blocked in C code,
  which no Python exception reaches), declares it stuck: the worker stops
  claiming, lets its other jobs end, and exits without settling the stuck job's
  claim. Its slot is freed by recovery once the process is gone, never while
  the body may still run (DESIGN.md invariant 9, seed 000).
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import close_old_connections

from ..exceptions import JobCancelled, JobInterrupted, JobTimeout
from ..models import Job
from .db_retry import DB_ERRORS, reset_connection

logger = logging.getLogger("django_jobs.worker")

CANCEL_POLL_INTERVAL = 1.0
TICK = 0.05

CANCELLED, TIMED_OUT = "cancelled", "timed out"


@dataclass(eq=False)
class Control:
    """One running attempt, as the watchdog and the task itself see it."""

    job_id: int
    thread_id: int
    started: float
    timeout: float | None
    reason: str | None = None  # CANCELLED or TIMED_OUT, once decided
    reason_at: float = 0.0
    fired_at: float | None = None
    done: bool = False
    requested: threading.Event = field(default_factory=threading.Event)

    def stop(self, reason: str, now: float) -> None:
        # A cancel request outranks a timeout: a cancelled job is never retried.
        if self.reason is None or (reason == CANCELLED and self.fired_at is None):
            self.reason, self.reason_at = reason, now
            self.requested.set()

    @property
    def cancelled(self) -> bool:
        return self.reason == CANCELLED

    def exception(self) -> type[JobInterrupted]:
        return JobCancelled if self.cancelled else JobTimeout


current_control: contextvars.ContextVar[Control | None] = contextvars.ContextVar(
    "django_jobs_current_control", default=None
)


def cancel_requested() -> bool:
    """True inside a running job once it has been cancelled or has timed out.

    A task that checks it between steps can stop cleanly (return or raise)
    before it is interrupted by force. Outside a job it is always False.
    """
    control = current_control.get()
    return control is not None and control.requested.is_set()


def raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> int:
    """Schedule ``exception`` in the thread (None clears a scheduled one)."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception else None
    )


class Watchdog:
    def __init__(self, db: str, grace: float, on_stuck: Callable[[int], None]) -> None:
        self.db = db
        self.grace = grace
        self.on_stuck = on_stuck
        self.lock = threading.Lock()
        self.controls: dict[int, Control] = {}
        self.stuck: set[int] = set()
        self.halt = threading.Event()
        self.next_poll = 0.0
        self.thread = threading.Thread(target=self.run, name="django-jobs-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()

    def watch(self, job: Job) -> Control:
        """Register the calling thread's attempt at ``job`` (before its body runs)."""
        now = time.monotonic()
        control = Control(job.pk, threading.get_ident(), now, job.timeout)
        if job.cancel_requested_at is not None:
            control.stop(CANCELLED, now)
        with self.lock:
            self.controls[job.pk] = control
        return control

    def forget(self, control: Control) -> None:
        """The body has ended: never interrupt this thread for it again. Idempotent.

        Called by the job's own thread. An exception scheduled an instant before
        the body returned, and not delivered yet, is withdrawn here, under the lock
        the watchdog fires under, so it cannot land in the worker's own code.
        """
        with self.lock:
            if control.done:
                return
            control.done = True
            self.controls.pop(control.job_id, None)
            if control.fired_at is not None:
                raise_in_thread(control.thread_id, None)

    def run(self) -> None:
        try:
            while not self.halt.wait(TICK):
                self.tick(time.monotonic())
        finally:
            close_old_connections()

    def tick(self, now: float) -> None:
        if now >= self.next_poll:
            self.next_poll = now + CANCEL_POLL_INTERVAL
            self.poll_cancel_requests(now)
        with self.lock:
            for control in list(self.controls.values()):
                self.enforce(control, now)

    def enforce(self, control: Control, now: float) -> None:
        if control.timeout is not None and now - control.started >= control.timeout:
            control.stop(TIMED_OUT, now)
        if control.reason is None:
            return
        if control.fired_at is None:
            # A timeout is already past its grace: it is the limit. A cancel gives the
            # task a grace period to notice cancel_requested() and stop by itself.
            if control.reason == TIMED_OUT or now - control.reason_at >= self.grace:
                control.fired_at = now
                raise_in_thread(control.thread_id, control.exception())
                logger.warning("job %s %s: interrupting its thread", control.job_id, control.reason)
        elif now - control.fired_at >= self.grace and control.job_id not in self.stuck:
            self.stuck.add(control.job_id)
            logger.error(
                "job %s %s but still running %.1fs after being interrupted (blocked outside "
                "Python?): this worker process stops claiming and exits, leaving the job "
                "to recovery once it is gone",
                control.job_id,
                control.reason,
                now - control.fired_at,
            )
            self.on_stuck(control.job_id)

    def poll_cancel_requests(self, now: float) -> None:
        with self.lock:
            ids = [pk for pk, control in self.controls.items() if not control.cancelled]
        if not ids:
            return
        try:
            requested = set(
                Job.objects.using(self.db)
                .filter(pk__in=ids, cancel_requested_at__isnull=False)
                .values_list("pk", flat=True)
            )
        except DB_ERRORS:
            reset_connection(self.db)
            return
        with self.lock:
            for job_id in requested:
                control = self.controls.get(job_id)
                if control is not None and not control.done:
                    control.stop(CANCELLED, now)
                    logger.info("job %s: cancel requested", job_id)
