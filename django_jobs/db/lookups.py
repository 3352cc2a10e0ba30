"""Lookups of our own on the queue name columns, so that a name compares exactly on every
database."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import Field
from django.db.models.lookups import StartsWith


class ExactStartsWith(StartsWith):
    """``startswith`` by code points on SQLite too, where Django's ``LIKE`` ignores the case of
    ASCII letters: a worker of ``emails*`` claimed the jobs of ``Emails``. There it compares
    the name's first characters to the prefix (``substr() =``, the column's BINARY
    collation); elsewhere Django's own ``LIKE``, exact on PostgreSQL and, with the binary
    collation of migration 0018, on MySQL/MariaDB."""

    def as_sqlite(self, compiler: Any, connection: Any) -> tuple[str, Sequence[Any]]:
        if hasattr(self.rhs, "resolve_expression"):
            return super().as_sql(compiler, connection)
        lhs, lhs_params = self.process_lhs(compiler, connection)
        prefix = str(self.rhs)
        # Its length from Python (code points, as substr() counts them): SQLite's length()
        # stops at a NUL.
        return f"substr({lhs}, 1, %s) = %s", [*lhs_params, len(prefix), prefix]


def exact_prefixes(*fields: Field) -> None:
    """``startswith`` on these fields (instances, not their class: no other model's field
    changes) as :class:`ExactStartsWith`."""
    for field in fields:
        field.register_lookup(ExactStartsWith, "startswith")
