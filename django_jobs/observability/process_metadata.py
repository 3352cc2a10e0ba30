"""What a process's row says of itself in its ``metadata`` JSON, read so that no value in
it can make a page, a command or a scrape fail.

``run_jobs`` writes the metadata when a process registers (``runtime/registration.py``:
``queues``, ``threads``, ``async_jobs``; ``single_process`` for the worker of
``--single-process``) and a worker's loop monitor merges in what its event loop went
through (``runtime/loop_monitor.py``: ``loop_stalls``, ``loop_stalled_seconds``). But the
column is JSON anyone can edit, so a reader takes nothing on trust: the metadata may be
a list or a string, a count may be ``"3"``, ``-1``, ``true``, ``1e400`` (read as infinity
on MariaDB and SQLite, as a 401-digit integer on PostgreSQL, which ``float()`` refuses) or
an integer past what a float holds exactly. Each figure is read here as a number in its
range or ``None`` ("unknown"), which every surface shows as such: ``manage.py jobs`` a
``?`` and ``null``, the admin "unknown", the metrics no sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django_jobs.limits import MAX_ASYNC_JOBS, MAX_SECONDS, is_number
from django_jobs.models import Process

# The largest count read: every integer up to it is exact as a float (a Prometheus sample)
# and as a number in any JSON reader. A loop that stalls once a millisecond for a century
# counts 3 x 10**12, far below.
MAX_COUNT = 2**53 - 1


def as_mapping(metadata: Any) -> dict[str, Any]:
    """The metadata as a dict; ``{}`` for anything else (a list, a string, null)."""
    return metadata if isinstance(metadata, dict) else {}


def bounded_count(value: Any, maximum: int = MAX_COUNT) -> int | None:
    """``value`` as a count in ``[0, maximum]``, or None: an int (not a bool), or a float
    with no fraction (JSON has one kind of number; ``3.0`` is 3)."""
    if not is_number(value):
        return None
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            return None
        value = int(value)
    # Compared as ints: ``float(10**400)`` would raise OverflowError.
    return value if 0 <= value <= maximum else None


def bounded_seconds_or_none(value: Any) -> float | None:
    """``value`` as seconds in ``[0, MAX_SECONDS]`` (a century), or None. An int is compared
    before it is made a float, which an int past a float's range cannot become."""
    if not is_number(value):
        return None
    if isinstance(value, int):
        return float(value) if 0 <= value <= MAX_SECONDS else None
    return value if math.isfinite(value) and 0.0 <= value <= MAX_SECONDS else None


def served_queues(metadata: Any) -> tuple[str, ...]:
    """The ``--queues`` patterns a worker said it serves: its ``queues`` list's strings
    (anything else in it, or a ``queues`` that is no list, says nothing)."""
    queues = as_mapping(metadata).get("queues")
    if not isinstance(queues, list):
        return ()
    return tuple(queue for queue in queues if isinstance(queue, str))


def is_single_process(metadata: Any) -> bool:
    """Whether the row is the worker of ``run_jobs --single-process`` (or ``--once``), whose
    dispatcher (and scheduler) run as its threads."""
    return bool(as_mapping(metadata).get("single_process"))


@dataclass(frozen=True)
class AsyncLoop:
    """A worker's event loop of ``async def`` jobs, as its row says.

    ``async_jobs``: how many it runs at once (0: they run on its threads; None: its row
    does not say, e.g. a worker of a version before the event loop). ``stalls``: how many
    times the loop was held longer than ``event_loop_block_threshold`` since the process
    started, ``stalled_seconds`` for how long in all (0 until the first; None: the row
    holds something that is not a count, or not seconds).
    """

    async_jobs: int | None
    stalls: int | None
    stalled_seconds: float | None

    @property
    def stalled(self) -> bool:
        """True when the loop was held at least once: what the pages flag."""
        return bool(self.stalls)


def async_loop(kind: str, metadata: Any) -> AsyncLoop | None:
    """The event loop of a worker's row; None for the other kinds, which run no job."""
    if kind != Process.Kind.WORKER:
        return None
    values = as_mapping(metadata)
    return AsyncLoop(
        async_jobs=bounded_count(values.get("async_jobs"), MAX_ASYNC_JOBS),
        stalls=bounded_count(values.get("loop_stalls", 0)),
        stalled_seconds=bounded_seconds_or_none(values.get("loop_stalled_seconds", 0.0)),
    )
