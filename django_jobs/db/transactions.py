"""One transaction for the worker's hot paths, without Django's autocommit toggles on MySQL.

``transaction.atomic()`` opens a transaction by turning the connection's
autocommit off and closes it by turning it back on. On PostgreSQL and SQLite
that is a flag in the driver; on MySQL and MariaDB each turn is a statement
(``SET autocommit=0``, ``SET autocommit=1``) and so a round trip: a claim or a
finish of a few short statements paid four round trips of bookkeeping where two
(``START TRANSACTION``, ``COMMIT``) open and close the same transaction. On
this project's 2-core bench machine, with the database on loopback, the drain
was bound by the workers' CPU and the saving did not show in its rate; across a
real network each round trip is latency a claim or a finish waits for
(docs/running.md, "What runs").

:func:`hot_transaction` opens the transaction with ``START TRANSACTION`` while
the session stays in autocommit, and tells Django it is in an atomic block
with autocommit off, so that everything inside behaves as in ``atomic()``:
nested ``atomic()`` blocks take real savepoints, a failed statement marks the
block for rollback, ``on_commit`` callbacks run after the commit (and are
dropped on rollback). Where it cannot do that exactly (another database, a
block already open, a connection not in autocommit) it *is* ``atomic()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, Error, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_jobs.db import features


@contextmanager
def hot_transaction(db: str, *, savepoint: bool = True) -> Iterator[None]:
    """``transaction.atomic(using=db, savepoint=savepoint)``, two round trips cheaper on
    MySQL/MariaDB.

    ``savepoint=False`` (the enqueue, as Django's own ``Model.save()``): inside a
    caller's block, no SAVEPOINT and RELEASE around the writes, two round trips on
    every database; a database error then marks the caller's whole block for
    rollback instead of only ours, which on PostgreSQL it already is.
    """
    connection = connections[db]
    if (
        not features(db).begins_transactions_by_statement
        or connection.in_atomic_block
        or not connection.get_autocommit()  # also opens the connection if need be
    ):
        with transaction.atomic(using=db, savepoint=savepoint):
            yield
        return
    with connection.cursor() as cursor:
        cursor.execute("START TRANSACTION")
    # Django's own state inside an outermost atomic(): what nested blocks, savepoints
    # and on_commit() read.
    connection.autocommit = False
    connection.in_atomic_block = True
    connection.commit_on_exit = True
    connection.needs_rollback = False
    committed = False
    try:
        try:
            yield
        except BaseException:
            end(connection, commit=False)
            raise
        if connection.needs_rollback:
            # A nested block failed and its error was caught: atomic() rolls back too.
            end(connection, commit=False)
        else:
            end(connection, commit=True)
            committed = True
    finally:
        connection.in_atomic_block = False
        connection.needs_rollback = False
        connection.savepoint_ids = []
        connection.autocommit = True
        if connection.closed_in_transaction:
            connection.closed_in_transaction = False
            connection.connection = None
        if not committed:
            connection.run_on_commit = []
    if committed:
        # As atomic() does, once the connection is out of the block.
        connection.run_and_clear_commit_hooks()


def end(connection: BaseDatabaseWrapper, *, commit: bool) -> None:
    """COMMIT or ROLLBACK, as ``atomic()`` ends its block: a failed COMMIT is rolled back
    and raised; a connection that cannot even roll back is closed (the server rolls
    back what it held), and for a ROLLBACK nothing is raised over the error that
    caused it. The driver's own calls, as Django's ``commit()``: the block may be
    marked for rollback, and Django's cursors refuse to run anything then."""
    if connection.closed_in_transaction or connection.connection is None:
        return  # the connection went away mid-block: the server has rolled back
    if commit:
        try:
            connection._commit()  # type: ignore[attr-defined]  # what atomic() calls
        except DatabaseError:
            end(connection, commit=False)
            raise
        return
    try:
        connection._rollback()  # type: ignore[attr-defined]  # what atomic() calls
    except Error:
        connection.close()
