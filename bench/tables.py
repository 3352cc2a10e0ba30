"""The benchmarks' tables: found by app, emptied between runs, and only in a bench's database.

Every script here starts (and most end) on empty queues, so that no run reads another's
rows; each refuses a database whose name does not say it is there to be emptied.
"""

from __future__ import annotations

import sys

from django.apps import apps
from django.core.management.color import no_style
from django.db import connection


def tables_of(*labels: str) -> list[str]:
    """Every table of these apps (a proxy model has none of its own)."""
    return [
        model._meta.db_table
        for label in labels
        for model in apps.get_app_config(label).get_models()
        if not model._meta.proxy
    ]


def empty(tables: list[str]) -> None:
    """Empty ``tables`` (TRUNCATE where the database has it), their id sequences reset."""
    statements = connection.ops.sql_flush(
        no_style(), tables, reset_sequences=True, allow_cascade=True
    )
    connection.ops.execute_sql_flush(statements)


def refuse_unless_named(part: str = "bench") -> None:
    """Exit, saying why, unless the database's name contains ``part``."""
    name = str(connection.settings_dict["NAME"])
    if part not in name:
        sys.exit(f"the database's name must contain {part!r} (its tables are emptied): {name!r}")


def analyze(tables: list[str]) -> None:
    """Give freshly planted ``tables`` the statistics a table in service has.

    Autovacuum (PostgreSQL) and InnoDB's automatic statistics would get there
    on their own some time after a bulk load; without this, reads would be
    timed with plans made blind. SQLite is left as Django leaves it.
    """
    with connection.cursor() as cursor:
        for table in tables:
            quoted = connection.ops.quote_name(table)
            if connection.vendor == "postgresql":
                cursor.execute(f"VACUUM ANALYZE {quoted}")
            elif connection.vendor == "mysql":
                cursor.execute(f"ANALYZE TABLE {quoted}")
                cursor.fetchall()
