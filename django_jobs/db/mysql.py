"""MariaDB and MySQL (InnoDB): locking reads lock every row they read, and rows are locked in
the order an index reads them, so deletes and multi-key locks are written to reach each row
by its own key."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, models
from django.db.models import QuerySet

from django_jobs.db import base
from django_jobs.db.base import RowT

if TYPE_CHECKING:
    from django_jobs.models import Job

# Migration 0013's procedure: one ready job and its ready row in one round trip.
ENQUEUE_PROCEDURE = "django_jobs_enqueue_ready"
# The server's "no such procedure" (a database migrated back before 0013).
NO_SUCH_PROCEDURE = 1305

# MariaDB's JSON_VALID refuses a document nested 32 levels deep.
MARIADB_MAX_JSON_DEPTH = 31


class Features(base.Features):
    locks_every_row_read = True
    begins_transactions_by_statement = True
    max_json_depth = MARIADB_MAX_JSON_DEPTH


class Operations(base.Operations):
    def lock_in_key_order(self, rows: QuerySet[RowT], keys: Iterable[str]) -> list[RowT]:
        """One point lookup per key, in Python's order: InnoDB locks rows in the order it
        reads them, the index's collation order (case-insensitive by default), so one
        statement could lock them in another order than every other path."""
        rows = rows.select_for_update()
        return [row for key in sorted(set(keys)) for row in rows.filter(key=key)]

    def delete_statement(self, table: str, column: str, count: int) -> str:
        """Delete by ids, reaching each row by its own key. A ``DELETE ... WHERE id IN
        (...)`` on a small table (the claims of a few workers, the tail of a drained ready
        table) runs as a full scan, and a DELETE, unlike an UPDATE, gets no
        semi-consistent read in READ COMMITTED: it waits for the lock of every row it
        reads, including the rows other workers hold. Two finishing workers, each scanning
        into the other's claims: a deadlock (tests/test_finish_races.py forces it). Here
        the ids are a derived table joined first (``STRAIGHT_JOIN``), so each row is
        reached by a primary-key lookup that locks that row alone."""
        derived = " UNION ALL ".join(["SELECT %s AS id_"] * count)
        return (
            f"DELETE rows_ FROM ({derived}) AS ids_ STRAIGHT_JOIN {table} AS rows_ "
            f"ON rows_.{column} = ids_.id_"
        )

    def delete_executions(
        self, db: str, model: type[models.Model], job_ids: Collection[int]
    ) -> int:
        return self.delete_where(db, model, "job_id", job_ids)

    def enqueue_ready(self, db: str, job: Job) -> bool:
        """Insert ``job`` (ready, no key, not unique) and its ready row with one ``CALL``
        (migration 0013): one round trip where START TRANSACTION, two INSERTs and COMMIT
        take four. In the caller's transaction (``atomic()``, or autocommit off) it
        writes under a savepoint of its own, rolled back on error, so a failed enqueue
        leaves neither row behind and the caller's transaction usable.

        Returns False, having written nothing, where the procedure is missing (not
        migrated, or the database user may not create routines) or does not take a
        column this job sets (a newer column than the procedure): the caller then
        takes the statements' path.
        """
        found = procedure_fields(db)
        if found is None:
            return False
        fields, unlisted = found
        if any(getattr(job, field.attname) is not None for field in unlisted):
            return False
        connection = connections[db]
        own_transaction = connection.get_autocommit() and not connection.in_atomic_block
        params = [own_transaction]
        params += [
            field.get_db_prep_save(getattr(job, field.attname), connection) for field in fields
        ]
        placeholders = ", ".join(["%s"] * len(params))
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"CALL {ENQUEUE_PROCEDURE}({placeholders})", params)
                pk = cursor.fetchone()[0]
                while cursor.nextset():  # the CALL's own status: read, or the next statement fails
                    pass
        except DatabaseError as exc:
            if getattr(exc.__cause__, "args", (None,))[0] != NO_SUCH_PROCEDURE:
                raise
            _procedure_fields.pop(procedure_key(db), None)
            return False
        job.pk = pk
        job._state.adding = False
        job._state.db = db
        return True


def procedure_key(db: str) -> tuple[str, Any]:
    """A cache key per alias and database (a test run switches the alias's NAME)."""
    return db, connections[db].settings_dict["NAME"]


Fields = tuple["models.Field[Any, Any]", ...]
_procedure_fields: dict[tuple[str, Any], tuple[Fields, Fields] | None] = {}


def procedure_fields(db: str) -> tuple[Fields, Fields] | None:
    """The job fields the procedure takes, in its order (after ``own_transaction``), and
    those it does not take (none, until a migration adds a job column), read once per
    database from information_schema; None without the procedure."""
    from django_jobs.models import Job

    key = procedure_key(db)
    if key not in _procedure_fields:
        with connections[db].cursor() as cursor:
            cursor.execute(
                "SELECT parameter_name FROM information_schema.parameters "
                "WHERE specific_schema = DATABASE() AND specific_name = %s "
                "AND routine_type = 'PROCEDURE' ORDER BY ordinal_position",
                [ENQUEUE_PROCEDURE],
            )
            names = [row[0] for row in cursor.fetchall()]
        by_column = {field.column: field for field in Job._meta.concrete_fields}
        columns = [name.removeprefix("p_") for name in names[1:]]
        known = bool(names) and names[0] == "own_transaction"
        if not known or any(column not in by_column for column in columns):
            _procedure_fields[key] = None
        else:
            taken = tuple(by_column[column] for column in columns)
            unlisted = tuple(
                field
                for field in Job._meta.concrete_fields
                if field not in taken and not field.primary_key
            )
            _procedure_fields[key] = (taken, unlisted)
    return _procedure_fields[key]
