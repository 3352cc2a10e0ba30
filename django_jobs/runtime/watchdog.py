"""Stopping running jobs: timeouts and cancel requests, cooperative first, then forced.

Each running job registers a :class:`Control` for its thread. One watchdog
thread per worker process:

- marks a job whose attempt has run past its ``timeout`` as timed out, and checks
  the database for cancel requests (``Job.cancel_requested_at``) of the jobs it
  runs: every ``cancel_poll_interval`` seconds (a setting, 1 by default), and at
  once when the process's LISTEN connection hears that one was made (PostgreSQL:
  ``notify.cancel_requested`` sends it after the request commits,
  ``runtime.listener`` hands it to :func:`cancel_notified`). The notification is
  only a hint to look now: the request itself is the column, so the poll finds
  it if the notification is lost, and recovery if the worker dies;
- lets the task see it (``django_jobs.cancel_requested()``, which reads the ``requested``
  event of the job's :class:`Control` through ``core.current_job``), then raises
  :class:`~django_jobs.exceptions.JobTimeout` at once, or
  :class:`~django_jobs.exceptions.JobCancelled` after ``interrupt_grace``
  seconds, inside the job's thread (``PyThreadState_SetAsyncExc``: delivered at
  the thread's next Python bytecode, the way Dramatiq's time limits work);
- for an ``async def`` task, cancels its asyncio task instead, at once for a
  cancel as for a timeout (``task.cancel()`` through the loop's
  ``call_soon_threadsafe``): the body runs in an event loop of another thread
  (``async_to_sync``), where an exception raised in the job's thread would never
  land, and ``CancelledError`` is asyncio's own cooperative stop: the task may
  catch it to clean up;
- if the body still runs ``interrupt_grace`` seconds later (blocked in C code,
  which no Python exception reaches, or an async task that swallowed its
  ``CancelledError``), declares it stuck: the worker stops claiming, lets its
  other jobs end, and exits without settling the stuck job's claim. Its slot is
  freed by recovery once the process is gone, never while the body may still
  run (docs/design.md invariant 9, seed 000).

The worker's shutdown deadline goes through the same :class:`Control`
(:meth:`Watchdog.interrupt_at_shutdown`): ``WorkerShutdown`` raised in a sync
body's thread, the asyncio task of an ``async def`` one cancelled. What becomes
of a body that does not end then is the worker's to decide (it leaves the claim
behind as it exits), not the watchdog's stuck path.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from django.db import close_old_connections

from django_jobs.conf import JobsSettings
from django_jobs.db.retry import DB_ERRORS, reset_connection
from django_jobs.exceptions import JobCancelled, JobInterrupted, JobTimeout, WorkerShutdown
from django_jobs.models import Job
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.worker")

TICK = 0.05
# Seconds a notified cancel of a job this process has claimed but not yet started is
# remembered: the job's row was read at the claim, before the request, so its start
# must look again (the poll would, but only at its next turn).
NOTIFIED_KEEP = 60.0

CANCELLED, TIMED_OUT = "cancelled", "timed out"
# Not a request the task is asked to honour (``cancel_requested()`` stays False): its
# worker's shutdown timeout is over, so the body is interrupted at once.
SHUTDOWN = "interrupted at the shutdown deadline"


@dataclass(eq=False)
class Control:
    """One running attempt, as the watchdog and the task itself see it."""

    job_id: int
    thread_id: int
    started: float
    timeout: float | None
    reason: str | None = None  # CANCELLED, TIMED_OUT or SHUTDOWN, once decided
    reason_at: float = 0.0
    fired_at: float | None = None
    done: bool = False
    requested: threading.Event = field(default_factory=threading.Event)
    # An ``async def`` body: stopped by cancelling its asyncio task, never by an
    # exception raised in ``thread_id`` (which only waits for the event loop).
    asynchronous: bool = False
    # The watchdog's lock: whoever reads or writes ``fired_at``, ``loop`` and ``task``
    # holds it, so a cancel decided as the body begins is neither lost nor sent twice.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[object] | None = None
    # The worker's shutdown_timeout, once the deadline interrupted this body: its
    # error message says how long the worker waited.
    shutdown_timeout: float | None = None

    def stop(self, reason: str, now: float) -> None:
        # A cancel request outranks a timeout: a cancelled job is never retried.
        if self.reason is None or (reason == CANCELLED and self.fired_at is None):
            self.reason, self.reason_at = reason, now
            self.requested.set()

    @property
    def cancelled(self) -> bool:
        return self.reason == CANCELLED

    def exception(self) -> type[JobInterrupted]:
        if self.cancelled:
            return JobCancelled
        return WorkerShutdown if self.reason == SHUTDOWN else JobTimeout

    def attach(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[object]) -> None:
        """The async body begins in ``task`` on ``loop`` (called there): cancellable from
        now on, and cancelled at once if the watchdog has already decided to."""
        with self.lock:
            self.loop, self.task = loop, task
            if self.fired_at is not None:
                self.cancel_task()

    def detach(self) -> None:
        """The async body has ended: there is no task to cancel any more."""
        with self.lock:
            self.loop = self.task = None

    def fire(self, exception: type[BaseException], now: float) -> None:
        """Interrupt the body, the lock held: raise ``exception`` in its thread, or
        cancel its asyncio task (now, or as it begins) if it is an ``async def``."""
        self.fired_at = now
        if self.asynchronous:
            self.cancel_task()
        else:
            raise_in_thread(self.thread_id, exception)

    def cancel_task(self) -> None:
        """Cancel the body's asyncio task, from any thread (the lock held)."""
        if self.loop is None or self.task is None:
            return  # not begun yet (attach does it) or already over
        message = f"django-jobs: job {self.job_id} {self.reason or 'interrupted'}"
        try:
            self.loop.call_soon_threadsafe(self.task.cancel, message)
        except RuntimeError:  # the loop has closed: the body is over
            pass


def raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> int:
    """Schedule ``exception`` in the thread (None clears a scheduled one)."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception else None
    )


# The watchdogs running in this process, for the listener's notifications.
_active_lock = threading.Lock()
_active: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def cancel_notified(job_ids: Collection[int] | None) -> None:
    """A notification said ``job_ids`` (None: some jobs, unnamed) were asked to stop:
    every watchdog of this process that runs one of them checks the database now."""
    with _active_lock:
        watchdogs = list(_active)
    for watchdog in watchdogs:
        watchdog.notified(job_ids)


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads (and maybe a copy of a held lock)."""
    global _active_lock, _active
    _active_lock = threading.Lock()
    _active = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget_after_fork)


class Watchdog:
    def __init__(
        self,
        db: str,
        grace: float,
        on_stuck: Callable[[int], None],
        *,
        poll_interval: float = JobsSettings.cancel_poll_interval,
    ) -> None:
        self.db = db
        self.grace = grace
        # Seconds between two checks for cancel requests when no notification comes
        # (MariaDB, SQLite, LISTEN off or lost): the ``cancel_poll_interval`` setting.
        self.poll_interval = poll_interval
        self.on_stuck = on_stuck
        self.lock = threading.Lock()
        self.controls: dict[int, Control] = {}
        self.stuck: set[int] = set()
        self.halt = threading.Event()
        # No check as it starts (no job runs yet; one claimed in the meantime brings
        # a request made before its claim with its row, see watch()): one interval on.
        self.next_poll = time.monotonic() + poll_interval
        # Set by a notification about a job we run: check before the next poll is due.
        self.check_now = False
        self.woken = threading.Event()
        # Notified job id -> when, for jobs not (yet) started here.
        self.notified_early: dict[int, float] = {}
        self.thread = threading.Thread(target=self.run, name="django-jobs-watchdog", daemon=True)

    def start(self) -> None:
        with _active_lock:
            _active.add(self)
        self.thread.start()

    def stop(self) -> None:
        with _active_lock:
            _active.discard(self)
        self.halt.set()
        self.woken.set()

    def watch(self, job: Job, *, asynchronous: bool = False) -> Control:
        """Register the calling thread's attempt at ``job`` (before its body runs);
        ``asynchronous`` for an ``async def`` task."""
        now = time.monotonic()
        control = Control(
            job.pk,
            threading.get_ident(),
            now,
            job.timeout,
            asynchronous=asynchronous,
            lock=self.lock,
        )
        if job.cancel_requested_at is not None:
            control.stop(CANCELLED, now)
        with self.lock:
            self.controls[job.pk] = control
            if self.notified_early.pop(job.pk, None) is not None:
                self.check_now = True
                self.woken.set()
        return control

    def notified(self, job_ids: Collection[int] | None) -> None:
        """Check the database at once if a cancel was notified for a job we run."""
        now = time.monotonic()
        with self.lock:
            if job_ids is None:
                self.check_now = True
            else:
                for job_id in job_ids:
                    if job_id in self.controls:
                        self.check_now = True
                    else:
                        self.notified_early[job_id] = now
                for job_id, at in list(self.notified_early.items()):
                    if now - at > NOTIFIED_KEEP:
                        del self.notified_early[job_id]
            if self.check_now:
                self.woken.set()

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

    def interrupt_at_shutdown(self, job_ids: Iterable[int], timeout: float) -> list[int]:
        """Interrupt the bodies of ``job_ids`` still running at the worker's shutdown
        deadline, ``timeout`` seconds after its stop began; returns the ids interrupted.

        Under the lock the watchdog fires under, and through :meth:`Control.fire`:
        a sync body gets ``WorkerShutdown`` raised in its thread, and one that
        returns at this very instant withdraws it in :meth:`forget`; an ``async
        def`` body has its asyncio task cancelled (an exception raised in its
        thread, which only waits for the event loop, would land when the body
        returns, turning a success into a failure). A body already interrupted
        (timeout, cancel) is left as it is; one cancelled but still in its grace
        is interrupted now and stays cancelled (never retried). A job whose body
        has not begun or has ended has no control and needs nothing.
        """
        now = time.monotonic()
        interrupted = []
        with self.lock:
            for job_id in job_ids:
                control = self.controls.get(job_id)
                if control is None or control.done or control.fired_at is not None:
                    continue
                if control.reason is None:
                    control.reason, control.reason_at = SHUTDOWN, now
                    control.shutdown_timeout = timeout
                control.fire(control.exception(), now)
                interrupted.append(job_id)
        return interrupted

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                self.woken.wait(TICK)
                self.woken.clear()
                if self.halt.is_set():
                    break
                try:
                    self.tick(time.monotonic())
                except Exception:
                    # Without this thread no timeout or cancel is enforced again: log,
                    # drop the connection whatever state it is in, go on at the next tick.
                    logger.exception("the watchdog's check failed; going on")
                    reset_connection(self.db)
        finally:
            close_old_connections()

    def tick(self, now: float) -> None:
        with self.lock:
            # Cleared before the query: a notification during it asks for another.
            check_now, self.check_now = self.check_now, False
        if check_now or now >= self.next_poll:
            self.next_poll = now + self.poll_interval
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
            if control.asynchronous:
                # asyncio's cancellation is cooperative already (the task may catch
                # CancelledError to clean up), so no grace before it: awaits end now.
                control.fire(control.exception(), now)
                logger.warning(
                    "job %s %s: cancelling its asyncio task", control.job_id, control.reason
                )
            # A timeout is already past its grace: it is the limit. A cancel gives the
            # task a grace period to notice cancel_requested() and stop by itself.
            elif control.reason == TIMED_OUT or now - control.reason_at >= self.grace:
                control.fire(control.exception(), now)
                logger.warning("job %s %s: interrupting its thread", control.job_id, control.reason)
        elif (
            now - control.fired_at >= self.grace
            and control.reason != SHUTDOWN  # the stopping worker leaves it behind itself
            and control.job_id not in self.stuck
        ):
            self.stuck.add(control.job_id)
            logger.error(
                "job %s %s but still running %.1fs after %s: this worker process stops "
                "claiming and exits, leaving the job to recovery once it is gone",
                control.job_id,
                control.reason,
                now - control.fired_at,
                "its asyncio task was cancelled (CancelledError ignored, or a synchronous "
                "call that has not returned?)"
                if control.asynchronous
                else "being interrupted (blocked outside Python?)",
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
