"""Which jobs ``manage.py jobs retry|discard|cancel`` acts on: ids as the operator typed them,
or filters, read in batches of a bounded size by ascending id.

What an operator types is checked here, before anything is read or changed: an option that
cannot be read (a ``--since`` that is no time, a pattern with a NUL) stops the command with a
:class:`SelectionError` naming it. An id that no job can have ("abc", "-5", 2**70) is not an
error: it is one of the selection's jobs that could not be acted on, named in the report,
and it never reaches the database (SQLite refuses an integer past 64 bits outright).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db.models import Count, F, Max, Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from django_jobs.db.lookups import ExactStartsWith
from django_jobs.limits import MAX_SECONDS, as_id
from django_jobs.models import FINISHED_STATUSES, Job

# ``30m``, ``2h``, ``3d``, ``1w``: that long before now.
DURATION = re.compile(r"(\d{1,12})([smhdw])")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The date an ISO 8601 value starts with, checked on its own to say which part is wrong.
ISO_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?![\d])")


class SelectionError(ValueError):
    """An option that cannot be read at all: nothing is read or changed."""


def parse_when(text: str, option: str, now: datetime) -> datetime:
    """``text`` as a moment: a duration before ``now`` (``90s``, ``30m``, ``2h``, ``3d``,
    ``1w``) or an ISO 8601 date or date and time, in the current time zone when it names
    none (``2026-05-01``, ``2026-05-01T14:30``, ``2026-05-01 14:30:00+02:00``)."""
    value = text.strip()
    duration = DURATION.fullmatch(value)
    if duration:
        seconds = int(duration.group(1)) * UNIT_SECONDS[duration.group(2)]
        if seconds > MAX_SECONDS:
            raise SelectionError(f"{option} {text!r} reaches back more than a century")
        return now - timedelta(seconds=seconds)
    try:
        moment = parse_datetime(value)
    except ValueError as exc:  # well formed, but no such time ("2026-02-30T10:00")
        raise SelectionError(
            f"{option} {printable_arg(text)} is not a real date and time: {exc}"
        ) from None
    if moment is None:
        raise SelectionError(no_such_date(text, option) or not_a_moment(text, option))
    try:
        if timezone.is_naive(moment):
            moment = timezone.make_aware(moment)
        # What the database is sent, whatever zone was typed: a moment within a day of
        # the calendar's ends may not exist in UTC (0001-01-01T00:00+05:00).
        moment.astimezone(UTC)
    except OverflowError:
        raise SelectionError(
            f"{option} {printable_arg(text)} is out of range: in UTC it falls before the "
            "year 1 or after 9999"
        ) from None
    return moment


def no_such_date(text: str, option: str) -> str | None:
    """Why ``text``, shaped as a date (``2026-02-30``), is none; None if it is not so
    shaped, or is a real date (then what follows it is what cannot be read)."""
    shape = ISO_DATE.match(text.strip())
    if shape is None:
        return None
    year, month, day = (int(part) for part in shape.groups())
    try:
        date(year, month, day)
    except ValueError as exc:
        return f"{option} {printable_arg(text)} is not a real date: {exc}"
    return None


def not_a_moment(text: str, option: str) -> str:
    return (
        f"{option} {printable_arg(text)} is neither a duration (30m, 2h, 3d, 1w) nor an "
        "ISO 8601 date or date and time (2026-05-01, 2026-05-01T14:30)"
    )


def parse_pattern(text: str, option: str) -> str:
    """A ``--task`` or ``--queue`` value: a name, or a ``prefix*``."""
    if not text or text == "*":
        raise SelectionError(f"{option} needs a name or a prefix followed by '*'")
    if "\x00" in text:
        raise SelectionError(f"{option} {printable_arg(text)} holds a NUL character")
    if "*" in text[:-1]:
        raise SelectionError(f"{option} {printable_arg(text)}: '*' may only end a prefix")
    return text


def printable_arg(text: str, limit: int = 60) -> str:
    """An argument as a message quotes it: one line, short (it may be 5,000 digits)."""
    shown = repr(text[:limit])
    return shown if len(text) <= limit else f"{shown[:-1]}…{shown[-1]} ({len(text):,} characters)"


def matches(field: str, patterns: Collection[str]) -> Q:
    """``field`` is one of the names, or starts with one of the ``prefix*`` patterns,
    compared exactly on every database.

    ``ExactStartsWith`` compares by code point everywhere (Django's ``LIKE`` ignores ASCII
    case on SQLite; on MySQL/MariaDB it is ``LIKE BINARY``). A name is also held to that
    prefix, since ``=`` compares by the column's collation, which on MySQL/MariaDB ignores
    case for the task path; the two together match the name exactly.
    """
    condition = Q()
    for pattern in patterns:
        prefix = pattern[:-1] if pattern.endswith("*") else pattern
        exact = Q(ExactStartsWith(F(field), prefix))
        condition |= exact if pattern.endswith("*") else Q(**{field: pattern}) & exact
    return condition


@dataclass(frozen=True)
class Filters:
    """The jobs that match every option given; ``statuses`` is never empty."""

    statuses: frozenset[str]
    tasks: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None

    def queryset(self, db: str) -> QuerySet[Job]:
        jobs = Job.objects.using(db).filter(self.in_window())
        if self.tasks:
            jobs = jobs.filter(matches("task_path", self.tasks))
        if self.queues:
            jobs = jobs.filter(matches("queue_name", self.queues))
        return jobs

    def in_window(self) -> Q:
        """The statuses, and ``--since``/``--until``: a failed (or otherwise finished) job
        by when it finished, the others by when they were enqueued."""
        ended = sorted(s for s in self.statuses if s in FINISHED_STATUSES)
        live = sorted(s for s in self.statuses if s not in FINISHED_STATUSES)
        condition = Q()
        for statuses, field in ((ended, "finished_at"), (live, "enqueued_at")):
            if statuses:
                condition |= Q(status__in=statuses, **self.window(field))
        return condition

    def window(self, field: str) -> dict[str, datetime]:
        bounds = {}
        if self.since is not None:
            bounds[f"{field}__gte"] = self.since
        if self.until is not None:
            bounds[f"{field}__lt"] = self.until
        return bounds


@dataclass(frozen=True)
class TypedIds:
    """Job ids as typed, each argument one id or several separated by commas (``4512``,
    ``#4512``, ``4512,4513``, as ``--status`` takes its values): those a job can have,
    ascending and once each, and the rest."""

    ids: tuple[int, ...]
    not_ids: tuple[str, ...]

    @classmethod
    def parse(cls, texts: Iterable[str]) -> TypedIds:
        ids: set[int] = set()
        not_ids: list[str] = []
        for text in texts:
            # An empty piece ("4512," or "1,,2") is a slip of the comma, not an id; an
            # argument with nothing else in it is named.
            pieces = [piece for piece in text.split(",") if piece.strip()] or [text]
            for piece in pieces:
                job_id = as_id(piece.strip().lstrip("#"))
                if job_id is None:
                    not_ids.append(piece)
                else:
                    ids.add(job_id)
        return cls(tuple(sorted(ids)), tuple(not_ids))


def id_batches(jobs: QuerySet[Job], size: int, up_to: int | None = None) -> Iterator[list[int]]:
    """The ids of ``jobs`` (at most ``up_to``), ascending, ``size`` at a time.

    Each batch is read again from where the last ended (by id, not by offset), so jobs
    that stop matching once acted on shift nothing, and no more than ``size`` ids are
    held at once however many jobs match.
    """
    after = 0  # ids start at 1
    while True:
        rows = jobs.filter(pk__gt=after)
        if up_to is not None:
            rows = rows.filter(pk__lte=up_to)
        batch = list(rows.order_by("pk").values_list("pk", flat=True)[:size])
        if batch:
            yield batch
        if len(batch) < size:
            return
        after = batch[-1]


def chunks(ids: tuple[int, ...], size: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


def count_and_last(jobs: QuerySet[Job]) -> tuple[int, int | None]:
    """How many jobs match, and the largest id among them (one query)."""
    found = jobs.order_by().aggregate(count=Count("pk"), last=Max("pk"))
    return found["count"], found["last"]
