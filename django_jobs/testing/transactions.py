"""The runner's steps as commits, inside a test's transaction or outside one.

A worker runs each step of the state machine (a claim, a start, a finish) in a
transaction of its own, and what a step leaves for after its commit (``on_commit``: the
admission of a released dependent with a concurrency key, the cancel of what is left of
an ended workflow, a job body's ``enqueue_on_commit``) runs when it commits. Inside a
``TestCase`` nothing commits: the test's transaction is rolled back at its end, and those
callbacks would never run. So, inside an atomic block, each step here is a savepoint
(an error in it leaves the test's transaction usable) and the callbacks the step
registered are run after it, as a commit would run them, then dropped, so that nothing
runs them a second time (a ``captureOnCommitCallbacks(execute=True)`` around the call,
an outer block that commits). Callbacks registered before the step, by the test's own
code, are left where they are. Outside an atomic block (``TransactionTestCase``) each
step commits and Django runs its callbacks as it would in a worker.

``db.transactions.hot_transaction`` is ``atomic()`` inside a block already open, so its
own ``START TRANSACTION`` and ``COMMIT`` (MariaDB/MySQL) are only ever sent in autocommit,
where there is no test transaction for them to end; the stored procedures of migrations
0013 to 0015 likewise take a savepoint, not a transaction, inside one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.testing")


@contextmanager
def step(db: str) -> Iterator[None]:
    """One step of the state machine, committed as far as a test allows (above)."""
    connection = connections[db]
    if not connection.in_atomic_block:
        yield
        return
    start = len(connection.run_on_commit)
    with transaction.atomic(using=db):
        yield
    run_callbacks_since(connection, start)


def run_body[T](db: str, body: Callable[[], T]) -> T:
    """Run a job's body as a worker would, in autocommit as far as a test allows.

    In a worker a body's writes commit as they are made, so a body that raises keeps
    what it wrote before the error. Inside a test's transaction the body runs in a
    savepoint that is released whatever it raises, so its writes stay too, unless the
    body left the transaction unusable (on PostgreSQL, a database error it caught or let
    out): then the savepoint is rolled back, which a worker would not do, and a warning
    says so. The ``on_commit`` callbacks it registered then run, as :func:`step`'s.
    """
    connection = connections[db]
    if not connection.in_atomic_block:
        return body()
    start = len(connection.run_on_commit)
    raised: BaseException | None = None
    value: T | None = None
    try:
        with transaction.atomic(using=db):
            try:
                value = body()
            except BaseException as exc:  # the body's error is the job's outcome
                raised = exc
    except DatabaseError as exc:
        # atomic() could not release the savepoint and rolled it back.
        logger.warning(
            "the job's body left the test's transaction unusable (%s: %s); its writes "
            "were rolled back to keep the test going",
            type(exc).__name__,
            exc,
        )
    run_callbacks_since(connection, start)
    if raised is not None:
        raise raised
    return value  # type: ignore[return-value]  # set whenever nothing was raised


def run_callbacks_since(connection: BaseDatabaseWrapper, start: int) -> None:
    """Run, in order, the ``on_commit`` callbacks registered after the first ``start``
    ones (and those they register in turn), and drop them, as a commit does: a robust
    callback's error is logged, any other's raised (the rest are then dropped too)."""
    while len(connection.run_on_commit) > start:
        # (savepoint ids, callback, robust): django-stubs types the entries as pairs.
        pending = cast(
            list[tuple[object, Callable[[], object], bool]], connection.run_on_commit[start:]
        )
        del connection.run_on_commit[start:]
        for _, callback, robust in pending:
            if not robust:
                callback()
                continue
            try:
                callback()
            except Exception:
                name = getattr(callback, "__qualname__", callback)
                logger.exception("error calling %s in on_commit()", name)
