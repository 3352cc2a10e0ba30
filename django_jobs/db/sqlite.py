"""SQLite: no row locks (a write transaction holds the whole database), so the portable
operations serve it as they are, and a fair group's stamp is read and written back by two
plain statements (``fair_group_state``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from functools import cache
from typing import Any

from django.db import OperationalError, connections
from django.db.models import Q

from django_jobs.db import base

# SQLite instructions between two calls of the progress handler that enforces a timeout.
PROGRESS_STEPS = 10_000


class Features(base.Features):
    writes_hold_the_database = True


class Operations(base.Operations):
    def prefix_condition(self, field: str, prefix: str) -> Q:
        """A range of the column's BINARY order (byte order of UTF-8, that is code point
        order), which its btree serves; ``LIKE`` would ignore the case of ASCII letters and
        take no index."""
        upper = after_prefix(prefix)
        condition = Q(**{f"{field}__gte": prefix})
        return condition if upper is None else condition & Q(**{f"{field}__lt": upper})

    def statement_timeout(self, db: str, seconds: float) -> AbstractContextManager[None]:
        return progress_deadline(db, seconds)

    def is_statement_timeout(self, error: BaseException) -> bool:
        return isinstance(error, OperationalError) and "interrupted" in str(error)

    def fair_group_state(
        self, db: str, queue: str, priority: int, key: str
    ) -> tuple[int | None, bool, int | None, bool]:
        """One statement where the ORM's stamping takes four (upsert, read, head, waiting):
        a fair queue's single enqueue went at 0.37x a plain one's rate on SQLite, nearly all
        of it the ORM building those statements."""
        with connections[db].cursor() as cursor:
            cursor.execute(group_state_statement(db), [queue, priority, queue, priority, key])
            head, found, last, waiting = cursor.fetchone()
        return head, bool(found), last, bool(waiting)

    def write_fair_stamp(
        self, db: str, queue: str, priority: int, key: str, turn: int, job_id: int, now: datetime
    ) -> None:
        connection = connections[db]
        when = connection.ops.adapt_datetimefield_value(now)
        with connection.cursor() as cursor:
            cursor.execute(write_stamp_statement(db), [queue, priority, key, turn, job_id, when])


@cache
def group_state_statement(db: str) -> str:
    """``Operations.fair_group_state``'s read: the head from ``jobs_ready_poll``, the stamp
    by its unique key, the waiting job by its primary key."""
    from django_jobs.models import FairTurn, ReadyExecution

    quote = connections[db].ops.quote_name
    ready, fair = (quote(m._meta.db_table) for m in (ReadyExecution, FairTurn))
    return (
        f"SELECT level_.head, f.id IS NOT NULL, f.last_turn, EXISTS (SELECT 1 FROM {ready} "
        f"AS w WHERE w.job_id = f.last_job_id) FROM (SELECT (SELECT r.turn FROM {ready} AS r "
        f"WHERE r.queue_name = %s AND r.priority = %s ORDER BY r.turn LIMIT 1) AS head) "
        f"AS level_ LEFT JOIN {fair} AS f ON f.queue_name = %s AND f.priority = %s "
        f"AND f.fair_key = %s"
    )


@cache
def write_stamp_statement(db: str) -> str:
    from django_jobs.models import FairTurn

    quote = connections[db].ops.quote_name
    return (
        f"INSERT INTO {quote(FairTurn._meta.db_table)} (queue_name, priority, fair_key, "
        f"last_turn, last_job_id, updated_at) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT "
        f"(queue_name, priority, fair_key) DO UPDATE SET last_turn = excluded.last_turn, "
        f"last_job_id = excluded.last_job_id, updated_at = excluded.updated_at"
    )


def after_prefix(prefix: str) -> str | None:
    """The smallest string greater than every string that starts with ``prefix``: its last
    character that can grow, grown by one code point (surrogates skipped); None if none can
    (every string from ``prefix`` on matches)."""
    chars = list(prefix)
    while chars:
        code = ord(chars[-1]) + 1
        if 0xD800 <= code <= 0xDFFF:
            code = 0xE000
        if code <= 0x10FFFF:
            chars[-1] = chr(code)
            return "".join(chars)
        chars.pop()
    return None


@contextmanager
def progress_deadline(db: str, seconds: float) -> Iterator[None]:
    """A progress handler that interrupts a statement running past ``seconds`` (SQLite has
    no timeout of its own); each statement gets its own deadline, set as it is executed."""
    connection = connections[db]
    connection.ensure_connection()
    raw: Any = connection.connection
    deadline = [time.monotonic() + seconds]

    def interrupt() -> int:
        return 1 if time.monotonic() > deadline[0] else 0

    def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        deadline[0] = time.monotonic() + seconds
        return execute(sql, params, many, context)

    raw.set_progress_handler(interrupt, PROGRESS_STEPS)
    try:
        with connection.execute_wrapper(timed):
            yield
    finally:
        raw.set_progress_handler(None, PROGRESS_STEPS)
