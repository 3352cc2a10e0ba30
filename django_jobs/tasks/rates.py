"""Rates: ``"10/m"`` read, checked and resolved (names from ``DJANGO_JOBS["rate_limits"]``).

Kept apart from the locking in ``rate_limits`` so a task's declaration can check
its rate without importing models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django_jobs.limits import MAX_SECONDS
from django_jobs.text import safe_repr

# Seconds per unit; "10/m", "100/5s", "1/2h", "5000/d".
UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
# Each key's row keeps up to N start times: a larger N would make every start
# rewrite a large list. 10,000 per period covers any rate worth limiting here
# (10,000/s is a rate limit on the queue itself, not on an API).
MAX_STARTS_PER_PERIOD = 10_000
# The shortest period a row's rate is taken to have: a zero or negative one (only a
# hand-edited row has one) would make no start ever count against the next.
MIN_PERIOD = 0.001
RATE_PATTERN = re.compile(r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*([A-Za-z]+)\s*$")


@dataclass(frozen=True)
class Rate:
    """``limit`` starts per ``period`` seconds."""

    limit: int
    period: float


def parse_rate(text: object) -> Rate:
    """A :class:`Rate` from ``"N/period"``; ``ValueError`` saying what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"a rate must be a string like '10/m', not {safe_repr(text, 40)}")
    match = RATE_PATTERN.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a rate like '10/m', '100/5s' or '1000/h'")
    count, multiple, unit = match.groups()
    if unit.lower() not in UNITS:
        raise ValueError(
            f"{text!r}: unknown period unit {unit!r}; use s, m, h or d (e.g. '10/m', '100/5s')"
        )
    # A count of thousands of digits is past int()'s digit limit: compare its length first.
    digits = count.lstrip("0") or "0"
    limit = int(digits) if len(digits) <= 9 else MAX_STARTS_PER_PERIOD + 1
    if not 1 <= limit <= MAX_STARTS_PER_PERIOD:
        raise ValueError(
            f"{safe_repr(text, 60)}: the count must be between 1 and {MAX_STARTS_PER_PERIOD:,} "
            "(use a longer period for more)"
        )
    try:
        factor = float(multiple) if multiple else 1.0
    except ValueError:
        raise ValueError(f"{text!r} is not a rate like '10/m', '100/5s' or '1000/h'") from None
    period = factor * UNITS[unit.lower()]
    if period <= 0:
        raise ValueError(f"{text!r}: the period must be longer than 0")
    # Each start is planned ``period`` seconds after another, as a datetime: a period
    # past a century (or a float's range) would overflow one in a worker.
    if not period <= MAX_SECONDS:
        raise ValueError(
            f"{safe_repr(text, 60)}: the period must be at most {MAX_SECONDS / 86400:,.0f} days "
            "(about a century)"
        )
    return Rate(limit, period)


def is_rate(text: str) -> bool:
    """Whether ``text`` is written as a rate (``N/...``) rather than the name of one."""
    return "/" in text


def named_rate(name: Any, text: Any) -> Rate:
    """One entry of ``DJANGO_JOBS["rate_limits"]``; ``ValueError`` naming it if it is bad."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name {name!r} must be a non-empty string without '/'")
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise ValueError(f"{name!r}: {exc}") from None


def resolve_rate(spec: str, where: str) -> tuple[str | None, Rate]:
    """``(name, rate)`` of a task's ``rate_limit``: a name from settings, or ``(None, rate)``.

    Raises ``ValueError`` naming ``where`` for a malformed rate or an unknown name.
    """
    if is_rate(spec):
        try:
            return None, parse_rate(spec)
        except ValueError as exc:
            raise ValueError(f"{where}: rate_limit {exc}") from None
    from django_jobs.conf import did_you_mean, jobs_settings

    raw = jobs_settings().rate_limits
    names = raw if isinstance(raw, Mapping) else {}
    if spec not in names:
        hint = did_you_mean(spec, [str(name) for name in names])
        raise ValueError(
            f"{where}: rate_limit {spec!r} is neither a rate like '10/m' nor a name in "
            f"DJANGO_JOBS['rate_limits']{f'. {hint}' if hint else ''}"
        )
    try:
        return spec, parse_rate(names[spec])
    except ValueError as exc:
        raise ValueError(f"{where}: DJANGO_JOBS['rate_limits'][{spec!r}]: {exc}") from None
