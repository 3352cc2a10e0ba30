"""Rows written from column arrays on PostgreSQL: ready jobs with their ready rows in one
statement, a workflow's job rows, and the plain rows of a model (its edges, its awaiting rows).

The common enqueue (no concurrency key, no uniqueness, not deferred) needs no
lock and no decision, only two inserts. Through the ORM they cost BEGIN, two
INSERTs and COMMIT, four round trips, and Django compiles one parameter per
field per row. Here a data-modifying CTE inserts both from column arrays
(``UNNEST``), so one enqueue in autocommit is a single, atomic statement (one
round trip, like a plain ``Model.objects.create``) and a bulk enqueue sends a
few arrays instead of tens of thousands of parameters.

A workflow's rows go the same way, without the ready rows (:func:`insert_jobs`,
:func:`insert_rows`): ``bulk_create`` in batches of 1,000 cost 0.90 s for 10,000 job
rows, 0.39 s for their 19,996 edges and 0.21 s for 9,999 awaiting rows.

The column lists are read from the models, so a new field needs no change here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

from django.db import connections, models
from django.db.backends.base.base import BaseDatabaseWrapper

from django_jobs.core.fairness import warn_of_stamp
from django_jobs.db.base import column
from django_jobs.db.notify import CHANNEL, inline_payload, jobs_ready
from django_jobs.db.postgresql.cursors import bound_cursor
from django_jobs.db.postgresql.fair_function import BROKEN, FUNCTION
from django_jobs.limits import TURN_SCALE
from django_jobs.models import Job, ReadyExecution

# Rows per statement: large enough to amortise the round trip, small enough that
# one statement's arrays stay a few megabytes.
CHUNK_SIZE = 5000


def insert_ready_jobs(db: str, jobs: Sequence[Job]) -> None:
    """Insert ``jobs`` and their ready rows; sets ``pk`` on each.

    Atomic per chunk of :data:`CHUNK_SIZE`; a caller inserting more than one
    chunk wraps the call in a transaction. Idle workers of the jobs' queues are
    notified once it commits (``django_jobs.notify``).
    """
    if len(jobs) == 1:
        queues = (jobs[0].queue_name,)
        notified = inline_payload(db, queues)
        insert_one(db, jobs[0], notified)
        if notified is None:
            jobs_ready(db, queues)
        return
    for start in range(0, len(jobs), CHUNK_SIZE):
        insert_chunk(db, jobs[start : start + CHUNK_SIZE])
    if jobs:
        jobs_ready(db, (job.queue_name for job in jobs))


def insert_jobs(db: str, jobs: Sequence[Job]) -> None:
    """Insert job rows and nothing else (a workflow's nodes); sets ``pk`` on each, in the
    order given. Atomic per chunk of :data:`CHUNK_SIZE`, as :func:`insert_ready_jobs`."""
    if not jobs:
        return
    sql, fields = jobs_statement(db)
    with connections[db].cursor() as cursor:
        for start in range(0, len(jobs), CHUNK_SIZE):
            chunk = jobs[start : start + CHUNK_SIZE]
            cursor.execute(sql, [column_values(field, chunk) for field in fields])
            assign_ids(db, chunk, [row[0] for row in cursor.fetchall()])


def insert_rows(db: str, model: type[models.Model], rows: Sequence[models.Model]) -> None:
    """Insert ``rows`` of ``model`` (every concrete column but an auto primary key), as
    ``bulk_create`` would write them, without setting an auto primary key: for rows whose
    ids nobody reads. Atomic per chunk of :data:`CHUNK_SIZE`."""
    if not rows:
        return
    connection = connections[db]
    sql, fields = rows_statement(db, model)
    with connection.cursor() as cursor:
        for start in range(0, len(rows), CHUNK_SIZE):
            chunk = rows[start : start + CHUNK_SIZE]
            cursor.execute(sql, [prepared_values(field, chunk, connection) for field in fields])
    for row in rows:
        row._state.adding = False
        row._state.db = db


@cache
def statement(db: str) -> tuple[str, list[models.Field]]:
    """The insert of ready jobs from column arrays and the fields it takes, in order
    (built once per database)."""
    fields = job_fields()
    return with_ready_rows(db, fields, unnest(db, fields)), fields


@cache
def jobs_statement(db: str) -> tuple[str, list[models.Field]]:
    """The insert of job rows alone from column arrays, returning their ids, and the
    fields it takes, in order (built once per database)."""
    fields = job_fields()
    return f"{insert_into(db, Job, fields, unnest(db, fields))} RETURNING id", fields


@cache
def rows_statement(db: str, model: type[models.Model]) -> tuple[str, list[models.Field]]:
    """The insert of ``model`` rows from column arrays and the fields it takes, in order
    (built once per database and model): every concrete field but an auto primary key. A
    primary key that is a column of its own (a one-to-one key, as an execution row's
    ``job_id``) is inserted like any other."""
    fields = [
        field
        for field in model._meta.concrete_fields
        if not (field.primary_key and isinstance(field, models.AutoField))
    ]
    return insert_into(db, model, fields, unnest(db, fields)), fields


@lru_cache(maxsize=128)
def single_statement(db: str, names: tuple[str, ...], notifies: bool = False) -> str:
    """The insert of one job from plain values (not arrays), giving only the columns
    ``names`` (the attributes the job sets; the others are NULL, which is what the
    column would get anyway).

    A single enqueue (the call in a web request) is the common case. Its values go
    as scalars, and only those that are set: a job of a plain task sets about 12 of
    its 37 columns, so psycopg adapts 12 parameters, not 37, and the server parses a
    statement a third as long. The few shapes a project's tasks have each get their
    own statement, prepared on the server once the connection allows it
    (``cursors.bound_cursor``).

    ``notifies``: the statement also ``pg_notify``s its two last parameters (channel and
    payload) for the listening workers, at its commit (``notify.inline_payload``).
    """
    by_name = {field.attname: field for field in job_fields()}
    fields = [by_name[name] for name in names]
    values = ", ".join(
        "%s::jsonb" if isinstance(field, models.JSONField) else "%s" for field in fields
    )
    if "fair_key" in names:
        sql, returned = with_fair_ready_row(db, fields, f"VALUES ({values})"), "job_id, broken"
    else:
        sql, returned = with_ready_rows(db, fields, f"VALUES ({values})"), "job_id"
    if notifies:
        # The ready rows' insert becomes a CTE of its own, what it returns selected beside
        # the notification (pg_notify returns void: psycopg reads it as an empty string).
        insert, returning = sql.rsplit(" INSERT INTO ", 1)
        sql = (
            f"{insert}, new_ready AS (INSERT INTO {returning}) "
            f"SELECT {returned}, pg_notify(%s, %s) FROM new_ready"
        )
    return sql


@cache
def job_fields() -> list[models.Field]:
    """The columns of a job row an insert gives: all but the id."""
    return [field for field in Job._meta.concrete_fields if not field.primary_key]


def unnest(db: str, fields: Sequence[models.Field]) -> str:
    """A SELECT of ``fields``' values from one array parameter per field, typed as the
    column (JSON sent as text and cast), one row per index."""
    connection = connections[db]
    arrays, selected = [], []
    for index, field in enumerate(fields):
        if isinstance(field, models.JSONField):
            arrays.append("%s::text[]")
            selected.append(f"c{index}::jsonb")
        elif isinstance(field, models.CharField):
            # As text: an explicit cast to varchar(n) cuts a longer value short without
            # a word; the insert's own assignment to the column refuses it, as the
            # single insert does.
            arrays.append("%s::text[]")
            selected.append(f"c{index}")
        else:
            arrays.append(f"%s::{field.db_type(connection)}[]")
            selected.append(f"c{index}")
    names = ", ".join(f"c{index}" for index in range(len(fields)))
    return f"SELECT {', '.join(selected)} FROM UNNEST({', '.join(arrays)}) AS rows({names})"


def insert_into(
    db: str, model: type[models.Model], fields: Sequence[models.Field], rows: str
) -> str:
    """``INSERT INTO`` ``model``'s table ``fields``' columns ``rows`` (a VALUES list or a
    SELECT giving ``fields``)."""
    quote = connections[db].ops.quote_name
    columns = ", ".join(quote(column(field)) for field in fields)
    return f"INSERT INTO {quote(model._meta.db_table)} ({columns}) {rows}"


def with_ready_rows(db: str, fields: list[models.Field], rows: str) -> str:
    """The statement that inserts ``rows`` (a VALUES list or a SELECT giving ``fields``)
    into the jobs table and a ready row for each, returning the new ids. The jobs are of no
    fair queue (``core.enqueue.plain_ready_jobs``): each takes its FIFO turn."""
    ready_table = connections[db].ops.quote_name(ReadyExecution._meta.db_table)
    return (
        f"WITH new_jobs AS ({insert_into(db, Job, fields, rows)} "
        f"RETURNING id, queue_name, priority, enqueued_at, is_async) "
        f"INSERT INTO {ready_table} (job_id, queue_name, priority, concurrency_key, created_at, "
        f"is_async, turn) SELECT id, queue_name, priority, NULL, enqueued_at, is_async, "
        f"id * {TURN_SCALE} FROM new_jobs RETURNING job_id"
    )


def with_fair_ready_row(db: str, fields: list[models.Field], row: str) -> str:
    """The statement that inserts one job of a fair queue (``row``, a VALUES list giving
    ``fields``) and its ready row, its turn from the stamp function (migration 0029,
    ``fair_function.py``), which locks and writes the group's ``FairTurn`` row as
    ``core.fairness.ready_turns`` does. Returns the new id and whether the stamp the
    function found was one no enqueue writes (the caller logs it; the turn is then the
    job's FIFO one).

    One statement where the ORM's path takes seven round trips: a fair queue's single
    enqueue is what a web request does. The stamp's own statements are the function's,
    planned once per connection: this one is planned on every call unless the connection
    prepares statements, and costs little more to plan than a plain enqueue's.
    """
    quote = connections[db].ops.quote_name
    ready = quote(ReadyExecution._meta.db_table)
    broken = f"current_setting('{BROKEN}', true) = job_id::text"
    return (
        f"WITH new_jobs AS ({insert_into(db, Job, fields, row)} "
        f"RETURNING id, queue_name, priority, enqueued_at, is_async, fair_key, fair_weight) "
        f"INSERT INTO {ready} (job_id, queue_name, priority, concurrency_key, created_at, "
        f"is_async, turn) SELECT id, queue_name, priority, NULL, enqueued_at, is_async, "
        f"{FUNCTION}(queue_name, priority, fair_key, fair_weight, id, enqueued_at) "
        f"FROM new_jobs RETURNING job_id, {broken} AS broken"
    )


def column_values(field: models.Field, jobs: Sequence[Job]) -> list:
    values = [getattr(job, field.attname) for job in jobs]
    if isinstance(field, models.JSONField):
        # Sent as text and cast in the statement: no per-value adapter objects.
        return [None if v is None else json_text(field, v) for v in values]
    # The attributes already hold database values (prepare_job built them from
    # validated input): str, int, float, aware datetimes or None.
    return values


def prepared_values(
    field: models.Field, rows: Sequence[models.Model], connection: BaseDatabaseWrapper
) -> list:
    """``field``'s values of ``rows`` as ``bulk_create`` prepares them (``pre_save``, then
    ``get_db_prep_save``); JSON as text, as :func:`column_values` sends it.

    A value that already is what ``get_db_prep_save`` would give back (None, or an
    ``int`` for an integer column or key, a ``bool`` for a boolean, a ``str`` for text)
    skips the call: the same values, without 80,000 calls for a workflow of 10,000 nodes
    (0.19 s of its enqueue).
    """
    if type(field).pre_save is models.Field.pre_save:  # no auto_now: the attribute
        values = [getattr(row, field.attname) for row in rows]
    else:
        values = [field.pre_save(row, True) for row in rows]
    if isinstance(field, models.JSONField):
        return [None if v is None else json_text(field, v) for v in values]
    prepare, plain = field.get_db_prep_save, unchanged_type(field)
    if plain is None:
        return [prepare(value, connection) for value in values]
    return [
        value if value is None or type(value) is plain else prepare(value, connection)
        for value in values
    ]


# The Python type whose values ``get_db_prep_save`` gives back unchanged on PostgreSQL, by
# Django's field class (exactly: a subclass may prepare its values its own way).
UNCHANGED: dict[type[models.Field], type] = {
    **dict.fromkeys(
        (
            models.AutoField,
            models.BigAutoField,
            models.SmallAutoField,
            models.IntegerField,
            models.BigIntegerField,
            models.SmallIntegerField,
            models.PositiveIntegerField,
            models.PositiveBigIntegerField,
            models.PositiveSmallIntegerField,
        ),
        int,
    ),
    models.BooleanField: bool,
    models.CharField: str,
    models.TextField: str,
}


def unchanged_type(field: models.Field) -> type | None:
    """The type of ``field``'s values that its ``get_db_prep_save`` returns as they are, if
    any (a key's are its target's)."""
    if isinstance(field, models.ForeignKey) and type(field) in (
        models.ForeignKey,
        models.OneToOneField,
    ):
        field = field.target_field
    return UNCHANGED.get(type(field))


def insert_chunk(db: str, jobs: Sequence[Job]) -> None:
    if len(jobs) == 1:
        insert_one(db, jobs[0])
        return
    sql, fields = statement(db)
    params = [column_values(field, jobs) for field in fields]
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        assign_ids(db, jobs, [row[0] for row in cursor.fetchall()])


def set_values(job: Job) -> tuple[tuple[str, ...], list[Any]]:
    """The attributes ``job`` sets (not None), in column order, and their values as
    :func:`single_statement` of those names takes them (JSON as text)."""
    names, params = [], []
    for field in job_fields():
        value = getattr(job, field.attname)
        if value is not None:
            names.append(field.attname)
            params.append(json_text(field, value) if isinstance(field, models.JSONField) else value)
    return tuple(names), params


def insert_one(db: str, job: Job, notified: str | None = None) -> None:
    """Insert one job and its ready row (:func:`single_statement`); sets its ``pk``.
    ``notified``: the payload to notify the workers with, in the same statement."""
    names, params = set_values(job)
    if notified is not None:
        params += [CHANNEL, notified]
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(single_statement(db, names, notified is not None), params)
        row = cursor.fetchone()
        assign_ids(db, [job], [row[0]])
    if job.fair_key is not None and row[1]:
        warn_of_stamp(job)


def json_text(field: models.JSONField, value: object) -> str:
    """A JSON column's value as text, cast in the statement: no adapter object per value."""
    return json.dumps(value, cls=field.encoder)


def assign_ids(db: str, jobs: Sequence[Job], ids: list[int]) -> None:
    """Set on ``jobs`` the ids one statement inserting them (in this order) returned.

    One statement draws its ids from the sequence in row order, and UNNEST gives the
    rows in the arrays' order, so ascending ids match the jobs in the order given,
    whatever order RETURNING used (the ready rows' insert returns them in its own).
    """
    for job, pk in zip(jobs, sorted(ids), strict=True):
        job.pk = pk
        job._state.adding = False
        job._state.db = db
