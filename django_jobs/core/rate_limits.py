"""Rate limits per period: at most N starts of a key in any P seconds, across all workers.

A rate is a sliding window, the strongest reading of "10 per minute": no
interval of P seconds, wherever it begins, holds more than N recorded starts.

The decision is taken where the attempt is counted, in the start transaction
(``core.starting.start_jobs``), under the lock of the key's :class:`RateLimit` row, so
two workers can never both take the window's last start, and the start time
that is recorded (``Job.last_attempted_at``) is the time that was checked. A
claim-time decision would count the claim and let the gap between claim and
start put N + 1 real starts in a window.

A job over the limit waits as a scheduled job, costing no attempt, until the
time its start is *planned* for: each key keeps the last N planned start times
(starts, and the times promised to waiting jobs), and the next waiting job is
placed P seconds after the N-th last of them. A backlog of 10,000 jobs at 10
per minute is therefore spread over 1,000 minutes at once, instead of every
waiting job coming back at every opening to be turned away again. The plan is
only a schedule: when a job comes due it is checked against the real starts
again, and waits once more if a late start still fills the window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections
from django.utils import timezone

from django_jobs.db import ops
from django_jobs.limits import MAX_SECONDS, is_number
from django_jobs.models import RateLimit
from django_jobs.tasks.rates import MAX_STARTS_PER_PERIOD, MIN_PERIOD, Rate


@dataclass
class Decision:
    """What the start transaction does with one job of a rate-limited key."""

    admitted: bool
    at: float  # the start's recorded time if admitted, else when to try again


def times(values: Any) -> list[float]:
    """A row's list of times, keeping only the finite numbers.

    The row is data: a string, a NaN or a ``1e308`` written into it (by hand, a
    restore, a bug) must not raise in, or be planned by, every start of its key.
    """
    if not isinstance(values, list):
        return []
    return [t for t in map(finite, values) if t is not None]


def finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, NaN, infinite, or an int
    beyond a float's range)."""
    if not is_number(value):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def usable_rate(rate: Rate) -> Rate:
    """``rate`` as read from a job row, brought within what ``parse_rate`` accepts: a
    declared rate always is, a row edited since may not be."""
    limit = finite(rate.limit)
    period = finite(rate.period)
    return Rate(
        1 if limit is None else int(min(max(limit, 1), MAX_STARTS_PER_PERIOD)),
        1.0 if period is None else min(max(period, MIN_PERIOD), MAX_SECONDS),
    )


class Window:
    """One key's starts and plan, read under its row lock and written back after.

    PostgreSQL decides the starts this class would admit in SQL too
    (``db/postgresql/rate_limits.start_rated_statement``), leaving it every other case: a
    change to what :meth:`decide` or :meth:`admit` answer changes that statement in the
    same commit. tests/test_rate_limits_one_statement.py holds the two to one another.
    """

    def __init__(self, row: RateLimit) -> None:
        self.row = row
        self.starts: list[float] = times(row.starts)
        self.planned: list[float] = times(row.planned)

    def decide(self, now: float, rate: Rate, reserved: float | None = None) -> Decision:
        """:meth:`admit`, with every time it returns within a century of ``now``: the
        caller makes a datetime of it, whatever the rows held."""
        rate = usable_rate(rate)
        horizon = now + MAX_SECONDS
        # A time past the horizon was never written by a start (each is a "now" or a
        # period after one): garbage that would push every later start past it.
        self.starts = [t for t in self.starts if t <= horizon]
        self.planned = [t for t in self.planned if t <= horizon]
        if reserved is not None and not (math.isfinite(reserved) and reserved <= horizon):
            reserved = None
        decision = self.admit(now, rate, reserved)
        decision.at = min(decision.at, horizon)
        self.planned = [min(t, horizon) for t in self.planned]
        return decision

    def admit(self, now: float, rate: Rate, reserved: float | None) -> Decision:
        """Admit one start at ``now``, or say when this job should come back.

        ``reserved``: the planned time the job waited for (``Job.rate_reserved_at``);
        it is checked against the real starts only, and once it starts its real
        time replaces the planned one, so the times planned next allow for a
        start that came late. A job without one also waits while the key has
        planned times still ahead, so it queues behind them instead of taking
        the slot a waiting job was promised.
        """
        if self.starts:
            # Recorded times never go backwards, so a clock behind another
            # worker's cannot slip a start in before the last one recorded.
            now = max(now, self.starts[-1])
        recent = [t for t in self.starts if t > now - rate.period]
        full = len(recent) >= rate.limit
        queued = reserved is None and bool(self.planned) and self.planned[-1] > now
        if not full and not queued:
            self.starts = [*recent, now][-rate.limit :]
            planned = list(self.planned)
            if reserved in planned:
                planned.remove(reserved)
            self.planned = sorted([*planned, now])[-rate.limit :]
            self.row.limit, self.row.period = rate.limit, rate.period
            return Decision(True, now)
        opening = recent[len(recent) - rate.limit] + rate.period if full else now
        if reserved is not None:
            # Due, but an earlier start ran late and still fills the window: the
            # next opening of the real starts, not the back of the queue.
            return Decision(False, opening)
        at = max(opening, self.planned[-1] if self.planned else now)
        if len(self.planned) >= rate.limit:
            at = max(at, self.planned[-rate.limit] + rate.period)
        self.planned = [*self.planned, at][-rate.limit :]
        return Decision(False, at)

    def write_back(self) -> None:
        self.row.starts = self.starts
        self.row.planned = self.planned


def ensure_rate_rows(db: str, keys: Iterable[str], now: datetime | None = None) -> None:
    """Create the missing rows of ``keys``, in short statements of their own
    (``Operations.ensure_rate_rows``).

    Outside the start transaction on purpose: on InnoDB an ``INSERT IGNORE``
    that meets an existing row takes a shared lock on it, and two transactions
    each holding that shared lock and then asking for the exclusive one would
    deadlock. Maintenance deletes only rows with no start or plan left within
    their period (``maintenance.prune_rate_limits``); a start that finds its row
    deleted in between waits a second (``core.starting.decide_rates``).
    """
    ops(db).ensure_rate_rows(db, set(keys), now or timezone.now())


# Keys a connection knows to have rows, at most this many (then it forgets them all).
KNOWN_KEYS_MAX = 10_000


class RateRowsMissing(Exception):
    """A start found no row for a key it had not made sure of (:func:`ensure_unknown_rate_rows`):
    its transaction rolls back, having written nothing, to be run again once the rows exist."""


def ensure_unknown_rate_rows(db: str, keys: set[str], now: datetime) -> set[str]:
    """:func:`ensure_rate_rows` for the keys this connection has not seen a row of; returns
    the others, which it skipped.

    A row seen once is there at the next start of its key but for a prune, which
    deletes only a row with nothing left to remember, or a test's flush. A start that
    then finds a skipped key's row gone raises :class:`RateRowsMissing` before writing
    anything (``core.starting.decide_rates``), and ``start_jobs`` makes sure of every
    key and starts again: what a start decides is what it would have decided with the
    rows made sure of first. Known keys are kept per connection, forgotten when it is
    replaced (a new thread's, a reconnection).
    """
    known = known_keys(db)
    unknown = keys - known
    if unknown:
        ensure_rate_rows(db, unknown, now)
        if len(known) + len(unknown) > KNOWN_KEYS_MAX:
            known.clear()
        known |= unknown
    return keys - unknown


def known_keys(db: str) -> set[str]:
    """The rate keys known to have rows, for the open connection of ``db``."""
    wrapper = connections[db]
    wrapper.ensure_connection()
    raw = id(wrapper.connection)
    cached = getattr(wrapper, "_django_jobs_rate_keys", None)
    if cached is None or cached[0] != raw:
        cached = (raw, set())
        wrapper._django_jobs_rate_keys = cached  # type: ignore[attr-defined]
    return cached[1]


def forget_keys(db: str, keys: Iterable[str]) -> None:
    known_keys(db).difference_update(keys)


def lock_rate_limits(db: str, keys: Iterable[str]) -> dict[str, Window]:
    """Lock the rows of ``keys`` in ascending key order; their windows by key.

    docs/design.md section 4's order, extended: a start locks its claimed rows, then
    these, then (for a job sent back to wait) its semaphore. The order is Python's,
    by code point, on every database (``Operations.lock_rate_rows``).
    """
    return {row.key: Window(row) for row in ops(db).lock_rate_rows(db, keys)}


def written_rows(windows: Iterable[Window]) -> list[RateLimit]:
    """The windows' rows with their new starts and plan set, for the start to write back
    (``Operations.write_rated_starts``)."""
    rows = []
    for window in windows:
        window.write_back()
        rows.append(window.row)
    return rows
