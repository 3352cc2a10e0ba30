"""Tasks that bring the worst data a job can bring: importable by run_jobs subprocesses
as ``tests.hostile_tasks``.

Values go in as JSON text (an ordinary string argument, valid on every database) and
are decoded in the task, so that the task can return or raise what no argument could
carry: a NUL on PostgreSQL, NaN, a value nested 5,000 deep.
"""

from __future__ import annotations

import json
from typing import Any

from django_jobs import Snooze, set_progress, task


def decoded(text: str) -> Any:
    """``json.loads`` that also reads ``{"$nest": depth}`` as a list nested that deep (a
    JSON text of 5,000 brackets would hit the decoder's own recursion limit), and
    ``{"$chars": n}`` as a string of ``n`` characters (bigger than an argument may be)."""
    value = json.loads(text)
    if isinstance(value, dict) and set(value) == {"$chars"}:
        return "x" * value["$chars"]
    if isinstance(value, dict) and set(value) == {"$nest"}:
        nested: Any = []
        for _ in range(value["$nest"] - 1):
            nested = [nested]
        return nested
    return value


@task
def returns(encoded: str) -> Any:
    return decoded(encoded)


@task
def returns_a_set() -> Any:
    return {1, 2}


@task(max_attempts=3, backoff=0)
def raises(encoded: str) -> None:
    raise ValueError(decoded(encoded))


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


@task
def raises_unprintable() -> None:
    raise Unprintable()


@task
def reports_progress(encoded: str) -> str:
    set_progress(1, 2, decoded(encoded))
    return "reported"


@task
def reports_done(encoded: str) -> str:
    set_progress(decoded(encoded), None, "counting")
    return "reported"


@task(max_attempts=2, backoff=0)
def snoozes(encoded: str) -> None:
    raise Snooze(decoded(encoded))


@task(max_attempts=3)
def fails(message: str = "failed on purpose") -> None:
    raise RuntimeError(message)


@task
def canary() -> str:
    return "alive"


@task(concurrency_key="k:{key}", concurrency_limit=1)
def keyed(key: str) -> str:
    return key


@task
def breaks_the_completer() -> str:
    """Fault injection: what a bug of ours in the completer would do. It replaces the
    function the completer thread writes with, in the worker process that runs it, by one
    that raises: the thread cannot go on, and its process must not either."""
    from django_jobs.runtime import completer

    def broken(ctx: object, batch: object) -> None:
        raise RuntimeError("injected: the completer's write is broken")

    completer.write_isolated = broken  # type: ignore[assignment]
    return "sabotaged"
