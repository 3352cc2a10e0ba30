"""Claiming, starting and finishing on PostgreSQL in one statement each.

Through the ORM a claim is BEGIN, a locking SELECT, a read of the jobs, the
claimed rows' INSERT, the ready rows' DELETE, the jobs' UPDATE and COMMIT:
seven round trips before a job can start, and starting it is five more. Here a
worker's claim starts the jobs too (one statement for both) unless their start
needs a decision of its own. On
PostgreSQL data-modifying CTEs do each in one statement, atomic in autocommit,
with the same locks in the same order (ready rows with ``SKIP LOCKED``, then
the jobs; for a start, this process's claimed rows, then the jobs), so the
guarantees of ``core.ready.claim_jobs`` and ``core.starting.start_jobs`` hold unchanged.
Queue caps (``max_concurrency``) keep the ORM path: they lock a cap row first.
A finish is one statement for jobs with no batch and no workflow (a batch's row,
and a workflow's dependents, need the ORM path); with concurrency keys it runs in
the transaction that then frees their slots (``db/postgresql/admission.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.models import Q

from django_jobs.db.base import column
from django_jobs.db.job_rows import job_from_row
from django_jobs.db.notify import jobs_ready
from django_jobs.db.postgresql.admission import lock_statement, recount_params, recount_statement
from django_jobs.db.postgresql.cursors import bound_cursor, unprepared_cursor
from django_jobs.db.rows import Started
from django_jobs.limits import MAX_SECONDS
from django_jobs.models import (
    ClaimedExecution,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    UniqueUntil,
)

try:
    from psycopg import ClientCursor
except ImportError:  # psycopg2, or no PostgreSQL driver installed at all
    ClientCursor = None  # type: ignore[assignment,misc]  # the usual optional import


def claim_matching(
    db: str,
    process_id: int,
    condition: Q,
    limit: int,
    now: datetime,
    worker_id: str | None = None,
) -> list[Job]:
    """Claim up to ``limit`` ready jobs matching ``condition`` in unpaused queues;
    return them, claimed.

    With ``worker_id`` the claim is also the start of every job it can be: the
    attempt is counted in the same UPDATE (``RUNNING``, as ``start_held`` would
    write it), which saves the start's round trip and a second new version of
    each job row. A job whose start needs a decision under another lock (a rate
    limit) or that lets go of a unique key as it starts (``unique_until="start"``,
    which a hand-back could not take back) is only claimed (``CLAIMED``) and
    started by ``core.starting.start_jobs``. A worker that ends up not running a job it
    started this way hands it back with the start undone (``core.claimed.undo_start``).
    """
    sql, picked_params = claim_statement(db, condition, limit, worker_id is not None)
    if worker_id is None:
        moved_params: list[Any] = [JobStatus.CLAIMED]
    else:
        start = UniqueUntil.START
        moved_params = [
            start,
            JobStatus.RUNNING,
            JobStatus.CLAIMED,
            start,
            start,
            json.dumps([worker_id]),
            start,
            now,
            start,
            now,
        ]
    params = [process_id, *picked_params, *moved_params, process_id, now, now]
    connection = connections[db]
    with unprepared_cursor(connection) as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    jobs = [job_from_row(db, connection, row) for row in rows]
    jobs.sort(key=lambda job: (-job.priority, job.pk))
    return jobs


@functools.lru_cache(maxsize=256)
def claim_statement(
    db: str, condition: Q, limit: int, starts: bool
) -> tuple[str, tuple[object, ...]]:
    """The claim's SQL and the parameters of its ``picked`` part, built once per
    pattern, batch size and mode: compiling the queryset on every claim cost more
    than the statement's execution (a claim is what bounds a worker's rate)."""
    connection = connections[db]
    paused = Pause.objects.using(db).values("queue_name")
    picked = (
        ReadyExecution.objects.using(db)
        .filter(condition)
        .exclude(queue_name__in=paused)
        .order_by("-priority", "turn", "job_id")
        .values("job_id")[:limit]
    )
    picked_sql, picked_params = picked.query.get_compiler(using=db).as_sql()
    # Added here: Django refuses to compile a locking read outside a transaction, and
    # this statement is its own transaction.
    picked_sql += " FOR UPDATE SKIP LOCKED"
    quote = connection.ops.quote_name
    job, ready, claimed, process = (
        quote(model._meta.db_table) for model in (Job, ReadyExecution, ClaimedExecution, Process)
    )
    columns = ", ".join(f"{job}.{quote(column(f))}" for f in Job._meta.concrete_fields)
    if not starts:
        moved = f"UPDATE {job} SET status = %s "
    else:
        starting = f"({job}.rate_key IS NULL AND {job}.unique_until IS DISTINCT FROM %s)"
        moved = (
            f"UPDATE {job} SET "
            f"status = CASE WHEN {starting} THEN %s ELSE %s END, "
            f"attempts = attempts + CASE WHEN {starting} THEN 1 ELSE 0 END, "
            f"worker_ids = CASE WHEN {starting} "
            f"THEN COALESCE(worker_ids, '[]'::jsonb) || %s::jsonb ELSE worker_ids END, "
            f"started_at = CASE WHEN {starting} THEN COALESCE(started_at, %s) "
            f"ELSE started_at END, "
            f"last_attempted_at = CASE WHEN {starting} THEN %s ELSE last_attempted_at END "
        )
    # The process's own row first (Operations.lock_own_process says why): an uncorrelated
    # EXISTS is a one-time filter, checked before the ready rows are read, so a process
    # pruned as dead claims nothing and locks no ready row. Read, not locked: the
    # statement's one snapshot is enough for what matters, as a job the prune recovered
    # became ready only after its delete of the row committed, so no snapshot sees both
    # the row and that job. A claim whose snapshot is older than the delete may still
    # land after the prune's recovery, claims the next prune's sweep of orphans recovers
    # (docs/design.md section 4). FOR KEY SHARE here cost 9% of the no-op drain and 10%
    # of the workers' CPU per job (bench/ab_drain.py, 3 rounds, same run).
    sql = (
        f"WITH alive AS (SELECT id FROM {process} WHERE id = %s), "
        f"picked AS ({picked_sql}), "
        f"taken AS (DELETE FROM {ready} WHERE EXISTS (SELECT 1 FROM alive) "
        f"AND job_id IN (SELECT job_id FROM picked) RETURNING job_id), "
        f"moved AS ({moved}FROM taken WHERE {job}.id = taken.job_id "
        f"RETURNING {columns}), "
        f"held AS (INSERT INTO {claimed} (job_id, process_id, queue_name, concurrency_key, "
        f"lease_expires_at, batch_id, created_at) "
        f"SELECT id, %s, queue_name, concurrency_key, "
        f"CASE WHEN concurrency_key IS NOT NULL AND concurrency_duration IS NOT NULL "
        # Bounded as limits.later() bounds it: a row's infinite or negative duration
        # must not make the claim, every worker's, fail with "interval out of range".
        f"THEN %s + GREATEST(0, LEAST(concurrency_duration, {MAX_SECONDS})) "
        f"* interval '1 second' END, batch_id, %s FROM moved) "
        f"SELECT * FROM moved"
    )
    return sql, tuple(picked_params)


def start_held(
    db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
) -> dict[int, Started]:
    """Count an attempt for each job whose claim this process holds (locked first).

    Returns each one's start as written. A claim gone (recovered, pruned) leaves
    its job out: the locking subquery skips a row deleted while it waited.
    """
    params: list[Any] = [
        JobStatus.RUNNING,
        json.dumps([worker_id]),
        now,
        now,
        UniqueUntil.START,
        process_id,
        list(job_ids),
    ]
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(start_statement(db), params)
        rows = cursor.fetchall()
    return {
        pk: Started(
            attempts,
            json.loads(worker_ids) if isinstance(worker_ids, str) else worker_ids,
            started_at,
            last_attempted_at,
        )
        for pk, attempts, worker_ids, started_at, last_attempted_at in rows
    }


@functools.cache
def start_statement(db: str) -> str:
    """Start held claims: count an attempt of each job of ``%s`` (ids) whose claim process
    ``%s`` holds, its claimed rows locked first in id order."""
    quote = connections[db].ops.quote_name
    job, claimed = quote(Job._meta.db_table), quote(ClaimedExecution._meta.db_table)
    return (
        f"UPDATE {job} SET status = %s, attempts = attempts + 1, "
        f"worker_ids = COALESCE(worker_ids, '[]'::jsonb) || %s::jsonb, "
        f"started_at = COALESCE(started_at, %s), last_attempted_at = %s, "
        f"unique_lock = CASE WHEN unique_until = %s THEN NULL ELSE unique_lock END "
        f"WHERE id IN (SELECT job_id FROM {claimed} WHERE process_id = %s "
        f"AND job_id = ANY(%s) ORDER BY job_id FOR UPDATE) "
        f"RETURNING id, attempts, worker_ids, started_at, last_attempted_at"
    )


def finish_unbatched(
    db: str,
    process_id: int,
    return_values: dict[int, object],
    now: datetime,
    *,
    keyed: bool = False,
) -> dict[int, str | None]:
    """Record the success of the jobs of ``return_values`` that have no batch (and,
    unless ``keyed``, no concurrency key) and whose claim this process holds.

    Returns ``{job id: its concurrency key or None}`` for those finished. One
    statement with ``core.claimed.finish_jobs``'s locks in its order: this process's
    claimed rows (``FOR UPDATE``; one deleted meanwhile by a recovery is skipped:
    exactly once), then their jobs. Through the ORM the same finish is BEGIN, the
    locking SELECT, the DELETE, the UPDATE, the return values' UPDATE and COMMIT.

    Without ``keyed`` it is a transaction of its own (autocommit). With it, the
    caller runs it inside the transaction that then frees the returned keys'
    slots (``admission.release_slots``), after these claims' locks (docs/design.md
    section 4). The others are left to the caller.
    """
    params = finish_params(process_id, return_values, now)
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(finish_statement(db, "any" if keyed else "none"), params)
        return dict(cursor.fetchall())


def finish_keyed(
    db: str,
    process_id: int,
    return_values: dict[int, object],
    keys: Collection[str],
    now: datetime,
) -> dict[int, str] | None:
    """:func:`finish_unbatched` for jobs with a concurrency key, and the release of
    their slots, in one message to the server: three statements that it runs as
    one transaction (the simple query protocol's implicit transaction block).

    ``keys``: the jobs' keys, as the caller read them with the jobs. Only claims of
    those keys are finished, so every key a finish frees is one whose semaphore
    the second statement locks (ascending, after the claims: docs/design.md section
    4) and the third recounts. Each statement takes its own snapshot, so the
    recount sees every holder committed before the locks were granted, as
    ``admission.release_slots`` requires. A key locked for a job whose claim was
    gone is recounted for nothing, which changes nothing. An error in any of
    the three rolls all three back.

    One round trip where BEGIN, the finish, the lock, the recount and COMMIT
    take five. Returns None, having done nothing, when the connection binds
    parameters on the server (``OPTIONS["server_side_binding"]``): a prepared
    statement is one statement, and the caller takes the transactional path.
    """
    connection = connections[db]
    params = {
        **finish_params(process_id, return_values, now),
        **recount_params(sorted(set(keys)), now),
    }
    sql = ";\n".join((finish_statement(db, "listed"), lock_statement(db), recount_statement(db)))
    with connection.cursor() as cursor:
        if ClientCursor is None or not isinstance(cursor.cursor, ClientCursor):
            return None
        cursor.execute(sql, params)
        finished = dict(cursor.fetchall())
        cursor.nextset()  # the semaphores' lock: nothing to read
        cursor.nextset()
        queues = [row[0] for row in cursor.fetchall()]
    if queues:
        jobs_ready(db, queues)
    return finished


def finish_params(
    process_id: int, return_values: dict[int, object], now: datetime
) -> dict[str, Any]:
    encoder = Job._meta.get_field("return_value").encoder
    return {
        "process": process_id,
        "ids": list(return_values),
        "values": [
            None if value is None else json.dumps(value, cls=encoder)
            for value in return_values.values()
        ],
        "succeeded": JobStatus.SUCCEEDED,
        "now": now,
    }


def finish_with_dependents(
    db: str, process_id: int, return_values: dict[int, object], now: datetime
) -> dict[int, tuple[str | None, int | None]]:
    """:func:`finish_unbatched` for jobs of a workflow (any key, no batch), inside the
    caller's transaction, which then frees their keys' slots and releases their
    dependents: ``{job id: (its concurrency key, its workflow)}`` for those finished,
    the workflow read from the row this statement updated (under its lock)."""
    params = finish_params(process_id, return_values, now)
    with bound_cursor(connections[db]) as cursor:
        cursor.execute(finish_statement(db, "any", dependents=True), params)
        return {pk: (key, workflow_id) for pk, key, workflow_id in cursor.fetchall()}


@functools.cache
def finish_statement(db: str, keys: str, dependents: bool = False) -> str:
    """The finish of :func:`finish_unbatched`. ``keys``: which claims it may finish
    beside those without a key: "none", "any", or "listed" (those of ``%(keys)s``).
    ``dependents``: jobs of a workflow too, their workflow returned third."""
    connection = connections[db]
    quote = connection.ops.quote_name
    job, claimed = quote(Job._meta.db_table), quote(ClaimedExecution._meta.db_table)
    which = {
        "none": "AND concurrency_key IS NULL ",
        "any": "",
        "listed": "AND concurrency_key = ANY(%(keys)s) ",
    }[keys]
    # The job's row is updated before its claim is deleted, and only if it is of no
    # workflow: an enqueue that waits for it marks it with one under the row's lock,
    # which this UPDATE rechecks once it holds that lock. Such a job keeps its claim
    # here, and the caller finishes it on the path that releases its dependents.
    return (
        f"WITH held AS (SELECT job_id, concurrency_key FROM {claimed} "
        f"WHERE process_id = %(process)s "
        f"AND job_id = ANY(%(ids)s) {which}AND batch_id IS NULL "
        f"ORDER BY job_id FOR UPDATE), "
        f"outcome AS (SELECT * FROM UNNEST(%(ids)s::bigint[], %(values)s::text[]) "
        f"AS v(job_id, value)), "
        f"done AS (UPDATE {job} SET status = %(succeeded)s, finished_at = %(now)s, "
        f"unique_lock = NULL, return_value = outcome.value::jsonb "
        f"FROM held JOIN outcome ON outcome.job_id = held.job_id "
        f"WHERE {job}.id = held.job_id{'' if dependents else f' AND {job}.workflow_id IS NULL'} "
        f"RETURNING {job}.id, held.concurrency_key, {job}.workflow_id), "
        f"gone AS (DELETE FROM {claimed} AS c USING done WHERE c.job_id = done.id) "
        f"SELECT id, concurrency_key{', workflow_id' if dependents else ''} FROM done"
    )
