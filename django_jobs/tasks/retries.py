"""Reading a job row's backoff when its attempt fails: how long until the next one.

Apart from ``backoff`` (what a task declares) because reading a row needs the job's task
loaded, to honour only the backoff function that task declares: this module imports the
task's loading and options, which in turn import the declarations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from django_jobs.exceptions import TaskNotFound
from django_jobs.tasks.backoff import (
    EXPONENTIAL_FIELDS,
    Exponential,
    clamped,
    default_delay,
    function_path,
)
from django_jobs.tasks.job_task import job_options
from django_jobs.tasks.loading import load_task
from django_jobs.text import jobs_logger, safe_repr

logger = jobs_logger("django_jobs.backoff")


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
