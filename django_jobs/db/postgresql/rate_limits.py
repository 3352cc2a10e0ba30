"""A rate-limited start on PostgreSQL: four statements written once, where the ORM built six.

Through the ORM a start that decides rates (``core.starting.start_jobs``) was a read of
its keys' rows, BEGIN, the claims' locking SELECT, the jobs' read, the rate rows'
locking SELECT, the rate rows' ``bulk_update``, the jobs' UPDATE and COMMIT; building
the ``bulk_update`` (a ``CASE`` expression per row and column) cost more CPU than the
rest of the start. Here:

0. :func:`ensure_rate_rows`, before the transaction: the keys' missing rows created (for
   keys the connection has not seen a row of, ``core.rate_limits.ensure_unknown_rate_rows``);
1. :func:`lock_start_rows`: the claims locked (ascending job id) and their jobs read,
   one statement;
2. :func:`lock_rate_rows`: the keys' ``RateLimit`` rows locked in ascending key order
   by code point, as Python sorts (``ORDER BY key COLLATE "C" ... FOR UPDATE``);
3. the decision, in Python (``core.rate_limits.Window``: the same code on every
   database), then :func:`write_rated_starts`: the windows and the starts written by
   one statement, from column arrays.

The locks and their order are the portable path's: claims, then rate rows, then (for a
job sent back, between 2 and 3) its semaphore; the job rows written last. Statement 3
takes no lock the start does not hold already but its started jobs' rows. Each is bound
on the server (``cursors.bound_cursor``), so prepared where ``prepare_threshold`` allows.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import connections

from django_jobs.db.postgresql.cursors import bound_cursor
from django_jobs.db.rows import Started, StartRow
from django_jobs.models import ClaimedExecution, Job, JobStatus, RateLimit, UniqueUntil


def ensure_rate_rows(db: str, keys: Collection[str], now: datetime) -> None:
    """Create the missing ``RateLimit`` rows of ``keys`` in one statement of its own
    (autocommit), before the start's transaction. ``ON CONFLICT DO NOTHING`` locks no
    existing row, unlike InnoDB's ``INSERT IGNORE``, and waits only for a row another
    such statement is inserting; ``NOT EXISTS`` keeps the rows that exist from taking a
    value of the id sequence each time."""
    if not keys:
        return
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(ensure_statement(db), {"keys": sorted(keys), "now": now})


@functools.cache
def ensure_statement(db: str) -> str:
    quote = connections[db].ops.quote_name
    rate = quote(RateLimit._meta.db_table)
    return (
        f"INSERT INTO {rate} (key, {quote('limit')}, {quote('period')}, starts, planned, "
        f"created_at, updated_at) "
        f"SELECT k, 1, 1.0, '[]'::jsonb, '[]'::jsonb, %(now)s, %(now)s "
        f"FROM UNNEST(%(keys)s::text[]) AS k "
        f"WHERE NOT EXISTS (SELECT 1 FROM {rate} AS r WHERE r.key = k) "
        f"ON CONFLICT (key) DO NOTHING"
    )


def lock_start_rows(db: str, process_id: int, job_ids: list[int]) -> list[StartRow]:
    """Lock the claims of ``job_ids`` that ``process_id`` holds, in ascending job id, and
    read their jobs, in claim order (priority, then id).

    One statement: the claims' locking read is a materialized CTE, run in full before
    the jobs are read. A claim deleted while the lock waited (a recovery, a hand-back)
    is skipped, as the portable path's read skips it. The jobs are read in the
    statement's snapshot: no transaction but this process's own writes a job whose
    claim it holds, and a transaction that locks another process's claim deletes it.
    """
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(lock_start_statement(db), [process_id, list(job_ids)])
        rows = cursor.fetchall()
    return [
        StartRow(pk, attempts, json_list(worker_ids), *rest)
        for pk, attempts, worker_ids, *rest in rows
    ]


def json_list(value: Any) -> Any:
    """A ``jsonb`` column's value as the ORM reads it (text from psycopg, parsed here)."""
    return json.loads(value) if isinstance(value, str) else value


@functools.cache
def lock_start_statement(db: str) -> str:
    quote = connections[db].ops.quote_name
    job, claimed = quote(Job._meta.db_table), quote(ClaimedExecution._meta.db_table)
    columns = ", ".join(f"j.{quote(name)}" for name in start_columns())
    return (
        f"WITH held AS MATERIALIZED (SELECT job_id FROM {claimed} "
        f"WHERE process_id = %s AND job_id = ANY(%s::bigint[]) ORDER BY job_id FOR UPDATE) "
        f"SELECT {columns} FROM {job} AS j JOIN held ON held.job_id = j.id "
        f"ORDER BY j.priority DESC, j.id"
    )


def start_columns() -> list[str]:
    """The columns of ``StartRow``'s fields, in its order: each is its field's name (none
    is a relation), and ``pk`` is ``id``."""
    return ["id" if name == "pk" else name for name in StartRow._fields]


def lock_rate_rows(db: str, keys: Iterable[str]) -> list[RateLimit]:
    """Lock the ``RateLimit`` rows of ``keys`` in ascending key order by code point
    (collation "C", as Python sorts): PostgreSQL locks the sorted rows in turn."""
    keys = sorted(set(keys))
    if not keys:
        return []
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(lock_rate_statement(db), [keys])
        rows = cursor.fetchall()
    locked = []
    for pk, key, limit, period, starts, planned, created_at, updated_at in rows:
        values = [pk, key, limit, period, json_list(starts), json_list(planned)]
        locked.append(RateLimit.from_db(db, RATE_FIELDS, [*values, created_at, updated_at]))
    return locked


# A rate row's columns, in the model's order (``Model.from_db`` takes a full row in it).
RATE_FIELDS = ("id", "key", "limit", "period", "starts", "planned", "created_at", "updated_at")


@functools.cache
def lock_rate_statement(db: str) -> str:
    quote = connections[db].ops.quote_name
    columns = ", ".join(quote(name) for name in RATE_FIELDS)
    return (
        f"SELECT {columns} FROM {quote(RateLimit._meta.db_table)} WHERE key = ANY(%s::text[]) "
        f'ORDER BY key COLLATE "C" FOR UPDATE'
    )


def write_rated_starts(
    db: str,
    windows: Sequence[RateLimit],
    rows: list[StartRow],
    worker_id: str,
    now: datetime,
    starts: dict[int, datetime],
) -> dict[int, Started]:
    """Write the locked rate rows ``windows`` (their new starts, plan and rate set on
    them) and count the attempt of each job of ``rows`` (read under its claim's lock),
    in one statement; returns each start as written, as ``Operations.write_starts``
    writes it: a rate-limited job's recorded start is ``starts[pk]``, another's ``now``."""
    if not windows and not rows:
        return {}
    written: dict[int, Started] = {}
    stamps, workers = [], []
    for row in rows:
        stamp = now if row.rate_key is None else starts[row.pk]
        worker_ids = [*(row.worker_ids or []), worker_id]
        written[row.pk] = Started(row.attempts + 1, worker_ids, row.started_at or stamp, stamp)
        stamps.append(stamp)
        workers.append(json.dumps(worker_ids))
    params: dict[str, Any] = {
        "rate_ids": [row.pk for row in windows],
        "starts": [json.dumps(row.starts) for row in windows],
        "planned": [json.dumps(row.planned) for row in windows],
        "limits": [row.limit for row in windows],
        "periods": [row.period for row in windows],
        "now": now,
        "ids": [row.pk for row in rows],
        "attempts": [row.attempts + 1 for row in rows],
        "workers": workers,
        "stamps": stamps,
        "running": JobStatus.RUNNING,
        "start": UniqueUntil.START,
    }
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(write_statement(db), params)
    return written


@functools.cache
def write_statement(db: str) -> str:
    """The windows' UPDATE (a data-modifying CTE, run whether read or not), then the
    starts' UPDATE: the portable ``write_starts``' columns, per job from arrays."""
    quote = connections[db].ops.quote_name
    job, rate = quote(Job._meta.db_table), quote(RateLimit._meta.db_table)
    return (
        f"WITH windows AS (UPDATE {rate} AS r SET starts = w.starts::jsonb, "
        f"planned = w.planned::jsonb, {quote('limit')} = w.lim, {quote('period')} = w.period, "
        f"updated_at = %(now)s "
        f"FROM UNNEST(%(rate_ids)s::bigint[], %(starts)s::text[], %(planned)s::text[], "
        f"%(limits)s::integer[], %(periods)s::float8[]) AS w(id, starts, planned, lim, period) "
        f"WHERE r.id = w.id) "
        f"UPDATE {job} AS j SET status = %(running)s, attempts = s.attempts, "
        f"worker_ids = s.workers::jsonb, started_at = COALESCE(j.started_at, s.stamp), "
        f"last_attempted_at = s.stamp, "
        f"unique_lock = CASE WHEN j.unique_until = %(start)s THEN NULL ELSE j.unique_lock END, "
        f"rate_reserved_at = CASE WHEN j.rate_key IS NULL THEN j.rate_reserved_at END "
        f"FROM UNNEST(%(ids)s::bigint[], %(attempts)s::integer[], %(workers)s::text[], "
        f"%(stamps)s::timestamptz[]) AS s(id, attempts, workers, stamp) "
        f"WHERE j.id = s.id"
    )
