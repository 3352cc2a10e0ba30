"""Retry delays, and their JSON form so a per-call override survives in the job row.

A job row's ``backoff`` is data, never code: anyone who can write a row (a bug, a
restored dump, a hand-edited admin field) must not be able to make a worker import
and call something by naming it. So a ``{"path": ...}`` backoff only selects the
function the job's own task declares, and every delay is bounded (``limits``)
before it reaches a datetime.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django_jobs.limits import MAX_SECONDS, check_seconds, is_number
from django_jobs.text import jobs_logger, safe_repr

logger = jobs_logger("django_jobs.backoff")

EXPONENTIAL_FIELDS = ("base", "factor", "max", "jitter")


def declared_seconds(value: Any, name: str, *, strict: bool = False) -> float:
    """``limits.check_seconds`` for a value someone declared, an int of any size included.

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


def retry_delay(data: dict[str, Any] | None, attempt: int, task_path: str | None = None) -> float:
    """Seconds to wait before the attempt after ``attempt``: finite, in ``[0, MAX_SECONDS]``.

    Never raises: it runs inside the transaction that records a failure, and an
    exception there would leave the job claimed by a worker that gave up on it.
    Whatever the row says that cannot be honoured (an unknown form, a bad number,
    a function that is not its task's, a function that fails) is logged and the
    default backoff is used instead. ``task_path``: the job's task, whose declared
    backoff function is the only one a ``{"path": ...}`` backoff may select.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        attempt = 1
    try:
        delay = clamped(row_delay(data, attempt, task_path))
        return default_delay(attempt) if delay is None else delay
    except Exception:  # a bug of ours must not cost the job its retry either
        logger.exception("backoff %s of a job of %s could not be read", safe_repr(data), task_path)
        return default_delay(attempt)


def row_delay(data: Any, attempt: int, task_path: str | None) -> float:
    if data is None or data == {}:
        return default_delay(attempt)
    if not isinstance(data, dict) or len(data) != 1:
        return unusable(data, task_path, attempt, "is not one of fixed, exponential or path")
    ((form, value),) = data.items()
    if form == "fixed":
        seconds = clamped(value)
        if seconds is None:
            return unusable(data, task_path, attempt, "is not a number of seconds")
        if seconds != value:
            logger.warning(
                "fixed backoff %r of a job of %s is out of range: %s seconds used",
                value,
                task_path,
                seconds,
            )
        return seconds
    if form == "exponential":
        if not isinstance(value, dict) or not set(value) <= set(EXPONENTIAL_FIELDS):
            return unusable(data, task_path, attempt, "has unknown fields")
        try:
            spec = Exponential(**value)
        except (TypeError, ValueError) as exc:
            return unusable(data, task_path, attempt, str(exc))
        return spec(attempt)
    if form == "path":
        function, reason = declared_function(value, task_path)
        if function is None:
            return unusable(data, task_path, attempt, reason)
        return called(function, attempt, task_path)
    return unusable(data, task_path, attempt, "is not one of fixed, exponential or path")


def declared_function(path: Any, task_path: str | None) -> tuple[Callable[[int], Any] | None, str]:
    """The backoff function the job's task declares, if ``path`` names it; else None and
    why not.

    The function is the task's own object, never imported from ``path``: a row
    naming ``os._exit`` gets nothing but a warning.
    """
    if not isinstance(path, str):
        return None, "does not name a function"
    if not isinstance(task_path, str):
        return None, "names a function, and no task was given to check it against"
    from django_jobs.exceptions import TaskNotFound
    from django_jobs.tasks.job_task import job_options
    from django_jobs.tasks.loading import load_task

    try:
        task = load_task(task_path)
    except TaskNotFound:
        return None, "names a function, and its task cannot be loaded to check it against"
    declared = job_options(task)["backoff"]
    if isinstance(declared, Exponential) or not callable(declared):
        return None, "names a function, and its task declares no backoff function"
    if function_path(declared) != path:
        return None, f"is not the backoff function its task declares ({function_path(declared)})"
    return declared, ""


def called(function: Callable[[int], Any], attempt: int, task_path: str | None) -> float:
    """``function(attempt)`` as seconds, or the default's when it fails or returns
    something that is not a finite number (its bugs are its task's, not the worker's)."""
    name = function_path(function)
    try:
        value = function(attempt)
    except (Exception, SystemExit):
        logger.warning(
            "backoff %s of %s raised: the default backoff is used", name, task_path, exc_info=True
        )
        return default_delay(attempt)
    seconds = clamped(value)
    if seconds is None or value in (math.inf, -math.inf):
        logger.warning(
            "backoff %s of %s returned %s, not a finite number of seconds: the default "
            "backoff is used",
            name,
            task_path,
            safe_repr(value),
        )
        return default_delay(attempt)
    return seconds


def unusable(data: Any, task_path: str | None, attempt: int, reason: str) -> float:
    logger.warning(
        "backoff %s of a job of %s %s: the default backoff is used",
        safe_repr(data),
        task_path,
        reason,
    )
    return default_delay(attempt)
