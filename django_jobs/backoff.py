"""Retry delays, and their JSON form so a per-call override survives in the job row."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.utils.module_loading import import_string


@dataclass(frozen=True)
class Exponential:
    """``base * factor ** (attempt - 1)`` seconds, capped, spread by +/- ``jitter``.

    Jitter keeps a burst of jobs that failed together (a database blip, an API
    outage) from all retrying in the same instant.
    """

    base: float = 2.0
    factor: float = 2.0
    max: float = 3600.0
    jitter: float = 0.25

    def __call__(self, attempt: int) -> float:
        delay = min(self.max, self.base * self.factor ** max(0, attempt - 1))
        if self.jitter:
            delay *= random.uniform(1 - self.jitter, 1 + self.jitter)
        return max(0.0, delay)


DEFAULT_BACKOFF = Exponential()

BackoffSpec = None | int | float | Exponential | Callable[[int], float]


def validate_backoff(value: Any) -> None:
    if value is None or isinstance(value, Exponential):
        return
    if isinstance(value, bool):
        raise ValueError("backoff must be a number of seconds, Exponential(...) or a function")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("backoff seconds must be >= 0")
        return
    if callable(value):
        path = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
        if "<" in path or not getattr(value, "__module__", None):
            raise ValueError(
                "a backoff function must be defined at module level so workers can import it"
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
    return {"path": f"{value.__module__}.{value.__qualname__}"}


def backoff_from_json(data: dict[str, Any] | None) -> Callable[[int], float]:
    if not data:
        return DEFAULT_BACKOFF
    if "fixed" in data:
        seconds = float(data["fixed"])
        return lambda attempt: seconds
    if "exponential" in data:
        return Exponential(**data["exponential"])
    if "path" in data:
        return import_string(data["path"])
    return DEFAULT_BACKOFF


def retry_delay(data: dict[str, Any] | None, attempt: int) -> float:
    """Seconds to wait before the attempt after ``attempt``; never negative."""
    return max(0.0, float(backoff_from_json(data)(attempt)))
