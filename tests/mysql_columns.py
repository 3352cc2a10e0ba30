"""A MySQL/MariaDB column changed for one test and put back as it was, collation and all.

``ALTER TABLE ... MODIFY`` replaces the whole column definition: a definition written from the
model field alone drops the binary collation migrations 0016 and 0018 gave the key and queue
columns, and every later test on the same test database then compared queue names without
regard to case (tests/test_queue_case.py failed, in CI, after a fixture that shortened a queue
column). The definition is read from the server before and written back after, and the
restore is checked against it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection
from django.db.models import Model


def column_definition(model: type[Model], column: str) -> tuple[str, str, str, str]:
    """The column's type, nullability, character set and collation, as the server has them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_type, is_nullable, character_set_name, collation_name "
            "FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
            [model._meta.db_table, column],
        )
        (found,) = cursor.fetchall()
    return found


def modify(model: type[Model], column: str, definition: str) -> None:
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"ALTER TABLE {quote(model._meta.db_table)} MODIFY {quote(column)} {definition}"
        )


@contextmanager
def column_changed(model: type[Model], column: str, definition: str) -> Iterator[None]:
    """``column`` of ``model``'s table redefined as ``definition`` inside the block; after it,
    the definition it had (fails if the server's copy differs from the one read before)."""
    before = column_definition(model, column)
    kind, nullable, charset, collation = before
    modify(model, column, definition)
    try:
        yield
    finally:
        charset_clause = f"CHARACTER SET {charset} COLLATE {collation} " if charset else ""
        modify(
            model,
            column,
            f"{kind} {charset_clause}{'NULL' if nullable == 'YES' else 'NOT NULL'}",
        )
        assert column_definition(model, column) == before
