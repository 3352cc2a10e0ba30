"""Retry delays, and their JSON form so a per-call override survives in the job row.

A job row's ``backoff`` is data, never code: anyone who can write a row (a bug, a
restored dump, a hand-edited admin field) must not be able to make a worker import
and call something by naming it. So a ``{"path": ...}`` backoff only selects the
function the job's own task declares (``retries``, which reads a row when an attempt
fails), and every delay is bounded (``limits``) before it reaches a datetime.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django_jobs.limits import MAX_SECONDS, declared_seconds, is_number
from django_jobs.text import safe_repr

EXPONENTIAL_FIELDS = ("base", "factor", "max", "jitter")


def clamped(value: Any) -> float | None:
    """A number read from a row or returned by a function, brought into
    ``[0, MAX_SECONDS]``; None for anything that is not a number, or NaN.

    Unlike ``limits.bounded_seconds``, an int too large for a float is the maximum
    (it is a long delay, not garbage), and a string is not read as a number.
    """
    if not is_number(value):
        return None
    if isinstance(value, int):
        return float(min(max(value, 0), int(MAX_SECONDS)))
    if math.isnan(value):
        return None
    return min(max(value, 0.0), MAX_SECONDS)


@dataclass(frozen=True)
class Exponential:
    """``base * factor ** (attempt - 1)`` seconds, never more than ``max``, spread by
    ``jitter``.

    Jitter keeps a burst of jobs that failed together (a database blip, an API
    outage) from all retrying in the same instant. At the cap the spread is taken
    below ``max`` rather than around it, so ``max`` is a true ceiling.

    Each field is checked here, not when a retry is due: a bad one must fail where
    it is written, not as an ``OverflowError`` inside a worker's transaction.
    """

    base: float = 2.0
    factor: float = 2.0
    max: float = 3600.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        declared_seconds(self.base, "Exponential base")
        declared_seconds(self.max, "Exponential max")
        factor = self.factor
        finite = is_number(factor) and (isinstance(factor, int) or math.isfinite(factor))
        if not finite or factor < 1:
            raise ValueError(
                f"Exponential factor must be a finite number >= 1, not {safe_repr(factor, 40)}"
            )
        if not is_number(self.jitter) or not 0 <= self.jitter < 1:
            raise ValueError(
                f"Exponential jitter must be a number from 0 up to (not including) 1, "
                f"not {self.jitter!r}"
            )

    def __call__(self, attempt: int) -> float:
        delay = self.undithered(attempt)
        if not self.jitter or not delay:
            return float(delay)
        low = delay * (1 - self.jitter)
        high = min(float(self.max), delay * (1 + self.jitter))
        return random.uniform(low, high)

    def undithered(self, attempt: int) -> float:
        """The delay before jitter, capped without ever computing ``factor ** attempt``
        past the cap: ``2.0 ** 2000`` is an ``OverflowError``, and an attempt count
        comes from a row."""
        base, cap = float(self.base), float(self.max)
        steps = max(0, attempt - 1)
        if base >= cap:
            return cap
        if base == 0 or self.factor == 1:
            return base
        # base * factor ** steps >= cap  <=>  steps >= log(cap / base) / log(factor); the
        # logs are taken apart so that a tiny base does not overflow cap / base. The
        # threshold is finite (a few thousand over a log of a factor above 1), and an
        # int compares with a float exactly, however large it is.
        threshold = (math.log(cap) - math.log(base)) / math.log(self.factor)
        if steps >= threshold:
            return cap
        try:
            return min(cap, base * self.factor**steps)
        except OverflowError:  # factor ** steps alone overflows, the product would not
            return min(cap, math.exp(math.log(base) + steps * math.log(self.factor)))


DEFAULT_BACKOFF = Exponential()

BackoffSpec = None | int | float | Exponential | Callable[[int], float]


def function_path(value: Any) -> str | None:
    """``module.qualname`` of a backoff function, or None if it has no such name (a
    lambda, a nested function, a callable object): the name a row records, and the
    one a worker matches against the task's own declaration."""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not module or not isinstance(qualname, str):
        return None
    if not qualname or "<" in qualname:
        return None
    return f"{module}.{qualname}"


def validate_backoff(value: Any) -> None:
    """``ValueError`` naming what is wrong with a declared backoff."""
    if value is None or isinstance(value, Exponential):
        return
    if isinstance(value, bool):
        raise ValueError("backoff must be a number of seconds, Exponential(...) or a function")
    if isinstance(value, int | float):
        declared_seconds(value, "backoff")
        return
    if callable(value):
        if function_path(value) is None:
            raise ValueError(
                "a backoff function must be defined at module level (a def, not a lambda, "
                "a nested function or a callable object), so a job can name it"
            )
        return
    raise ValueError("backoff must be a number of seconds, Exponential(...) or a function")


def backoff_to_json(value: BackoffSpec) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, Exponential):
        return {
            "exponential": {
                "base": value.base,
                "factor": value.factor,
                "max": value.max,
                "jitter": value.jitter,
            }
        }
    if isinstance(value, int | float):
        return {"fixed": float(value)}
    return {"path": function_path(value)}


def default_delay(attempt: int) -> float:
    return clamped(DEFAULT_BACKOFF(attempt)) or 0.0
