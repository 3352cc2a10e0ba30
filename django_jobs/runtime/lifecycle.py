"""Shutdown state shared by a process's threads, driven by POSIX signals.

First SIGTERM/SIGINT: graceful (stop taking work, finish or hand back what is
running). A second one, or SIGQUIT: immediate. SIGUSR1 is the supervisor's
request to its children, and only ever means graceful: a platform that signals
every process of the service at once (systemd's default ``KillMode``, Heroku,
a container runtime killing the process group) must not make the supervisor's
forwarded request count as the child's second SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from django_jobs.db.retry import DB_ERRORS, Backoff, reset_connection
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.runner")


class Lifecycle:
    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.immediate = threading.Event()
        self.wake = threading.Event()
        # Set with wake when jobs may have been made ready elsewhere (a notification, the
        # supervisor's check): a thread freeing up or a success written says nothing of
        # that, so those set wake alone. The worker reads it to know that a lane whose
        # last claim came back short may have jobs again (``Worker.dry``).
        self.news = threading.Event()
        self.on_immediate: Callable[[], None] | None = None
        # Set when this process found its registry row deleted (pruned as dead by
        # someone else): it stops, and ``run_jobs`` exits non-zero so that a process
        # manager starts a fresh one.
        self.pruned = False
        # SIGTERM/SIGINT received so far: the second one means "stop now".
        self.terminations = 0
        # Set by any stop signal. A worker stopping on its own to be recycled waits for
        # its running jobs without the shutdown timeout, until a signal sets this.
        self.signalled = threading.Event()
        # Why this worker process stops by itself to be replaced (None: it does not).
        self.recycling: str | None = None
        # Jobs whose body could not be interrupted: the process exits leaving their
        # claims to recovery, which must wait until it is gone (their slots with them).
        self.stuck_jobs: set[int] = set()
        # Jobs still running after the shutdown deadline's interrupt: the same, but
        # met on a stop this process was asked for, so not a reason to exit non-zero.
        self.left_running: set[int] = set()
        # Why this process cannot go on (an outcome it could not record, a thread that
        # died): it stops taking work, its claims are settled by recovery, and it exits
        # non-zero so that its supervisor or process manager replaces it.
        self.broken: str | None = None

    def jobs_may_be_ready(self) -> None:
        """Wake the worker with news: jobs may have been made ready since its last claim."""
        self.news.set()
        self.wake.set()

    def request_stop(self, reason: str = "") -> None:
        if not self.stopping.is_set():
            logger.info("shutting down gracefully%s", f" ({reason})" if reason else "")
        self.stopping.set()
        self.wake.set()

    def request_immediate(self, reason: str = "") -> None:
        logger.warning("stopping immediately%s", f" ({reason})" if reason else "")
        self.stopping.set()
        self.immediate.set()
        self.wake.set()
        if self.on_immediate is not None:
            self.on_immediate()

    def install_signal_handlers(self) -> None:
        """Deliver SIGTERM, SIGINT and SIGQUIT to a watcher thread, never to Python code
        running in the interrupted main thread.

        A Python-level signal handler runs in the main thread between two bytecodes,
        possibly while that thread holds the internal lock of one of our Events (in the
        middle of ``Event.wait``); setting that Event from the handler then deadlocks
        the process for good (seen: a second SIGTERM during the shutdown loop's
        ``immediate.wait``). So the handler does nothing; CPython's C-level handler
        writes the signal number to a pipe (``signal.set_wakeup_fd``), and a thread
        reading that pipe sets the events like any other thread.
        """
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(signum, _deliver_through_wakeup_fd)
        threading.Thread(
            target=self._watch_signals, args=(read_fd,), name="django-jobs-signals", daemon=True
        ).start()

    def _watch_signals(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            for signum in data:
                self.on_signal(signal.Signals(signum))

    def on_signal(self, signum: signal.Signals) -> None:
        """First SIGTERM/SIGINT: graceful; a second one, or SIGQUIT: immediate.

        Only SIGTERM/SIGINT count towards "second": a graceful stop the supervisor
        asked for (SIGUSR1) followed by the platform's own SIGTERM stays graceful.
        """
        self.signalled.set()
        if signum == signal.SIGQUIT:
            self.request_immediate(signum.name)
        elif signum == signal.SIGUSR1:
            self.request_stop("asked by the supervisor")
        elif signum in (signal.SIGTERM, signal.SIGINT):
            self.terminations += 1
            if self.terminations > 1:
                self.request_immediate(f"second {signum.name}")
            else:
                self.request_stop(signum.name)

    def request_recycle(self, reason: str) -> None:
        """Stop taking work and exit once the running jobs are done, to be replaced."""
        self.recycling = reason
        self.request_stop(f"recycling: {reason}")

    def request_broken(self, reason: str) -> None:
        """This process cannot go on working correctly: stop, and exit non-zero.

        Never a process that heartbeats while doing no work: its claims would be
        held by a live process, and nothing would recover them.
        """
        if self.broken is None:
            self.broken = reason
            logger.error("this process cannot go on (%s): stopping it to be replaced", reason)
        self.request_stop(reason)

    def request_abandon(self, job_id: int) -> None:
        """A job cannot be stopped: stop taking work, end the others, exit without it."""
        self.stuck_jobs.add(job_id)
        self.request_stop(f"job {job_id} cannot be interrupted")

    @property
    def leaves_claims(self) -> bool:
        """True if this process exits with claims of bodies that may still run: nobody
        may settle them (free their slots) before the process is gone."""
        return bool(self.stuck_jobs or self.left_running)

    def sleep(self, seconds: float) -> None:
        """Sleep until the timeout or a wake-up (work finished, a signal)."""
        self.wake.wait(seconds)
        self.wake.clear()


def _deliver_through_wakeup_fd(signum: int, frame: object) -> None:
    """Installed so the signal does not kill us; the watcher thread acts on it."""


def loop_until_stopped(
    db: str,
    lifecycle: Lifecycle,
    step: Callable[[], float],
    *,
    on_outage: Callable[[], None],
    max_delay: float,
    log: logging.Logger,
) -> None:
    """Run ``step`` until stopped, sleeping the seconds it returns; ride out outages.

    A step that loses the database drops the connection, lets the caller forget
    what the outage made stale (``on_outage``), and is tried again after a
    growing delay, so the dispatcher and the scheduler survive it the same way.
    """
    backoff = Backoff(max_delay)
    while not lifecycle.stopping.is_set():
        try:
            pause = step()
            backoff.reset()
        except Exception as exc:
            # An outage, a row no step foresaw (one job's data) or a bug of ours: the
            # loop goes on, backing off, rather than leave the process heartbeating with
            # no loop.
            reset_connection(db)
            delay = backoff.next()
            if isinstance(exc, DB_ERRORS):
                on_outage()
                log.warning("database unavailable (%s); retrying in %.2fs", exc, delay)
            else:
                log.exception("this step failed; trying again in %.2fs", delay)
            lifecycle.sleep(delay)
            continue
        lifecycle.sleep(pause)
