"""SQLite: no row locks (a write transaction holds the whole database), so the portable
operations serve it as they are."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from django.db import OperationalError, connections
from django.db.models import Q

from django_jobs.db import base

# SQLite instructions between two calls of the progress handler that enforces a timeout.
PROGRESS_STEPS = 10_000


class Features(base.Features):
    pass


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
