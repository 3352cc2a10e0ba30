"""Bounds on the numbers a user declares: seconds, counts and sizes, and the ids an operator
types.

Every delay ends up added to a ``datetime``, whose range ends in year 9999;
``now + timedelta(seconds=1e12)`` raises ``OverflowError`` in whatever thread
computes it, which was once the supervisor's start-up recovery. So each number
is checked where it is written (a task option, a setting, ``Snooze``), and the
runtime adds seconds to a time only through :func:`later`, which cannot
overflow whatever a row says.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

# About a century: longer than any delay that means something, short enough that a time
# this far from now is always a datetime.
MAX_SECONDS = 100 * 366 * 86400.0
# Attempts in all: a bigger max_attempts is a mistake, not a plan (and each attempt keeps
# a failure row).
MAX_ATTEMPTS = 1_000_000
# ``async def`` jobs one worker process runs at once (the ``async_jobs`` setting): each
# waiting one costs a few KB; past this, a process that large is a mistake.
MAX_ASYNC_JOBS = 100_000
# A fair group's weight (core/fairness.py): its jobs' turns are 65,536 / weight apart, from
# 6,553,600 down to 655, so that a backlog of a billion jobs stays within the turn's 64 bits.
MIN_FAIR_WEIGHT = 0.01
MAX_FAIR_WEIGHT = 100.0
# A ready row's turn (core/fairness.py): a job's id times TURN_SCALE in a queue that is not
# fair, which leaves room for weights up to 100 (a step of 655) with ids up to 1.4e14. A stamp
# more than MAX_TURN_LEAD past its queue's head (a billion jobs at the lowest weight lead by
# 2**52), or past LARGEST_TURN, was written by hand. Here, not in core/fairness.py, because
# MariaDB's enqueue procedure is built from them in a migration, which must not import models.
TURN_SCALE = 2**16
MAX_TURN_LEAD = 2**56
LARGEST_TURN = 2**62
# The largest id a row can have (a signed 64-bit integer on every backend). SQLite refuses a
# larger integer in a query with OverflowError, so neither the admin nor a command passes one
# to the database.
MAX_ID = 2**63 - 1


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (``True`` is an int to Python, a mistake here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def as_id(text: str) -> int | None:
    """``text`` as a row's id, or None if no row can have it. ``str.isdigit`` alone is True
    for "²" (which ``int`` refuses) and "٣" (which it reads as 3); 20 digits and more are
    past ``MAX_ID`` (and ``int`` refuses more than 4,300 of them)."""
    if len(text) > len(str(MAX_ID)) or not (text.isascii() and text.isdigit()):
        return None
    number = int(text)
    return number if number <= MAX_ID else None


def seconds_problem(
    value: Any, *, minimum: float = 0.0, strict: bool = False, maximum: float = MAX_SECONDS
) -> str | None:
    """Why ``value`` is not a usable number of seconds, or None if it is one.

    ``strict``: ``minimum`` itself is refused (a timeout of 0 would never let a job run).
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not is_number(value):
        return f"must be a number of seconds, not {type(value).__name__}"
    if not math.isfinite(value):
        return f"must be a finite number of seconds, not {value!r}"
    if value < minimum or (strict and value == minimum):
        return f"must be {'>' if strict else '>='} {minimum:g} seconds, not {value!r}"
    if value > maximum:
        return f"must be at most {maximum:g} seconds (about a century), not {value!r}"
    return None


def check_seconds(value: Any, name: str, **bounds: Any) -> float:
    """``value`` as seconds, or ``ValueError`` naming ``name`` and the problem."""
    problem = seconds_problem(value, **bounds)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return float(value.total_seconds() if isinstance(value, timedelta) else value)


def bounded_seconds(value: Any, default: float = 0.0) -> float:
    """``value`` read from a row or returned by a user's function, made usable: a finite
    number in ``[0, MAX_SECONDS]``; ``default`` for anything that is not a number."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return default
    if math.isnan(seconds):
        return default
    return min(max(seconds, 0.0), MAX_SECONDS)


def later(now: datetime, seconds: Any) -> datetime:
    """``now`` plus ``seconds``, never an overflow: the seconds are bounded first
    (:func:`bounded_seconds`), and the sum stops at the last representable time."""
    delta = timedelta(seconds=bounded_seconds(seconds))
    try:
        return now + delta
    except OverflowError:
        return datetime.max.replace(tzinfo=now.tzinfo)


def declared_seconds(value: Any, name: str, *, strict: bool = False) -> float:
    """:func:`check_seconds` for a value someone declared, an int of any size included.

    ``math.isfinite`` of an int beyond a float's range is an ``OverflowError``, not the
    ``ValueError`` a declaration promises; such an int is out of range either way.
    """
    try:
        return check_seconds(value, name, strict=strict)
    except OverflowError:
        bound = f"at most {MAX_SECONDS:g} seconds (about a century)" if value > 0 else ">= 0"
        raise ValueError(
            f"{name} must be {bound}, not an integer of {value.bit_length()} bits"
        ) from None
