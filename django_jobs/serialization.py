"""Checks that a call's arguments survive the trip through a JSON column unchanged."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.utils.json import normalize_json

from .exceptions import InvalidTaskArguments


def json_arguments(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Return the arguments as they will be stored, or raise a clear error now.

    Failing here, in the caller's request, beats failing in a worker hours later
    with the original values gone. The whole call is checked at once (the hot
    path); only when that fails is each argument checked alone, so the error
    can name the one at fault.
    """
    try:
        normalized_args = normalize_json(list(args))
        normalized_kwargs = normalize_json(dict(kwargs))
        text = json.dumps([normalized_args, normalized_kwargs], allow_nan=False)
        if json.loads(text) == [normalized_args, normalized_kwargs]:
            return normalized_args, normalized_kwargs
    except (TypeError, ValueError):
        pass
    raise argument_error(args, kwargs)


def argument_error(args: Any, kwargs: Any) -> InvalidTaskArguments:
    """The error for the first argument (positional, then keyword) that JSON would not keep."""
    if not isinstance(kwargs, Mapping):
        return InvalidTaskArguments(f"Task keyword arguments must be a dict, not {kwargs!r:.60}")
    for name in kwargs:
        if not isinstance(name, str):
            return InvalidTaskArguments(f"Task keyword argument names must be strings: {name!r}")
    labelled = [(f"positional argument {index}", value) for index, value in enumerate(args)]
    labelled += [(f"keyword argument {name!r}", value) for name, value in kwargs.items()]
    for label, value in labelled:
        problem = json_problem(value)
        if problem is not None:
            return InvalidTaskArguments(f"Task {label} {problem}")
    return InvalidTaskArguments("Task arguments must be JSON serializable")


def json_problem(value: Any) -> str | None:
    """Why ``value`` would not come back from JSON as it went in, or None if it would."""
    try:
        normalized = normalize_json(value)
        text = json.dumps(normalized, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"is not JSON serializable: {exc}"
    if json.loads(text) != normalized:
        return f"would change in JSON (dict keys must be strings): {text[:200]}"
    return None


def json_return_value(value: Any) -> Any:
    """The JSON form of a task's return value; raise if it has none."""
    try:
        normalized = normalize_json(value)
        json.dumps(normalized, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Task return value must be JSON serializable: {exc}") from exc
    return normalized
