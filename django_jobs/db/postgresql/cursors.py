"""Cursors for the hot statements on PostgreSQL: the enqueue's insert and the worker's claim,
start and finish, the statements run once per job or per batch of jobs."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

try:
    from django.db.backends.postgresql.base import ServerBindingCursor
except (ImportError, ImproperlyConfigured):  # psycopg2 (Django's cursors only), or no driver
    ServerBindingCursor = None  # type: ignore[assignment,misc]  # the usual optional import

if ServerBindingCursor is not None:

    class NeverPreparedCursor(ServerBindingCursor):
        """Server-side binding, but never a prepared statement, whatever
        ``prepare_threshold`` says: the server plans each execution for the tables
        as they are then."""

        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            # django-stubs types Django's cursor classes without psycopg's methods.
            return super().execute(query, params, **{**kwargs, "prepare": False})  # type: ignore[misc]

else:  # pragma: no cover - no psycopg 3
    NeverPreparedCursor = None  # type: ignore[assignment,misc]


def bound_cursor(connection: BaseDatabaseWrapper) -> CursorWrapper:
    """A cursor that sends its parameters apart from the statement (server-side binding),
    whatever ``OPTIONS["server_side_binding"]`` says, wrapped as Django wraps its own (so
    query logging, ``execute_wrapper`` and error translation apply).

    Only such a statement can be prepared: psycopg prepares it on the server after
    the connection's ``prepare_threshold`` executions, and never when that is None,
    Django's default, which keeps transaction-mode poolers working (docs/deployment.md).
    A prepared statement skips the parse and plan of every use after the first few:
    3,100 to 4,500 single enqueue inserts/s on one connection, measured with psycopg
    alone. Unprepared, the parameters still travel apart, never quoted into the
    statement's text by Python: a tenth of a worker's CPU per no-op job went to that.
    """
    return wrapped(connection, ServerBindingCursor)


def unprepared_cursor(connection: BaseDatabaseWrapper) -> CursorWrapper:
    """:func:`bound_cursor`, but its statements are never prepared.

    For a statement a worker runs while its queue is idle: the claim. A prepared
    statement's plan is made generic after five executions and kept for the
    connection's life (until the server invalidates it, as ANALYZE does). Built
    while the ready and job tables were nearly empty, that plan reads both whole
    (a sequential scan and a hash join) where the claim needs a few rows by key:
    when the backlog came, each claim cost 3.7 to 4.1 ms on the server instead of
    0.7 to 0.9 (pg_stat_statements, 10,000 ready jobs), and which plan a worker got
    depended on when its connection had prepared it. Unprepared, the server plans
    each claim (0.44 ms, the statement's planning time measured the same way) for
    the tables as they are. Statements that run only when there are jobs (a start,
    a finish) keep :func:`bound_cursor`: they are first planned with rows present.
    """
    return wrapped(connection, NeverPreparedCursor)


def wrapped(connection: BaseDatabaseWrapper, cursor_class: Any) -> CursorWrapper:
    """A ``cursor_class`` cursor on the connection, wrapped as Django wraps its own;
    Django's own cursor where psycopg 3 is missing (``cursor_class`` None)."""
    if cursor_class is None:
        return connection.cursor()
    connection.ensure_connection()
    cursor = cursor_class(connection.connection)  # psycopg's Cursor(connection)
    return connection._prepare_cursor(cursor)  # type: ignore[attr-defined]  # what cursor() does
