"""A rate-limited start on PostgreSQL: one statement when the limit does not hold it back, else
four statements written once, where the ORM built six.

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

Before that transaction, a start tries :func:`start_rated`: 1, 2, the decision and 3 in
one statement, in autocommit, for the starts it can decide exactly as ``Window`` does
with every job admitted (a limit that does not hold the start back). One round trip
where the transaction takes five (BEGIN, three statements, COMMIT), and no window
read into Python. What it leaves (a job would wait, a window it does not read as
``Window`` reads it) it leaves having written nothing, and the transaction decides:
one round trip more for those (docs/rate_limits.md, "What it costs").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import connections

from django_jobs.db.base import column, start_fields
from django_jobs.db.postgresql.cursors import bound_cursor
from django_jobs.db.rows import Started, StartRow
from django_jobs.limits import MAX_SECONDS
from django_jobs.models import ClaimedExecution, Job, JobStatus, RateLimit, UniqueUntil
from django_jobs.tasks.rates import MAX_STARTS_PER_PERIOD, MIN_PERIOD


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
    """The columns of ``StartRow``'s fields, in its order (``base.start_fields``)."""
    return [column(field) for field in start_fields()]


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
    starts' UPDATE: the portable ``write_starts``' columns, per job from arrays.

    Each UPDATE also names its ids as ``= ANY(array)``, which the join to the arrays
    already implies: it lets the cached generic plan reach the rows by their primary key.
    Joined to the arrays alone, it read the whole rate table (a hash join over a
    sequential scan, the cheaper plan by its guess): 0.43 ms against 0.14 for three rows
    of a thousand keys (EXPLAIN ANALYZE of the generic plan)."""
    quote = connections[db].ops.quote_name
    job, rate = quote(Job._meta.db_table), quote(RateLimit._meta.db_table)
    return (
        f"WITH windows AS (UPDATE {rate} AS r SET starts = w.starts::jsonb, "
        f"planned = w.planned::jsonb, {quote('limit')} = w.lim, {quote('period')} = w.period, "
        f"updated_at = %(now)s "
        f"FROM UNNEST(%(rate_ids)s::bigint[], %(starts)s::text[], %(planned)s::text[], "
        f"%(limits)s::integer[], %(periods)s::float8[]) AS w(id, starts, planned, lim, period) "
        f"WHERE r.id = w.id AND r.id = ANY(%(rate_ids)s::bigint[])) "
        f"UPDATE {job} AS j SET status = %(running)s, attempts = s.attempts, "
        f"worker_ids = s.workers::jsonb, started_at = COALESCE(j.started_at, s.stamp), "
        f"last_attempted_at = s.stamp, "
        f"unique_lock = CASE WHEN j.unique_until = %(start)s THEN NULL ELSE j.unique_lock END, "
        f"rate_reserved_at = CASE WHEN j.rate_key IS NULL THEN j.rate_reserved_at END "
        f"FROM UNNEST(%(ids)s::bigint[], %(attempts)s::integer[], %(workers)s::text[], "
        f"%(stamps)s::timestamptz[]) AS s(id, attempts, workers, stamp) "
        f"WHERE j.id = s.id AND j.id = ANY(%(ids)s::bigint[])"
    )


# --- a start decided and written by one statement --------------------------------------------


def start_rated(
    db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
) -> tuple[dict[int, Started] | None, list[str]]:
    """Start the jobs of ``job_ids`` whose claims ``process_id`` holds, rate limits decided,
    in one statement (its own transaction in autocommit). Returns each start as written,
    or None if it decided nothing; and the keys it found no row for.

    The statement locks what the transaction of ``core.starting.start_locked`` locks, in
    the same order (the claims in ascending job id, then the rate rows in ascending key
    order by code point), decides each key's jobs as ``core.rate_limits.Window`` would,
    in claim order, and writes the windows and the starts. It decides only what it can
    decide exactly as ``Window.decide`` does, and only when every job is admitted: a key
    whose window would send a job back to wait, that it cannot read as ``Window`` reads
    it, or that has no row, makes it write nothing and answer None, its locks released
    at its end, for the caller to create the missing rows and try again, or to start the
    jobs by the transaction. :func:`start_rated_statement` says which cases it takes,
    and why its answer is then the window's own.
    """
    clock = now.timestamp()
    params: dict[str, Any] = {
        "process": process_id,
        # As text: psycopg's dumper of a list of ints cost more than the rest of the
        # parameters together.
        "ids": "{" + ",".join(str(int(pk)) for pk in job_ids) + "}",
        "clock": clock,
        "clock_json": json.dumps(clock),
        "now": now,
        "worker": json.dumps([worker_id]),
    }
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(start_rated_statement(db), params)
        rows = cursor.fetchall()
    ok, missing = rows[0][:2]
    if not ok:
        return None, list(missing or ())
    started = {
        pk: Started(attempts, json_list(worker_ids), started_at, last_attempted_at)
        for _, _, pk, attempts, worker_ids, started_at, last_attempted_at in rows
        if pk is not None
    }
    return started, []


@functools.cache
def start_rated_statement(db: str) -> str:
    """The statement of :func:`start_rated`, in the order it runs. Under 4,096 characters,
    so that psycopg keeps its conversion of the placeholders (longer statements are
    converted again at every execution: a tenth of a rated start's CPU).

    Locks: ``h`` locks the claims (ascending job id); ``j`` reads their jobs; ``w`` groups
    the jobs by key, so it has read every job, and every claim is locked, before it
    yields its first key; ``l`` sorts the keys (collation "C", a subquery's ``ORDER BY``,
    which the planner keeps) and locks each key's rate row in that order, one lookup of
    the key's index per key (a ``LATERAL`` locking read). A locked row is read as it is
    once locked (READ COMMITTED reads again a row updated meanwhile), never as the
    statement's snapshot has it: every window is read from ``l``.

    Why ``j`` joins ``h`` and ``l`` is lateral: the statement runs on a cached generic
    plan, which guesses 10 rows for ``= ANY(ARRAY(subquery))``. Reading the jobs and the
    rate rows that way, it scanned the whole rate table twice (to lock, then to update),
    as the cheaper plan for a table of a thousand keys: 0.45 ms of a 0.72 ms statement,
    measured. ``h`` is guessed from the claims' index, one row, and the lateral read can
    only be a lookup, so the plan stays lookups at any size of the tables.

    Reading a window as ``Window`` does (``e``, then ``x``): each element of ``starts``
    and ``planned`` that is a JSON number, as a float8 (the cast and Python's
    ``float()`` both round the decimal correctly, to the same double), those after the
    horizon (now plus a century) dropped, anything not a number dropped, as ``times()``
    and ``decide()`` drop them. A number beyond 1e15 or (but 0) within 1e-6 of 0 is no
    start time, and one past a float's range would fail the cast where Python drops it:
    its key is not decided here (``t`` is NULL for it).

    The decision (``c``, then ``d``): a key's ``m`` jobs are all admitted at ``c``, the
    later of now and the last of its starts, if its row was locked; its jobs carry one
    rate within ``usable_rate``'s bounds (L starts per T seconds); its starts after
    ``c - T``, plus ``m``, are at most L (no job finds the window full, and ``starts``
    is never cut); no planned time is after ``c`` (no job without a reservation queues
    behind the plan); and no job's reservation is ``c`` itself. Then, as
    ``Window.admit`` run m times: ``starts`` is the kept starts after ``c - T``, in
    their order, and m times ``c``; ``planned`` is the kept plan less, for each
    reserved time, as many of its copies as jobs reserved it (at most as many as it
    holds), plus m times ``c``, the L latest, ascending. Cutting to L at each
    admission, as ``admit`` does, or once at the end is the same when ``c`` is the
    latest time (docs/rate_limits.md). Times are compared as float8, as Python compares
    floats, and every element written is one the row held or ``c`` as Python writes it
    (``clock_json``), never a float8 printed by the server. A start time is
    ``datetime.fromtimestamp(c, UTC)``: whole seconds, plus the fraction's microseconds
    rounded half to even (``round`` of a float8).

    ``v`` is false if any key's jobs are not all admitted: then neither UPDATE writes a
    row, and the one row returned says so in its first column, and names the keys that
    have no row in its second.
    """
    quote = connections[db].ops.quote_name
    job, claimed = quote(Job._meta.db_table), quote(ClaimedExecution._meta.db_table)
    rate = quote(RateLimit._meta.db_table)
    clock = "%(clock)s::float8"
    horizon = f"{clock} + {MAX_SECONDS!r}::float8"  # as Window.decide adds them
    return (
        f"WITH h AS MATERIALIZED (SELECT job_id FROM {claimed} WHERE process_id = "
        f"%(process)s AND job_id = ANY(%(ids)s::bigint[]) ORDER BY job_id FOR UPDATE), "
        f"j AS MATERIALIZED (SELECT id, rate_key AS k, rate_limit AS n, rate_period AS p, "
        f"EXTRACT(EPOCH FROM rate_reserved_at)::float8 AS r FROM {job} "
        f"JOIN h ON h.job_id = id), "
        f"w AS MATERIALIZED (SELECT k, count(*) AS m, min(n) AS n, max(n) AS n2, "
        f"min(p) AS p, max(p) AS p2 FROM j WHERE k IS NOT NULL GROUP BY k), "
        f'l AS MATERIALIZED (SELECT r.* FROM (SELECT k FROM w ORDER BY k COLLATE "C") AS o, '
        f"LATERAL (SELECT id, key AS k, starts, planned FROM {rate} WHERE key = o.k "
        f"FOR UPDATE) AS r), "
        f"e AS MATERIALIZED (SELECT k, s, o, v, n, CASE WHEN n = 0 OR abs(n) "
        f"BETWEEN 1e-6 AND 1e15 THEN n::float8 END AS t FROM (SELECT l.k, a.s, a.o, a.v, "
        f"CASE WHEN jsonb_typeof(a.v) = 'number' THEN a.v::numeric END AS n FROM l, "
        f"LATERAL (SELECT true AS s, o, v FROM jsonb_array_elements(CASE WHEN "
        f"jsonb_typeof(l.starts) = 'array' THEN l.starts ELSE '[]' END) "
        f"WITH ORDINALITY AS b(v, o) UNION ALL SELECT false, o, v FROM "
        f"jsonb_array_elements(CASE WHEN jsonb_typeof(l.planned) = 'array' "
        f"THEN l.planned ELSE '[]' END) WITH ORDINALITY AS b(v, o)) AS a) AS b), "
        f"x AS MATERIALIZED (SELECT k, s, o, v, t FROM e WHERE t <= {horizon}), "
        f"c AS MATERIALIZED (SELECT w.k, w.m, w.n, w.p, l.id, "
        f"GREATEST({clock}, z.t) AS c, "
        f"CASE WHEN z.t > {clock} THEN z.v ELSE %(clock_json)s::jsonb END AS cj, "
        f"COALESCE(l.id IS NOT NULL AND w.n = w.n2 AND w.p = w.p2 "
        f"AND w.n BETWEEN 1 AND {MAX_STARTS_PER_PERIOD} "
        f"AND w.p BETWEEN {MIN_PERIOD!r}::float8 AND {MAX_SECONDS!r}::float8 "
        f"AND NOT EXISTS (SELECT FROM e WHERE e.k = w.k AND e.n IS NOT NULL "
        f"AND e.t IS NULL), false) AS ok FROM w LEFT JOIN l ON l.k = w.k "
        f"LEFT JOIN LATERAL (SELECT t, v FROM x WHERE x.k = w.k AND x.s "
        f"ORDER BY o DESC LIMIT 1) AS z ON true), "
        f"d AS MATERIALIZED (SELECT c.*, COALESCE(ok AND (SELECT count(*) FROM x "
        f"WHERE x.k = c.k AND x.s AND x.t > c.c - c.p) + c.m <= c.n "
        f"AND NOT EXISTS (SELECT FROM x WHERE x.k = c.k AND NOT x.s AND x.t > c.c) "
        f"AND NOT EXISTS (SELECT FROM j WHERE j.k = c.k AND j.r = c.c), false) AS ok2 "
        f"FROM c), "
        f"v AS MATERIALIZED (SELECT COALESCE(bool_and(ok2), true) AS ok FROM d), "
        f"u AS (UPDATE {rate} AS r SET starts = COALESCE((SELECT jsonb_agg(v ORDER BY o) "
        f"FROM x WHERE x.k = d.k AND x.s AND x.t > d.c - d.p), '[]') "
        f"|| to_jsonb(array_fill(d.cj, ARRAY[d.m::int])), "
        f"planned = (SELECT jsonb_agg(v ORDER BY t) FROM (SELECT v, t FROM "
        f"(SELECT v, t, row_number() OVER (PARTITION BY t ORDER BY o) AS i FROM x "
        f"WHERE x.k = d.k AND NOT x.s) AS a "
        f"WHERE i > (SELECT count(*) FROM j WHERE j.k = d.k AND j.r = a.t) "
        f"UNION ALL SELECT d.cj, d.c FROM generate_series(1, d.m) "
        f"ORDER BY 2 DESC LIMIT d.n) AS b), "
        f"{quote('limit')} = d.n, {quote('period')} = d.p, updated_at = %(now)s "
        f"FROM d WHERE r.id = d.id AND (SELECT ok FROM v)), "
        f"s AS (UPDATE {job} AS q SET status = {literal(JobStatus.RUNNING)}, "
        f"attempts = q.attempts + 1, "
        f"worker_ids = COALESCE(q.worker_ids, '[]') || %(worker)s::jsonb, "
        f"started_at = COALESCE(q.started_at, z.at), last_attempted_at = z.at, "
        f"unique_lock = CASE WHEN q.unique_until = {literal(UniqueUntil.START)} THEN NULL "
        f"ELSE q.unique_lock END, "
        f"rate_reserved_at = CASE WHEN q.rate_key IS NULL THEN q.rate_reserved_at END "
        f"FROM (SELECT j.id, CASE WHEN d.c IS NULL THEN %(now)s::timestamptz "
        f"ELSE to_timestamp(trunc(d.c)) + round((d.c - trunc(d.c)) * 1e6::float8) "
        f"* interval '1 microsecond' END AS at FROM j LEFT JOIN d ON d.k = j.k) AS z "
        f"WHERE q.id = z.id AND (SELECT ok FROM v) "
        f"RETURNING q.id, q.attempts, q.worker_ids, q.started_at, q.last_attempted_at) "
        f"SELECT (SELECT ok FROM v), (SELECT array_agg(k) FROM c WHERE id IS NULL), s.* "
        f"FROM (SELECT) AS o LEFT JOIN s ON true"
    )


def literal(value: str) -> str:
    """One of our own constants (a status, a ``unique_until``) as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"
