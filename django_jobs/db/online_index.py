"""Migration operations that build an index on a big, busy table without stopping its
writes: PostgreSQL ``CREATE INDEX CONCURRENTLY IF NOT EXISTS`` (an invalid index left by an
interrupted build is dropped first), MySQL/MariaDB ``ALGORITHM=INPLACE, LOCK=NONE`` (online
DDL: inserts go on while it builds), SQLite as usual. The model state moves as Django's own
``AddIndex`` and ``RemoveIndex`` move it, so ``makemigrations --check`` stays clean.

A migration using them sets ``atomic = False``: PostgreSQL refuses ``CONCURRENTLY`` inside a
transaction. An index with ``vendors`` (:class:`django_jobs.db.indexes.PostgresIndex`) is
built on those vendors only.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def builds_here(index: models.Index, vendor: str) -> bool:
    vendors = getattr(index, "vendors", None)
    return vendors is None or vendor in vendors


def create_online(model: type[models.Model], index: models.Index, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        drop_invalid(schema_editor, index.name)
        sql = str(index.create_sql(model, schema_editor, concurrently=True))
        sql = sql.replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1)
    elif connection.vendor == "mysql":
        sql = f"{index.create_sql(model, schema_editor)} ALGORITHM=INPLACE LOCK=NONE"
    else:
        sql = str(index.create_sql(model, schema_editor))
    schema_editor.execute(sql, params=None)


def drop_invalid(schema_editor: Any, name: str) -> None:
    """An interrupted ``CREATE INDEX CONCURRENTLY`` leaves an invalid index of that name,
    which ``IF NOT EXISTS`` would keep: dropped, so the build starts over."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_index JOIN pg_class ON pg_class.oid = pg_index.indexrelid "
            "WHERE pg_class.relname = %s AND NOT pg_index.indisvalid",
            [name],
        )
        invalid = cursor.fetchone() is not None
    if invalid:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(name)}")


def drop_online(model: type[models.Model], index: models.Index, schema_editor: Any) -> None:
    connection = schema_editor.connection
    name = schema_editor.quote_name(index.name)
    if connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
    elif connection.vendor == "mysql":
        table = schema_editor.quote_name(model._meta.db_table)
        # ALTER TABLE, not DROP INDEX: MariaDB's DROP INDEX takes no ALGORITHM or LOCK
        # (a syntax error on 10.11, which only a migration back found).
        schema_editor.execute(
            f"ALTER TABLE {table} DROP INDEX {name}, ALGORITHM=INPLACE, LOCK=NONE"
        )
    else:
        schema_editor.remove_index(model, index)


class AddIndexOnline(migrations.AddIndex):
    """``AddIndex`` built without blocking the table's writes, on the vendors it is for."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and builds_here(
            self.index, schema_editor.connection.vendor
        ):
            create_online(model, self.index, schema_editor)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model) and builds_here(
            self.index, schema_editor.connection.vendor
        ):
            drop_online(model, self.index, schema_editor)
