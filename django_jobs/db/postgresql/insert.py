"""Ready jobs written in one statement on PostgreSQL: the job rows and their ready rows.

The common enqueue (no concurrency key, no uniqueness, not deferred) needs no
lock and no decision, only two inserts. Through the ORM they cost BEGIN, two
INSERTs and COMMIT, four round trips, and Django compiles one parameter per
field per row. Here a data-modifying CTE inserts both from column arrays
(``UNNEST``), so one enqueue in autocommit is a single, atomic statement (one
round trip, like a plain ``Model.objects.create``) and a bulk enqueue sends a
few arrays instead of tens of thousands of parameters.

The column list is read from the model, so a new field needs no change here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache

from django.db import connections, models

from django_jobs.db.base import column
from django_jobs.db.notify import jobs_ready
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
    for start in range(0, len(jobs), CHUNK_SIZE):
        insert_chunk(db, jobs[start : start + CHUNK_SIZE])
    if jobs:
        jobs_ready(db, (job.queue_name for job in jobs))


@cache
def statement(db: str) -> tuple[str, list[models.Field]]:
    """The insert's SQL and the fields it takes, in order (built once per database)."""
    connection = connections[db]
    fields = [field for field in Job._meta.concrete_fields if not field.primary_key]
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
    rows = f"SELECT {', '.join(selected)} FROM UNNEST({', '.join(arrays)}) AS rows({names})"
    return with_ready_rows(db, fields, rows), fields


@cache
def single_statement(db: str) -> tuple[str, list[models.Field]]:
    """The insert of one job: plain values, not arrays.

    A single enqueue (the call in a web request) is the common case. Its values
    go as scalars: psycopg renders each of the ~30 parameters once instead of
    building a one-element array literal per column, about half the client-side
    cost of the statement (cProfile, 1,000 enqueues).
    """
    fields = [field for field in Job._meta.concrete_fields if not field.primary_key]
    values = ", ".join(
        "%s::jsonb" if isinstance(field, models.JSONField) else "%s" for field in fields
    )
    return with_ready_rows(db, fields, f"VALUES ({values})"), fields


def with_ready_rows(db: str, fields: list[models.Field], rows: str) -> str:
    """The statement that inserts ``rows`` (a VALUES list or a SELECT giving ``fields``)
    into the jobs table and a ready row for each, returning the new ids."""
    quote = connections[db].ops.quote_name
    columns = ", ".join(quote(column(field)) for field in fields)
    job_table = quote(Job._meta.db_table)
    ready_table = quote(ReadyExecution._meta.db_table)
    return (
        f"WITH new_jobs AS (INSERT INTO {job_table} ({columns}) {rows} "
        f"RETURNING id, queue_name, priority, enqueued_at) "
        f"INSERT INTO {ready_table} (job_id, queue_name, priority, concurrency_key, created_at) "
        f"SELECT id, queue_name, priority, NULL, enqueued_at FROM new_jobs RETURNING job_id"
    )


def column_values(field: models.Field, jobs: Sequence[Job]) -> list:
    values = [getattr(job, field.attname) for job in jobs]
    if isinstance(field, models.JSONField):
        # Sent as text and cast in the statement: no per-value adapter objects.
        return [None if v is None else json.dumps(v, cls=field.encoder) for v in values]
    # The attributes already hold database values (prepare_job built them from
    # validated input): str, int, float, aware datetimes or None.
    return values


def insert_chunk(db: str, jobs: Sequence[Job]) -> None:
    connection = connections[db]
    if len(jobs) == 1:
        sql, fields = single_statement(db)
        params = [column_values(field, jobs)[0] for field in fields]
    else:
        sql, fields = statement(db)
        params = [column_values(field, jobs) for field in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        ids = sorted(row[0] for row in cursor.fetchall())
    # One statement draws its ids from the sequence in row order, so ascending
    # ids match the jobs in the order given, whatever order RETURNING used.
    for job, pk in zip(jobs, ids, strict=True):
        job.pk = pk
        job._state.adding = False
        job._state.db = db
