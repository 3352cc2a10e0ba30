"""Visible output for ``run_jobs`` when the project has not configured our loggers."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from typing import TextIO

from django.conf import settings

LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}
FORK_WAIT = 1.0  # seconds a fork waits for a log writer that is inside a write


class WithoutDjangosTaskEvents(logging.Filter):
    """Drops ``django.tasks``' own "Task id=… state=…" lines for starts and successes.

    Django logs every task start and finish from its signal receivers; a worker
    of ours logs the same event with more in it (attempt, duration, error,
    retry), so each event showed twice. Failures (ERROR) stay: Django's default
    LOGGING mails them to ADMINS, and a project may rely on that.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.funcName not in (
            "log_task_started",
            "log_task_finished",
        )


def quiet_djangos_task_events() -> None:
    """In worker processes only, unless the project's LOGGING configures ``django.tasks``."""
    configured = (getattr(settings, "LOGGING", None) or {}).get("loggers", {})
    tasks_logger = logging.getLogger("django.tasks")
    if "django.tasks" in configured:
        return
    if not any(isinstance(f, WithoutDjangosTaskEvents) for f in tasks_logger.filters):
        tasks_logger.addFilter(WithoutDjangosTaskEvents())
    if tasks_logger.level == logging.NOTSET:
        # The filter runs once a record is made (the caller's frame found, the message
        # kept): two records per job that are dropped, 15% of a no-op job's CPU in a
        # worker. Below WARNING nothing of django.tasks' would pass anyway (its
        # enqueue line is DEBUG), so none is made; its failures (ERROR) still are.
        tasks_logger.setLevel(logging.WARNING)


def configure_logging(verbosity: int) -> None:
    """Attach a stream handler to ``django_jobs`` unless the project's LOGGING already did,
    and leave one log line per job event (see :class:`WithoutDjangosTaskEvents`)."""
    quiet_djangos_task_events()
    logger = logging.getLogger("django_jobs")
    if logger.handlers or logging.getLogger().handlers:
        return
    logger.setLevel(LEVELS.get(verbosity, logging.INFO))
    handler = BufferedStreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.propagate = False


class BufferedStreamHandler(logging.StreamHandler):
    """A ``StreamHandler`` whose lines are written by a thread of its own, a batch at a time.

    ``run_jobs`` logs two lines per job from every worker thread. Written by the
    thread that logs them, each line took the handler's lock and made a write
    and a flush: the threads queued on the lock while its holder was in the
    system call, and the two lines cost more CPU than the rest of a no-op job's
    run (0.36 ms of worker CPU per job against 0.25 with the same records sent
    to a ``NullHandler``; bench/throughput.py's drain, 2 x 8 threads). Here a
    record is formatted by the thread that logs it, which goes on at once; the
    writer thread writes it, then sleeps ``interval`` seconds and writes what has
    piled up meanwhile in one write and one flush, and so on while lines come.

    The trade: a line reaches the stream up to ``interval`` seconds after it was
    logged (at once after a quiet spell), and a process killed with SIGKILL loses
    the lines of its last ``interval``. A clean exit, ``logging.shutdown()`` and
    ``flush()`` write them all. Past ``max_lines`` unwritten lines (a stream that
    does not keep up), the thread that logs writes them itself, as ``StreamHandler``
    would: memory stays bounded and a slow stream slows its writers again.
    """

    def __init__(
        self, stream: TextIO | None = None, interval: float = 0.05, max_lines: int = 10_000
    ) -> None:
        super().__init__(stream)
        self.interval = interval
        self.max_lines = max_lines
        self.held_for_fork = False
        self.start_writing()
        ours = weakref.ref(self)

        def before_fork() -> None:
            handler = ours()
            if handler is not None:
                handler.hold_for_fork()

        def after_fork_in_parent() -> None:
            handler = ours()
            if handler is not None:
                handler.let_go_after_fork()

        def after_fork() -> None:
            # A forked child (run_jobs' worker processes) has no writer thread, and holds
            # a copy of lines that its parent's thread writes: it starts afresh. Its copy
            # of the handler's lock is already a new, free one (logging's own fork hook).
            handler = ours()
            if handler is not None:
                handler.held_for_fork = False
                handler.start_writing()

        os.register_at_fork(
            before=before_fork, after_in_parent=after_fork_in_parent, after_in_child=after_fork
        )
        BUFFERED.add(self)

    def hold_for_fork(self) -> None:
        """Wait for the writer to be out of the stream before a fork, and keep it out.

        A file's buffered writer holds a lock of its own inside every write and flush.
        Forked in that moment, the child gets that lock held by a thread it does not
        have, and its first line hangs it for ever: ``run_jobs``' warm parent forks
        the supervisor, whose writer may be writing its first lines, and every worker
        is a fork of that fork. The handler's lock covers each write and flush, so
        holding it across the fork is enough. A writer stuck on a stream that does not
        drain is waited for a second, then the fork goes on without it (a child would
        wait on that stream anyway).
        """
        lock = self.lock
        self.held_for_fork = lock is not None and lock.acquire(timeout=FORK_WAIT)

    def let_go_after_fork(self) -> None:
        if self.held_for_fork:
            self.held_for_fork = False
            self.lock.release()  # type: ignore[union-attr]

    def start_writing(self) -> None:
        self.lines: collections.deque[str] = collections.deque()
        self.wanted = threading.Event()
        self.closed = False
        self.writer: threading.Thread | None = None

    def handle(self, record: logging.LogRecord) -> bool:
        """``Handler.handle`` without taking the handler's lock: the deque needs none, and
        holding it here is what made the threads queue behind each write."""
        kept = self.filter(record)
        if isinstance(kept, logging.LogRecord):
            record = kept
        if kept:
            self.emit(record)
        return bool(kept)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self.lines.append(line)
        if self.closed or len(self.lines) > self.max_lines:
            self.flush()
            return
        if self.writer is None:
            self.start_writer()
        if not self.wanted.is_set():
            self.wanted.set()

    def start_writer(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # Handler.createLock made it
            if self.writer is None:
                self.writer = threading.Thread(
                    target=self.write_batches, name="django-jobs-log-writer", daemon=True
                )
                self.writer.start()

    def write_batches(self) -> None:
        while not self.closed:
            self.wanted.wait()
            self.wanted.clear()  # before the lines are taken: a line after them sets it again
            self.flush()
            # The lines of the next ``interval`` wait to be written together; a line after
            # a quiet spell (a worker starting, a cancel) is written at once.
            time.sleep(self.interval)

    def flush(self) -> None:
        """Write every line logged so far, then flush the stream."""
        with self.lock:  # type: ignore[union-attr]
            batch = []
            while self.lines:
                batch.append(self.lines.popleft())
            if not batch:
                return
            try:
                self.stream.write("".join(batch))
                super().flush()
            except Exception:
                # As StreamHandler reports a failed write (a closed or broken stream),
                # once for the batch, without the records it no longer has.
                # The report must not end the writer thread either (stderr may be the
                # stream that failed).
                if logging.raiseExceptions and sys.stderr:
                    with contextlib.suppress(Exception):
                        sys.stderr.write(f"--- Logging error: {len(batch)} line(s) not written\n")

    def close(self) -> None:
        self.closed = True
        self.wanted.set()
        self.flush()
        super().close()


BUFFERED: weakref.WeakSet[BufferedStreamHandler] = weakref.WeakSet()


def flush_buffered_lines() -> None:
    """Write the lines every :class:`BufferedStreamHandler` holds: before ``os._exit``,
    which skips ``logging.shutdown()``. One whose writer is stuck on a stream that
    does not drain is given a second, then left: the exit must not wait for it."""
    for handler in list(BUFFERED):
        lock = handler.lock
        if lock is not None and lock.acquire(timeout=1.0):
            try:
                handler.flush()
            finally:
                lock.release()
