"""Checks that a call's arguments survive the trip through a JSON column unchanged."""

from __future__ import annotations

import json
from typing import Any

from django.utils.json import normalize_json

from .exceptions import InvalidTaskArguments


def json_arguments(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Return the arguments as they will be stored, or raise a clear error now.

    Failing here, in the caller's request, beats failing in a worker hours later
    with the original values gone.
    """
    try:
        normalized_args = normalize_json(list(args))
        normalized_kwargs = normalize_json(dict(kwargs))
        text = json.dumps([normalized_args, normalized_kwargs], allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidTaskArguments(f"Task arguments must be JSON serializable: {exc}") from exc
    if json.loads(text) != [normalized_args, normalized_kwargs]:
        raise InvalidTaskArguments(
            f"Task arguments would change in JSON (dict keys must be strings): {text[:200]}"
        )
    return normalized_args, normalized_kwargs


def json_return_value(value: Any) -> Any:
    """The JSON form of a task's return value; raise if it has none."""
    try:
        normalized = normalize_json(value)
        json.dumps(normalized, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Task return value must be JSON serializable: {exc}") from exc
    return normalized
