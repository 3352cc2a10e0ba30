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
from dataclasses import dataclass
from typing import cast

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError

from django_jobs.text import clip, jobs_logger, safe_str

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


@dataclass
class BodyEnd:
    """How a job's body ended under :func:`run_body`."""

    value: object = None
    # What the body raised (its outcome is then a failure, or a snooze).
    raised: BaseException | None = None
    # Inside a test's transaction only: why the body's writes were rolled back, which a
    # worker, in autocommit, would not have done (None: they were kept).
    rolled_back: str | None = None


def run_body(db: str, body: Callable[[], object]) -> BodyEnd:
    """Run a job's body as a worker would, in autocommit as far as a test allows.

    In a worker a body's writes commit as they are made, so a body that raises keeps
    what it wrote before the error. Inside a test's transaction the body runs in a
    savepoint that is released whatever it raises, so its writes stay too, unless a
    database error left the transaction unusable: Django marks an atomic block for
    rollback when an ORM write fails in it (``needs_rollback``, on every database, even
    if the body caught the error; its next query then raises
    ``TransactionManagementError``), and on PostgreSQL any failed statement aborts the
    transaction. Then the savepoint is rolled back, the body's writes with it, and
    ``rolled_back`` says why: Django's ``TestCase`` does the same to code that catches
    an ``IntegrityError`` without an ``atomic()`` of its own.

    The body's block counts as the test case's own when the block around it is
    (``Atomic._from_testcase``), so that a ``transaction.atomic(durable=True)`` in the
    body is allowed wherever it is allowed in the test itself. The ``on_commit``
    callbacks the body registered then run, as :func:`step`'s.
    """
    connection = connections[db]
    end = BodyEnd()
    if not connection.in_atomic_block:
        try:
            end.value = body()
        except BaseException as exc:  # the body's error is the job's outcome
            end.raised = exc
        return end
    start = len(connection.run_on_commit)
    block = transaction.atomic(using=db)
    if connection.atomic_blocks and getattr(connection.atomic_blocks[-1], "_from_testcase", False):
        block._from_testcase = True  # type: ignore[attr-defined]  # Django's own flag
    try:
        with block:
            try:
                end.value = body()
            except BaseException as exc:  # the body's error is the job's outcome
                end.raised = exc
            if connection.needs_rollback:
                end.rolled_back = MARKED_FOR_ROLLBACK
                if isinstance(end.raised, TransactionManagementError):
                    end.rolled_back += QUERIES_REFUSED
    except DatabaseError as exc:
        # atomic() could not release the savepoint (PostgreSQL, after a failed
        # statement) and rolled it back.
        end.rolled_back = (
            f"the database refused to go on after an error in its body "
            f"({type(exc).__name__}: {clip(safe_str(exc), 300)})"
        )
    run_callbacks_since(connection, start)
    return end


# Why a body's writes were rolled back, for JobRun.rolled_back.
MARKED_FOR_ROLLBACK = (
    "a database error in its body marked the test's transaction for rollback (Django "
    "does so when an ORM query fails inside atomic(), even if the error is caught)"
)
QUERIES_REFUSED = (
    "; its TransactionManagementError is that mark too: in a worker, in autocommit, "
    "the queries after the caught error would have run"
)


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
