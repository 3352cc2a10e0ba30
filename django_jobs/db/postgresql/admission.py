"""Freeing slots on PostgreSQL: recount the holders and promote the next blocked jobs
in one statement.

Through the ORM, after the semaphores are locked (``admission.lock_semaphores``),
a release is a count of the holders, a windowed read of the blocked jobs, the
blocked rows' DELETE, the ready rows' INSERT, the jobs' UPDATE and one UPDATE
per distinct semaphore value: six round trips or more, in every finish, failure,
snooze and hand-back of a keyed job. Here data-modifying CTEs do it all in one.

It must be a statement of its own, run after the semaphores' locks are granted:
under READ COMMITTED its snapshot is taken when it starts, so it counts every
holder committed before the locks. (Counting inside the locking statement would
read the snapshot from before the lock wait.) The rows it writes are those the
ORM path writes, in the same lock order: the semaphores are held; blocked,
ready and job rows of their keys come after.
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import Any

from django.db import connections

from django_jobs.db.notify import jobs_ready
from django_jobs.limits import TURN_SCALE
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    Semaphore,
)


def recount_and_promote(db: str, semaphores: list[Semaphore], now: datetime) -> int:
    """Set each locked semaphore's free slots from its holders, filling them with its
    key's next blocked jobs (priority, then age); returns how many were promoted."""
    if not semaphores:
        return 0
    params = recount_params([row.key for row in semaphores], now)
    with connections[db].cursor() as cursor:
        cursor.execute(recount_statement(db), params)
        queues = [row[0] for row in cursor.fetchall()]
    if queues:
        jobs_ready(db, queues)
    return len(queues)


def recount_params(keys: list[str], now: datetime) -> dict[str, Any]:
    return {"keys": keys, "now": now, "ready": JobStatus.READY}


@cache
def lock_statement(db: str) -> str:
    """Lock the semaphores of ``%(keys)s`` in ascending key order, by code point
    (``admission.lock_semaphores``' order; PostgreSQL locks the sorted rows in turn)."""
    quote = connections[db].ops.quote_name
    return (
        f"SELECT 1 FROM {quote(Semaphore._meta.db_table)} WHERE key = ANY(%(keys)s) "
        f'ORDER BY key COLLATE "C" FOR UPDATE'
    )


@cache
def recount_statement(db: str) -> str:
    """The recount and promotion of the (locked) semaphores of ``%(keys)s``; gives the
    queue of each job promoted."""
    connection = connections[db]
    quote = connection.ops.quote_name
    job, ready, claimed, blocked, semaphore = (
        quote(model._meta.db_table)
        for model in (Job, ReadyExecution, ClaimedExecution, BlockedExecution, Semaphore)
    )
    limit = quote("limit")
    fifo = f"picked.job_id * {TURN_SCALE}"
    return (
        f"WITH held AS ("
        f"SELECT concurrency_key AS key, count(*) AS n FROM {ready} "
        f"WHERE concurrency_key = ANY(%(keys)s) GROUP BY concurrency_key "
        f"UNION ALL "
        f"SELECT concurrency_key, count(*) FROM {claimed} "
        f"WHERE concurrency_key = ANY(%(keys)s) "
        f"AND (lease_expires_at IS NULL OR lease_expires_at >= %(now)s) "
        f"GROUP BY concurrency_key), "
        f"room AS (SELECT s.id, s.key, s.{limit} - COALESCE(SUM(held.n), 0) AS free "
        f"FROM {semaphore} AS s LEFT JOIN held ON held.key = s.key "
        f"WHERE s.key = ANY(%(keys)s) GROUP BY s.id, s.key, s.{limit}), "
        f"ranked AS (SELECT job_id, queue_name, priority, concurrency_key, "
        f"row_number() OVER (PARTITION BY concurrency_key "
        f"ORDER BY priority DESC, job_id) AS position "
        f"FROM {blocked} WHERE concurrency_key = ANY(%(keys)s)), "
        f"picked AS (SELECT ranked.* FROM ranked JOIN room ON room.key = ranked.concurrency_key "
        f"WHERE ranked.position <= room.free), "
        f"unblocked AS (DELETE FROM {blocked} AS b USING picked "
        f"WHERE b.job_id = picked.job_id), "
        f"readied AS (INSERT INTO {ready} (job_id, queue_name, priority, concurrency_key, "
        f"created_at, is_async, turn) SELECT picked.job_id, picked.queue_name, picked.priority, "
        f"picked.concurrency_key, %(now)s, j.is_async, "
        # core.fairness.ready_turns(at_head=True): the FIFO turn, or in a fair queue its
        # level's head (read only for those).
        f"CASE WHEN j.fair_key IS NULL THEN {fifo} ELSE COALESCE((SELECT min(h.turn) "
        f"FROM {ready} AS h WHERE h.queue_name = picked.queue_name "
        f"AND h.priority = picked.priority), {fifo}) END "
        f"FROM picked JOIN {job} AS j ON j.id = picked.job_id "
        f"RETURNING job_id, queue_name), "
        f"marked AS (UPDATE {job} SET status = %(ready)s FROM picked "
        f"WHERE {job}.id = picked.job_id), "
        f"per_key AS (SELECT concurrency_key, count(*) AS n FROM picked "
        f"GROUP BY concurrency_key), "
        f"counted AS (UPDATE {semaphore} AS s SET value = room.free - COALESCE(per_key.n, 0), "
        f"updated_at = %(now)s FROM room LEFT JOIN per_key ON per_key.concurrency_key = room.key "
        f"WHERE s.id = room.id) "
        f"SELECT queue_name FROM readied"
    )
