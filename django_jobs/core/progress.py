"""Progress of a running job: reported by its task, throttled, kept on its ``Job`` row.

``set_progress(done, total, message)`` only records the value in memory and wakes
this process's progress writer, one daemon thread: the task never waits for the
database, a database outage never fails it, and it may call ``set_progress`` in a
tight loop or from an ``async def`` task alike. The writer writes a job's newest
value at once if that job's last write is at least ``PROGRESS_INTERVAL`` seconds
old, else when that much time has passed: at most one write per job per interval,
and a value reported just before a long step (``"step 2 of 3: converting"``) is
written within the interval, not when the next report comes.

When the body ends, the worker calls :func:`flush_progress` in the job's own
thread, before it records the outcome: the last value is written then, so a
final ``set_progress`` just before ``return`` is never lost, and it is on the row
by the time the job reads as finished. Without that call (a body stuck in C code
never returns) the writer still writes it within the interval.

Each write is one ``UPDATE`` of the four ``progress_*`` columns of that job's
row, by primary key, in autocommit: it never touches ``status`` or anything a
transition writes, locks no row but that one, for one statement, and so never
holds up a claim or a finish for longer than that (on SQLite, where every write
transaction takes the database's write lock, it waits for the one in progress
like any other write). Writes of one job are serialised (a per-job lock), so the
last value reported is the last one written.
"""

from __future__ import annotations

import contextvars
import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from django.db import InterfaceError, OperationalError, connections
from django.utils import timezone

from django_jobs.exceptions import JobNotFound
from django_jobs.models import Job
from django_jobs.text import clip, jobs_logger, safe_repr, safe_str, without_nul

logger = jobs_logger("django_jobs.progress")

# Seconds between two writes of one job's progress.
PROGRESS_INTERVAL = 1.0
# The writer thread closes its database connection after this many idle seconds, or as
# soon as the last job that reported progress has ended (flush_progress).
IDLE_CLOSE_AFTER = 5.0
MESSAGE_MAX_LENGTH = 255

# True while the test toolkit (django_jobs.testing) runs a job's body in the test's own
# thread: its reports are kept for :func:`flush_progress`, which writes the last one in
# that thread, on the test's connection, as the body ends. The writer thread's connection
# would wait for the job's row, which the test's transaction holds, and the flush for it.
held_reports: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "django_jobs_held_progress", default=False
)


@dataclass(frozen=True)
class Progress:
    """A job's last reported progress, as :func:`progress` reads it."""

    done: float
    total: float | None
    message: str
    updated_at: datetime

    @property
    def fraction(self) -> float | None:
        """``done / total`` between 0 and 1 (``done`` past ``total`` counts as 1); None
        without a total."""
        if not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    @property
    def percent(self) -> int | None:
        """The fraction as a whole percentage, rounded down (99.9 % is not done yet)."""
        fraction = self.fraction
        return None if fraction is None else math.floor(fraction * 100)

    @property
    def summary(self) -> str:
        """``42% · 42 of 100``, or ``42 done`` without a total."""
        return summary(self.done, self.total)

    def as_json(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "total": self.total,
            "message": self.message,
            "updated_at": self.updated_at.isoformat(),
            "fraction": self.fraction,
        }


def amount(value: float) -> str:
    """A count as a person reads it: ``1,234``, ``3.5``."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def summary(done: float, total: float | None) -> str:
    """``42% · 42 of 100`` (the percentage rounded down), or ``42 done`` without a total."""
    if not total:
        return f"{amount(done)} done"
    percent = math.floor(max(0.0, min(1.0, done / total)) * 100)
    return f"{percent}% · {amount(done)} of {amount(total)}"


def number(value: float | None) -> float | None:
    """A stored count as the caller gave it: 42, not 42.0."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


def from_row(
    done: float | None, total: float | None, message: str | None, at: datetime | None
) -> Progress | None:
    """The ``Progress`` of a job's four ``progress_*`` columns; None if it never reported."""
    if done is None or at is None:
        return None
    # number() of a number is a number: None only for None.
    return Progress(cast(float, number(done)), number(total), message or "", at)


def progress(result_id: str | int, *, using: str | None = None) -> Progress | None:
    """The last progress job ``result_id`` reported, or None if it has reported none.

    Raises :class:`~django_jobs.exceptions.JobNotFound` for an unknown id.
    """
    from django_jobs.conf import database_alias

    row = (
        Job.objects.using(using or database_alias())
        .filter(pk=int(result_id))
        .values_list("progress_done", "progress_total", "progress_message", "progress_at")
        .first()
    )
    if row is None:
        raise JobNotFound(f"no job with id {result_id}")
    return from_row(*row)


@dataclass(frozen=True)
class Report:
    done: float
    total: float | None
    message: str
    at: datetime


def checked_report(done: Any, total: Any, message: Any) -> Report:
    def is_number(value: Any) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)

    def as_float(value: Any) -> float:
        # 10**400 or Decimal("1e400") is a number, but no float: it would be stored as
        # infinity, or raise OverflowError in the writer.
        try:
            return float(value)
        except (OverflowError, ValueError):
            return math.inf

    if not is_number(done) or not math.isfinite(as_float(done)) or done < 0:
        raise ValueError(
            f"set_progress(): done must be a finite number >= 0, not {safe_repr(done, 60)}"
        )
    if total is not None and (
        not is_number(total) or not math.isfinite(as_float(total)) or total <= 0
    ):
        raise ValueError(
            f"set_progress(): total must be None or a number > 0, not {safe_repr(total, 60)}"
        )
    if not isinstance(message, str):
        raise TypeError(f"set_progress(): message must be a str, not {type(message).__name__}")
    return Report(
        as_float(done),
        None if total is None else as_float(total),
        # No NUL (PostgreSQL refuses it in text), and the column's length.
        without_nul(message)[:MESSAGE_MAX_LENGTH],
        timezone.now(),
    )


def set_progress(done: float, total: float | None = None, message: str = "") -> None:
    """Report how far the running job has got: ``done`` of ``total`` (None: unknown), and
    what it is doing (``message``, cut at 255 characters).

    Call it from inside a task, as often as you like: it returns at once, and the
    value is written to the job's row at most once a second, the last one always
    (see the module's docstring). Outside a running job it raises ``RuntimeError``; in a
    task another backend runs (Django's ``ImmediateBackend`` in tests) it keeps nothing.
    """
    from django_jobs.conf import database_alias
    from django_jobs.core.batches import current_job_id

    job_id = current_job_id.get()
    if job_id is None:
        from django_jobs.tasks.other_backends import other_backend_running

        if other_backend_running():
            checked_report(done, total, message)  # bad values fail there as here
            return  # Django's ImmediateBackend keeps no progress (docs/testing.md)
        raise RuntimeError(
            "django_jobs.set_progress() was called outside a running job: call it from the "
            "body of a task that a django-jobs worker (run_jobs) is running"
        )
    WRITER.report(job_id, database_alias(), checked_report(done, total, message))


def flush_progress(job_id: int) -> None:
    """Write job ``job_id``'s last reported value now, in this thread, and forget the job.

    For the worker, once the job's body has ended and before its outcome is
    recorded. Cheap when the job reported nothing (a dictionary lookup); never
    raises (a value that cannot be written now is left to the writer thread).
    """
    WRITER.flush(job_id)


def write_report(db: str, job_id: int, report: Report) -> int:
    """One UPDATE of the job's progress columns, by primary key; nothing else."""
    return (
        Job.objects.using(db)
        .filter(pk=job_id)
        .update(
            progress_done=report.done,
            progress_total=report.total,
            progress_message=report.message,
            progress_at=report.at,
        )
    )


@dataclass(eq=False)
class Entry:
    """One job's reports not yet written, and when it was last written."""

    job_id: int
    db: str
    pending: Report | None = None
    written_at: float = -math.inf  # time.monotonic() of the last write
    # Held while a value of this job is written: its writes never overlap, so the one
    # that takes the newest value is also the last to reach the database.
    writing: threading.Lock = field(default_factory=threading.Lock)

    def due_at(self) -> float:
        return self.written_at + PROGRESS_INTERVAL


class ProgressWriter:
    """This process's progress writer: the reports of every job it runs, and one thread."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.entries: dict[int, Entry] = {}
        self.thread: threading.Thread | None = None
        self.databases: set[str] = set()  # aliases the writer thread has connected to
        self.close_requested = False
        self.closed = threading.Event()
        # Reports kept for flush_progress alone (:data:`held_reports`): job id -> the last.
        self.held: dict[int, tuple[str, Report]] = {}

    def report(self, job_id: int, db: str, report: Report) -> None:
        if held_reports.get():
            with self.changed:
                self.held[job_id] = (db, report)
            return
        with self.changed:
            entry = self.entries.get(job_id)
            if entry is None:
                entry = self.entries[job_id] = Entry(job_id, db)
            entry.pending = report
            self.changed.notify()
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self.run, name="django-jobs-progress", daemon=True
                )
                self.thread.start()

    def flush(self, job_id: int) -> None:
        with self.changed:
            held = self.held.pop(job_id, None)
            entry = self.entries.get(job_id)
        if held is not None:
            try:
                write_report(held[0], job_id, held[1])
            except Exception as exc:  # progress must never fail a job
                logger.warning(
                    "could not write the progress of job %s (%s: %s)",
                    job_id,
                    type(exc).__name__,
                    clip(safe_str(exc), 300),
                )
        if entry is None:
            return
        written = self.write(entry, in_job_thread=True)
        with self.changed:
            # Forgotten once written; a value that could not be written stays for the thread.
            if written and entry.pending is None and self.entries.get(job_id) is entry:
                del self.entries[job_id]
            if not self.entries:
                # No job of this process has anything left to write: the thread closes its
                # connection now rather than when idle for IDLE_CLOSE_AFTER.
                self.close_requested = True
                self.changed.notify()

    def write(self, entry: Entry, *, in_job_thread: bool = False) -> bool:
        """Write ``entry``'s pending value, if any; False if the database refused it."""
        with entry.writing:
            with self.changed:
                report, entry.pending = entry.pending, None
                if report is not None:
                    entry.written_at = time.monotonic()
            if report is None:
                return True
            try:
                if not in_job_thread:
                    self.databases.add(entry.db)
                    connections[entry.db].close_if_unusable_or_obsolete()
                write_report(entry.db, entry.job_id, report)
            except Exception as exc:  # progress must never fail a job, nor stop the writer
                outage = isinstance(exc, OperationalError | InterfaceError)
                logger.warning(
                    "could not write the progress of job %s (%s: %s); %s",
                    entry.job_id,
                    type(exc).__name__,
                    clip(safe_str(exc), 300),
                    "retrying" if outage else "dropping this value",
                )
                if not in_job_thread:
                    self.close_connections()
                if not outage:
                    # The database refused this value itself: writing it again would fail
                    # again, every second, for as long as the job runs.
                    return True
                with self.changed:
                    if entry.pending is None:
                        entry.pending = report  # unless a newer value came meanwhile
                    self.changed.notify()
                return False
        return True

    def run(self) -> None:
        """Write each job's value when due; forget the jobs idle past the interval; close
        the connections when there is nothing to write."""
        idle_since = time.monotonic()
        while True:
            with self.changed:
                now = time.monotonic()
                for entry in [e for e in self.entries.values() if not e.pending]:
                    if entry.due_at() <= now:  # its next report may be written at once
                        del self.entries[entry.job_id]
                due = [e for e in self.entries.values() if e.pending and e.due_at() <= now]
                if not due:
                    idle = not any(e.pending for e in self.entries.values())
                    if idle and (self.close_requested or now - idle_since >= IDLE_CLOSE_AFTER):
                        self.close_connections()
                        self.close_requested = False
                        self.closed.set()
                    if self.entries:
                        timeout: float | None = max(
                            0.0, min(e.due_at() for e in self.entries.values()) - now
                        )
                    elif self.databases:
                        timeout = max(0.0, IDLE_CLOSE_AFTER - (now - idle_since))
                    else:
                        timeout = None
                    self.changed.wait(timeout)
                    continue
            for entry in due:
                self.write(entry)
            idle_since = time.monotonic()

    def close_connections(self) -> None:
        """Close the writer thread's connections (in that thread: Django's are per thread)."""
        for db in self.databases:
            try:
                connections[db].close()
            except Exception:
                logger.debug("closing the progress writer's connection to %s", db, exc_info=True)
        self.databases.clear()

    def close_when_idle(self, timeout: float = 10.0) -> bool:
        """Once every pending value is written, have the thread close its connections;
        True when it has (tests call this before the test database is dropped)."""
        with self.changed:
            if self.thread is None or not self.thread.is_alive():
                return True
            self.closed.clear()
            self.close_requested = True
            self.changed.notify()
        return self.closed.wait(timeout)

    def pending(self) -> int:
        """Jobs with a value not written yet (for tests and diagnostics)."""
        with self.changed:
            return sum(1 for entry in self.entries.values() if entry.pending)


WRITER = ProgressWriter()
