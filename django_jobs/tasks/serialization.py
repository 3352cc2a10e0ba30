"""Checks that a call's arguments, and a task's return value, survive the trip through a
JSON column unchanged, on the database that will store them.

Each database refuses something the others take: PostgreSQL's ``jsonb`` has no
room for a NUL character (``\\u0000``), MariaDB's ``JSON_VALID`` check refuses
documents nested 32 levels deep, and every database has some size it will not
take in one statement. A value refused by the database is found here, in the
thread of the call that made it, with an error that names the value: never as a
failed statement in a worker's shared finish, which once stopped the worker for
good (docs/design.md, invariant 10).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, cast

from django.db import connections
from django.utils.json import normalize_json

from django_jobs.conf import size_limit
from django_jobs.db import features
from django_jobs.db.base import JSON_MAX_DEPTH
from django_jobs.exceptions import InvalidTaskArguments, ResultNotStored
from django_jobs.text import safe_repr

# Levels of nesting a stored document may have (``features(db).max_json_depth``: 31 on
# MariaDB, whose JSON_VALID refuses 32; elsewhere 100 keeps Python's own recursion far from
# its limit).
MAX_DEPTH = JSON_MAX_DEPTH
# What Python's own recursion (normalize_json, json.dumps) says of a value nested hundreds
# of levels deep, or of one that contains itself: no walk of ours runs before it, so that
# the common value costs nothing more.
TOO_DEEP = f"is nested more than {MAX_DEPTH} levels deep"
ARGUMENTS_SIZE = "max_arguments_size"
RESULT_SIZE = "max_result_size"


def max_depth(db: str | None) -> int:
    """How deeply a document stored through ``db`` may nest."""
    return MAX_DEPTH if db is None else features(db).max_json_depth


def refuses_nul(db: str | None) -> bool:
    """PostgreSQL's ``jsonb`` refuses ``\\u0000``; the others store it."""
    return db is not None and features(db).refuses_nul_in_text


def display_name(db: str | None) -> str:
    """The database's name for a message (read only then: on MariaDB it may need the
    server's version, a query)."""
    return "this database" if db is None else connections[db].display_name


def depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar: 0, ``[]``: 1), without recursion: a value
    nested 5,000 deep must get an answer, not a ``RecursionError``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level) for child in children)
    return deepest


def has_nul(value: Any) -> bool:
    """A NUL in any string of ``value``, keys included (the JSON text alone cannot tell a
    NUL, ``\\u0000``, from a backslash followed by ``u0000``)."""
    return any("\x00" in text for text in strings(value))


def has_lone_surrogate(value: Any) -> bool:
    """A string of ``value`` (keys included) that UTF-8 cannot encode."""
    for text in strings(value):
        try:
            text.encode()
        except UnicodeEncodeError:
            return True
    return False


def strings(value: Any) -> Iterator[str]:
    """Every string in ``value``, keys included, without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def storage_problem(
    text: str, value: Any, db: str | None, setting: str, limit: int, base: int = 0
) -> str | None:
    """Why the JSON ``text`` of ``value`` would not be stored through ``db``, or None.

    ``setting``: the size limit's name in ``DJANGO_JOBS``, ``limit`` its value.
    ``base``: levels the column adds around ``value`` (the arguments' list). The
    nesting is only walked when the text has enough brackets to be too deep, so the
    common call costs two substring counts.
    """
    # json.dumps escapes every non-ASCII character: a character of the text is a byte.
    if len(text) > limit:
        return (
            f"takes {len(text):,} bytes of JSON, over the limit of {limit:,} bytes "
            f"(DJANGO_JOBS[{setting!r}])"
        )
    # A lone surrogate is no text: PostgreSQL refuses it, UTF-8 cannot encode it. Every
    # non-ASCII character is escaped as \\uXXXX, so only text with one of \\ud000-\\udfff
    # (Hangul too) is walked.
    if "\\ud" in text and has_lone_surrogate(value):
        return "contains a lone surrogate (a half of a UTF-16 pair), which is not text"
    if refuses_nul(db) and "\\u0000" in text and has_nul(value):
        return f"contains a NUL character (\\x00), which {display_name(db)} cannot store in JSON"
    allowed = max_depth(db)
    if text.count("[") + text.count("{") > allowed - base:
        found = depth(value)
        if found + base > allowed:
            where = f"{display_name(db)}'s JSON" if allowed < MAX_DEPTH else "a job"
            return f"is nested {found} levels deep; {where} holds at most {allowed - base}"
    return None


def json_arguments(
    args: Any, kwargs: Any, db: str | None = None
) -> tuple[list[Any], dict[str, Any]]:
    """Return the arguments as they will be stored through ``db``, or raise a clear error now.

    Failing here, in the caller's request, beats failing in a worker hours later
    with the original values gone. The whole call is checked at once (the hot
    path); only when that fails is each argument checked alone, so the error
    can name the one at fault. Without ``db`` (a system check, before any
    database is chosen) only what every database refuses is checked.
    """
    limit = size_limit(ARGUMENTS_SIZE)
    try:
        normalized_args = normalize_json(list(args))
        normalized_kwargs = normalize_json(dict(kwargs))
        text = json.dumps([normalized_args, normalized_kwargs], allow_nan=False)
        if (
            json.loads(text) == [normalized_args, normalized_kwargs]
            and storage_problem(text, normalized_args, db, ARGUMENTS_SIZE, limit) is None
            and (
                not normalized_kwargs
                or storage_problem(text, normalized_kwargs, db, ARGUMENTS_SIZE, limit) is None
            )
        ):
            return cast(list, normalized_args), cast(dict, normalized_kwargs)
    except (TypeError, ValueError, RecursionError):
        pass
    raise argument_error(args, kwargs, db, limit)


def argument_error(
    args: Any, kwargs: Any, db: str | None = None, limit: int | None = None
) -> InvalidTaskArguments:
    """The error for the first argument (positional, then keyword) that JSON would not
    keep, or the database would not store; or for the call as a whole."""
    if not isinstance(kwargs, Mapping):
        return InvalidTaskArguments(
            f"Task keyword arguments must be a dict, not {safe_repr(kwargs, 60)}"
        )
    for name in kwargs:
        if not isinstance(name, str):
            return InvalidTaskArguments(f"Task keyword argument names must be strings: {name!r}")
    labelled = [(f"positional argument {index}", value) for index, value in enumerate(args)]
    labelled += [(f"keyword argument {name!r}", value) for name, value in kwargs.items()]
    limit = limit or size_limit(ARGUMENTS_SIZE)
    for label, value in labelled:
        problem = json_problem(value, db, limit, base=1)
        if problem is not None:
            return InvalidTaskArguments(f"Task {label} {problem}")
    return InvalidTaskArguments(
        f"Task arguments take more than {limit:,} bytes of JSON in all "
        f"(DJANGO_JOBS[{ARGUMENTS_SIZE!r}])"
    )


def json_problem(value: Any, db: str | None = None, limit: int = 0, base: int = 0) -> str | None:
    """Why ``value`` would not come back from JSON as it went in, or would not be stored
    through ``db`` (nested ``base`` levels deep in its column), or None if it would."""
    try:
        normalized = normalize_json(value)
        text = json.dumps(normalized, allow_nan=False)
    except RecursionError:
        return TOO_DEEP
    except (TypeError, ValueError) as exc:
        return f"is not JSON serializable: {exc}"
    if json.loads(text) != normalized:
        return f"would change in JSON (dict keys must be strings): {text[:200]}"
    return storage_problem(
        text, normalized, db, ARGUMENTS_SIZE, limit or size_limit(ARGUMENTS_SIZE), base
    )


def json_return_value(value: Any, db: str | None = None, limit: int | None = None) -> Any:
    """The JSON form of a task's return value, as ``db`` will store it; raise
    ``ResultNotStored`` naming the reason if it cannot be stored.

    Called in the job's own thread, before the success joins a shared finish: a
    value the database would refuse fails its own job, not the batch of every job
    that finished beside it.
    """
    limit = limit or size_limit(RESULT_SIZE)
    try:
        normalized = normalize_json(value)
        text = json.dumps(normalized, allow_nan=False)
    except RecursionError:
        raise ResultNotStored(f"the return value {TOO_DEEP}") from None
    except (TypeError, ValueError) as exc:
        raise ResultNotStored(f"the return value is not JSON serializable: {exc}") from None
    problem = storage_problem(text, normalized, db, RESULT_SIZE, limit)
    if problem is not None:
        raise ResultNotStored(f"the return value {problem}")
    return normalized
