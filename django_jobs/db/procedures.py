"""Installing MariaDB/MySQL's stored procedures (migrations 0013 to 0015) where the database
user may, and saying what is lost where it may not.

Each procedure saves round trips on a hot path (the enqueue, the claim, the finish); the
portable path does the same work without it. A user without the CREATE ROUTINE privilege
(a managed database, a locked-down account) gets a warning at migrate time, not a failed
migration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError

# The errors of a user who may not create a routine: 1044 (no access to the schema), 1142
# (no such command privilege), 1227 (SUPER needed), 1419 (binary logging without SUPER).
NOT_ALLOWED = (1044, 1142, 1227, 1419)


def install_procedure(
    schema_editor: Any,
    name: str,
    sql: Callable[[], str],
    *,
    migration: str,
    without_it: str,
) -> None:
    """Create (again) procedure ``name`` from ``sql()``, on MySQL/MariaDB only; warn, naming
    ``migration`` and what runs ``without_it``, where the user may not."""
    if schema_editor.connection.vendor != "mysql":
        return
    try:
        schema_editor.execute(f"DROP PROCEDURE IF EXISTS {name}")
        schema_editor.execute(sql())
    except DatabaseError as exc:
        if not exc.args or exc.args[0] not in NOT_ALLOWED:
            raise
        logging.getLogger("django_jobs").warning(
            "migration %s: the database user may not create the procedure %s (%s); "
            "%s (docs/deployment.md)",
            migration,
            name,
            exc,
            without_it,
        )


def remove_procedure(schema_editor: Any, name: str) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    schema_editor.execute(f"DROP PROCEDURE IF EXISTS {name}")
