"""An enqueue's tries. An enqueue runs again where nothing of it was left: where the database
broke a deadlock by rolling all of it back, and where it found the row of a job it waits for
held by another transaction and rolled back to let go of everything it held
(:class:`ParentsBusy`, ``core.dependency_graph``). Both only in a transaction of its own:
inside the caller's ``atomic()`` the caller's work would go with it.

Used by every enqueue that owns its transaction: ``bulk_enqueue`` (``task.enqueue()`` too),
``workflow()`` / ``chain()`` and ``enqueue_batch()``, the last two around their own rows.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from django.db import OperationalError, connections

from django_jobs.core.uniqueness import retry_after


class ParentsBusy(Exception):
    """Another transaction holds the row of a job the enqueue waits for, and the enqueue
    asked not to wait for it (``lock_parents(wait=False)``): it rolls back and runs again."""


# An enqueue whose parents' rows another transaction holds runs again after about
# PARENTS_PAUSE seconds, twice as long each time up to PARENTS_PAUSE_MAX (each pause drawn
# between half and all of that, so that two enqueues that met do not meet again in step),
# and waits for the rows once PARENTS_PATIENCE seconds have gone: a finish holds them for
# milliseconds, and an enqueue that waits can meet a finish in a cycle again (the database
# then breaks it; docs/design.md, invariant 6).
PARENTS_PAUSE = 0.002
PARENTS_PAUSE_MAX = 0.05
PARENTS_PATIENCE = 2.0


def pause_for_parents(seconds: float) -> None:
    time.sleep(seconds)


def own_transaction(db: str) -> bool:
    """Whether a transaction begun now on ``db`` would be the caller's alone (autocommit,
    outside any ``atomic()``)."""
    connection = connections[db]
    return connection.get_autocommit() and not connection.in_atomic_block


def retried[T](db: str, attempt: Callable[[bool], T]) -> T:
    """``attempt(wait_for_parents)``, one try of an enqueue (its own transaction where
    :func:`own_transaction`), run again as the module's docstring says; its result."""
    own = own_transaction(db)
    wait_for_parents = not own
    busy_since: float | None = None
    busy = 0
    deadlocks = 1
    while True:
        try:
            return attempt(wait_for_parents)
        except ParentsBusy:
            if not own:  # only an enqueue of its own asks not to wait: not this one
                raise
            now = time.monotonic()
            busy_since = now if busy_since is None else busy_since
            if now - busy_since >= PARENTS_PATIENCE:
                wait_for_parents = True
            pause = min(PARENTS_PAUSE_MAX, PARENTS_PAUSE * 2**busy)
            pause_for_parents(random.uniform(pause / 2, pause))
            busy += 1
        except OperationalError as exc:
            if not retry_after(exc, deadlocks, own_transaction=own):
                raise
            deadlocks += 1
