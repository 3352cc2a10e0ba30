"""MariaDB and MySQL (InnoDB): locking reads lock every row they read, and rows are locked in
the order an index reads them, so deletes and multi-key locks are written to reach each row
by its own key."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, Error, connections, models
from django.db.models import Q, QuerySet

from django_jobs.core.fairness import warn_of_stamp
from django_jobs.db import base, enqueue_procedure
from django_jobs.db.base import RowT, column
from django_jobs.db.job_rows import job_from_row, model_from_row

if TYPE_CHECKING:
    from django_jobs.models import Job

# Migration 0013's procedure: one ready job and its ready row in one round trip; its SQL,
# and what keeps it following the job's columns, in db/enqueue_procedure.py.
ENQUEUE_PROCEDURE = enqueue_procedure.PROCEDURE
ENQUEUE_SAVEPOINT = enqueue_procedure.SAVEPOINT
# Migration 0014's procedure: a worker's claim (and start) in one round trip.
CLAIM_PROCEDURE = "django_jobs_claim_ready"
CLAIM_SAVEPOINT = "django_jobs_claim"
# Its parameters, in order, as this code sends them.
CLAIM_PARAMETERS = (
    "own_transaction",
    "p_process_id",
    "p_queues",
    "p_limit",
    "p_worker_id",
    "p_now",
)
# Migration 0015's procedure: a finish of jobs with no key, batch or workflow in one round trip.
FINISH_PROCEDURE = "django_jobs_finish_plain"
FINISH_SAVEPOINT = "django_jobs_finish"
FINISH_PARAMETERS = ("own_transaction", "p_process_id", "p_outcomes", "p_now")
# The most jobs one CALL claims: the procedure gathers their ids in a JSON document, copied
# whole at each row it adds; a bigger claim (no worker asks for one, a worker's is at most
# twice its threads) takes the statements' path.
MAX_CLAIM_PROCEDURE = 1000
# The server's "no such procedure" (a database migrated back before 0013, or 0014). The
# same number says "no such savepoint", which is not a missing procedure.
NO_SUCH_PROCEDURE = 1305

# MariaDB's JSON_VALID refuses a document nested 32 levels deep.
MARIADB_MAX_JSON_DEPTH = 31


class Features(base.Features):
    locks_every_row_read = True
    begins_transactions_by_statement = True
    max_json_depth = MARIADB_MAX_JSON_DEPTH


class Operations(base.Operations):
    # Shared, and a locking read: it sees the latest committed row, not the snapshot of a
    # transaction that began before the prune's delete (REPEATABLE READ).
    own_process_lock = " LOCK IN SHARE MODE"

    def prefix_condition(self, field: str, prefix: str) -> Q:
        """``LIKE 'prefix%'`` in the column's collation, which its index serves: the prefix
        matches without regard to case, as the column compares everywhere on MySQL and
        MariaDB. ``startswith`` is ``LIKE BINARY``, which a case-insensitive column's index
        cannot serve: a scan of the table, 3.2 s for a task path at 10M jobs
        (bench/history.py); with both, a prefix in the wrong case walked every job the index
        range held (15 s)."""
        return Q(**{f"{field}__istartswith": prefix})

    def statement_timeout(self, db: str, seconds: float) -> AbstractContextManager[None]:
        return session_statement_timeout(db, seconds)

    def is_statement_timeout(self, error: BaseException) -> bool:
        code = getattr(error, "args", (None,))[0] if getattr(error, "args", None) else None
        return code in (MARIADB_STATEMENT_TIMEOUT, MYSQL_STATEMENT_TIMEOUT)

    def lock_in_key_order(self, rows: QuerySet[RowT], keys: Iterable[str]) -> list[RowT]:
        """One point lookup per key, in Python's order, all in one statement: InnoDB locks
        rows in the order it reads them, so one ``WHERE key IN (...)`` would lock them in
        its index's order, or, read by a scan, in the table's; instead each key is a
        parenthesized ``SELECT ... WHERE key = %s FOR UPDATE`` of its own, run in turn by
        a ``UNION ALL`` (``key_lock_statement``). Through the ORM one query per key cost
        a quarter of a rate-limited start's CPU (py-spy). Returned in key order."""
        ordered = self.locking_order(keys)
        if not ordered:
            return []
        if rows.query.where:  # not the model's whole table: the ORM, one lookup per key
            locked = rows.select_for_update()
            return [row for key in ordered for row in locked.filter(key=key)]
        db, model = rows.db, rows.model
        connection = connections[db]
        with connection.cursor() as cursor:
            cursor.execute(key_lock_statement(db, model, len(ordered)), ordered)
            fetched = cursor.fetchall()
        found = [model_from_row(db, model, connection, row) for row in fetched]
        return sorted(found, key=lambda row: row.key)  # type: ignore[attr-defined]

    def locking_order(self, keys: Iterable[str]) -> list[str]:
        """Keys in the order every path locks them: ascending by code point, as Python sorts
        (docs/design.md section 4)."""
        return sorted(set(keys))

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

    def read_through_index(self, sql: str, table: str, index: str) -> str:
        """``FORCE INDEX`` after the table's one ``FROM``."""
        quoted = f"FROM `{table}`"
        if sql.count(quoted) != 1:
            return sql
        return sql.replace(quoted, f"{quoted} FORCE INDEX (`{index}`)")

    def enqueue_ready(self, db: str, job: Job) -> bool:
        """Insert ``job`` (ready, no key, not unique; of a fair queue too, stamped, since
        migration 0024) and its ready row with one ``CALL`` (migration 0013): one round
        trip where START TRANSACTION, two INSERTs and COMMIT take four. In the caller's
        transaction (``atomic()``, or autocommit off) it writes under a savepoint of its
        own, rolled back on error, so a failed enqueue leaves neither row behind and the
        caller's transaction usable.

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
        values = [getattr(job, field.attname) for field in fields]
        params = [
            value if type(value) in plain else field.get_db_prep_save(value, connection)
            for field, plain, value in zip(fields, plain_types(fields), values, strict=True)
            if value is not None
        ]
        result = call_if_there(
            db,
            ENQUEUE_PROCEDURE,
            ENQUEUE_SAVEPOINT,
            params,
            forget=lambda: _procedure_fields.pop(procedure_key(db), None),
            nulls=tuple(value is None for value in values),
        )
        if result is None:
            return False
        row = result[1][0]
        job.pk = row[0]
        job._state.adding = False
        job._state.db = db
        if len(row) > 1 and row[1] and job.fair_key is not None:
            # Since 0024 the procedure stamps a fair queue's job, and says when the group's
            # stamp was one no enqueue writes (core.fairness).
            warn_of_stamp(job)
        return True

    def claim_ready(
        self,
        db: str,
        process_id: int,
        queues: Sequence[str] | None,
        limit: int,
        worker_id: str | None,
        now: datetime,
    ) -> list[Job] | None:
        """Claim, and start, up to ``limit`` ready jobs with one ``CALL`` (migration 0014):
        one round trip where the statements' claim takes seven. The same locks in the
        same order (the ready rows with SKIP LOCKED in claim order, then the jobs
        ascending by id, then the claims' INSERT and the ready rows' DELETE by primary
        key: docs/design.md section 4), rolled back on any error. In the caller's
        transaction it works under a savepoint of its own, as :meth:`enqueue_ready`.

        ``queues``: exact names, taken in this order; None, every queue. Returns the jobs
        as written, in claim order; None, having done nothing, where the procedure is
        missing (not migrated, or the user may not create routines), or the claim is
        bigger than :data:`MAX_CLAIM_PROCEDURE`: the caller takes the statements' path.
        """
        if limit > MAX_CLAIM_PROCEDURE or not has_procedure(db, CLAIM_PROCEDURE, CLAIM_PARAMETERS):
            return None
        connection = connections[db]
        params = [
            process_id,
            None if queues is None else json.dumps(list(queues)),
            limit,
            worker_id,
            connection.ops.adapt_datetimefield_value(now),
        ]
        result = call_if_there(db, CLAIM_PROCEDURE, CLAIM_SAVEPOINT, params)
        if result is None:
            return None
        names, rows = result
        order = job_column_order(names)
        return [job_from_row(db, connection, tuple(row[i] for i in order)) for row in rows]

    def finish_plain(
        self, db: str, process_id: int, return_values: dict[int, object], now: datetime
    ) -> set[int] | None:
        """Finish the plain jobs of ``return_values`` with one ``CALL`` (migration 0015): one
        round trip where ``core.claimed.finish_locked``'s transaction takes five. The same
        locks in the same order (this process's claims ascending by job id, each with its
        job's row, then their DELETE and the jobs' UPDATE by primary key), rolled back on
        any error; in the caller's transaction under a savepoint of its own. A claim found
        keyed, batched or of a workflow once locked is left to the caller, as is one gone.

        Returns the ids finished; None, having done nothing, where the procedure is missing.
        """
        if not has_procedure(db, FINISH_PROCEDURE, FINISH_PARAMETERS):
            return None
        from django_jobs.models import Job

        connection = connections[db]
        field = Job._meta.get_field("return_value")
        outcomes = [
            [pk, None if value is None else field.get_db_prep_save(value, connection)]
            for pk, value in sorted(return_values.items())
        ]
        params = [process_id, json.dumps(outcomes), connection.ops.adapt_datetimefield_value(now)]
        result = call_if_there(db, FINISH_PROCEDURE, FINISH_SAVEPOINT, params)
        if result is None:
            return None
        return {row[0] for row in result[1]}


def call(
    db: str,
    procedure: str,
    savepoint: str,
    params: list[Any],
    nulls: tuple[bool, ...] | None = None,
) -> tuple[tuple[str, ...], list[tuple]]:
    """``CALL`` one of our procedures, its first parameter (``own_transaction``) decided
    here: its own transaction where the caller is in autocommit, else a savepoint (named
    ``savepoint``, as in the procedure) of the caller's transaction. Returns the names of
    its result's columns and its rows.

    Every procedure rolls back what it wrote on any error, in its handler; should the
    server end one without running the handler (MariaDB 10.11 runs none for a CHECK
    constraint's error in a multi-table UPDATE: the transaction stayed open, its earlier
    writes in it, for the connection's next statements to commit), the rollback is
    done here, so that no error leaves half a transition behind.

    ``nulls``: which of the procedure's parameters (after ``own_transaction``) are NULL,
    written into the statement; ``params`` then holds only the others. An enqueue's job
    has some 25 NULL columns of 38, and each bound value costs the driver an escape.
    """
    connection = connections[db]
    own_transaction = connection.get_autocommit() and not connection.in_atomic_block
    sql = call_statement(procedure, nulls or (False,) * len(params))
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, [own_transaction, *params])
            names = tuple(column[0] for column in cursor.description or ())
            rows = list(cursor.fetchall())
            # The CALL's own status, after its COMMIT: read, or the next statement fails,
            # and an error there is raised here.
            while cursor.nextset():
                pass
    except DatabaseError:
        roll_back_call(connection, own_transaction, savepoint)
        raise
    return names, rows


def call_if_there(
    db: str,
    procedure: str,
    savepoint: str,
    params: list[Any],
    forget: Callable[[], object] | None = None,
    nulls: tuple[bool, ...] | None = None,
) -> tuple[tuple[str, ...], list[tuple]] | None:
    """:func:`call`, or None where the procedure turns out to be gone (the database
    migrated back): what was read of it is forgotten (``forget``; by default its entry
    in ``_procedures``), and the caller takes the statements' path."""
    try:
        return call(db, procedure, savepoint, params, nulls)
    except DatabaseError as exc:
        if not procedure_missing(exc):
            raise
        if forget is None:
            _procedures.pop((procedure_key(db), procedure), None)
        else:
            forget()
        return None


@functools.lru_cache(maxsize=256)
def call_statement(procedure: str, nulls: tuple[bool, ...]) -> str:
    """``CALL procedure(...)``: a placeholder for ``own_transaction``, then NULL where
    ``nulls`` says so and a placeholder elsewhere; built once per pattern of NULLs."""
    marks = ", ".join(["%s", *("NULL" if null else "%s" for null in nulls)])
    return f"CALL {procedure}({marks})"


# Django's field classes whose get_db_prep_save returns a value of these exact types
# unchanged on MySQL (a CharField's str, an IntegerField's int, a FloatField's float).
PLAIN_VALUES: dict[str, frozenset[type]] = {
    "CharField": frozenset({str}),
    "SmallIntegerField": frozenset({int}),
    "PositiveSmallIntegerField": frozenset({int}),
    "IntegerField": frozenset({int}),
    "PositiveIntegerField": frozenset({int}),
    "BigIntegerField": frozenset({int}),
    "PositiveBigIntegerField": frozenset({int}),
    "FloatField": frozenset({float}),
}


@functools.cache
def plain_types(fields: Fields) -> tuple[frozenset[type], ...]:
    """For each field, the types of value it passes to the driver as they are: what an
    enqueue need not send through ``get_db_prep_save`` (datetimes and JSON still go).
    A field of a subclass gets none: its own preparation may do anything."""
    return tuple(
        PLAIN_VALUES.get(type(field).__name__, frozenset())
        if type(field).__module__ == "django.db.models.fields"
        else frozenset()
        for field in fields
    )


def roll_back_call(connection: Any, own_transaction: bool, savepoint: str) -> None:
    """After a failed CALL: ROLLBACK (TO SAVEPOINT), which changes nothing where the
    procedure's handler already rolled back. An error here (the connection lost, the
    savepoint gone with a transaction a deadlock rolled back) is not the one to raise."""
    sql = "ROLLBACK" if own_transaction else f"ROLLBACK TO SAVEPOINT {savepoint}"
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
    except Error:  # InterfaceError too: a connection already closed
        pass


def procedure_missing(exc: DatabaseError) -> bool:
    """Whether the server said our procedure does not exist (not a missing savepoint,
    whose error has the same number: a caller's transaction rolled back by a deadlock)."""
    args = getattr(exc.__cause__, "args", (None, ""))
    return args[0] == NO_SUCH_PROCEDURE and str(args[1]).startswith("PROCEDURE")


@functools.cache
def job_column_order(names: tuple[str, ...]) -> tuple[int, ...]:
    """Where each of the job's columns (in ``job_rows.select_list``'s order) is among the
    ``names`` the procedure returned: it selects ``j.*``, the table's order, which a column
    added to the model later need not follow."""
    from django_jobs.models import Job

    where = {name: index for index, name in enumerate(names)}
    return tuple(where[base.column(field)] for field in Job._meta.concrete_fields)


# (procedure_key, procedure) -> whether it is there, with the parameters this code sends.
_procedures: dict[tuple[tuple[str, Any], str], bool] = {}


def has_procedure(db: str, name: str, parameters: tuple[str, ...]) -> bool:
    """Whether our procedure ``name`` is there with ``parameters``, the ones this code
    sends; read once per database from information_schema."""
    key = (procedure_key(db), name)
    if key not in _procedures:
        _procedures[key] = procedure_parameters(db, name) == parameters
    return _procedures[key]


def procedure_parameters(db: str, name: str) -> tuple[str, ...]:
    """The parameters of our procedure ``name``, in order; none where it is missing."""
    with connections[db].cursor() as cursor:
        cursor.execute(
            "SELECT parameter_name FROM information_schema.parameters "
            "WHERE specific_schema = DATABASE() AND specific_name = %s "
            "AND routine_type = 'PROCEDURE' ORDER BY ordinal_position",
            [name],
        )
        return tuple(row[0] for row in cursor.fetchall())


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
        names = procedure_parameters(db, ENQUEUE_PROCEDURE)
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


# --- a statement written once: the lock of rows by key ------------------------------------


@functools.lru_cache(maxsize=64)
def key_lock_statement(db: str, model: type[models.Model], count: int) -> str:
    """Lock the rows of ``count`` keys (parameters, in locking order) of ``model``'s table:
    one parenthesized point lookup per key, joined by ``UNION ALL``, which runs them in
    turn, each locking its row alone (the key's unique index: a const read)."""
    quote = connections[db].ops.quote_name
    names = ", ".join(quote(column(field)) for field in model._meta.concrete_fields)
    one = (
        f"(SELECT {names} FROM {quote(model._meta.db_table)} WHERE {quote('key')} = %s FOR UPDATE)"
    )
    return " UNION ALL ".join([one] * count)


# MariaDB's error for a statement stopped by ``max_statement_time``; MySQL's for one stopped
# by ``max_execution_time``.
MARIADB_STATEMENT_TIMEOUT = 1969
MYSQL_STATEMENT_TIMEOUT = 3024


@contextlib.contextmanager
def session_statement_timeout(db: str, seconds: float) -> Iterator[None]:
    """The session's limit set for the block and put back after it: MariaDB's
    ``max_statement_time`` (seconds, every statement), MySQL's ``max_execution_time``
    (milliseconds, SELECTs only)."""
    connection: Any = connections[db]  # Django's MySQL wrapper: mysql_is_mariadb
    connection.ensure_connection()
    variable: str
    value: float
    if connection.mysql_is_mariadb:
        variable, value = "max_statement_time", seconds
    else:
        variable, value = "max_execution_time", int(seconds * 1000)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT @@SESSION.{variable}")
        (before,) = cursor.fetchone()
        cursor.execute(f"SET SESSION {variable} = %s", [value])
    try:
        yield
    finally:
        if connection.is_usable():
            with connection.cursor() as cursor:
                cursor.execute(f"SET SESSION {variable} = %s", [before])
