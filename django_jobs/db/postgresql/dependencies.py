"""A dependency edge settled on PostgreSQL in one statement: the common case of a finish
that has dependents (every parent it settles succeeded).

Through the ORM that is five statements inside the finish's transaction (lock the edges,
flip them, lock the dependents' awaiting rows, read them, write their counts), each a
round trip while the dependents' rows stay locked; a wide fan-in's sink row, which every
finishing parent locks, was held that long by each finish in turn. Here one statement
takes the same locks in the same order (the edges by parent then id, then the awaiting
rows by job id, both ``ORDER BY ... FOR UPDATE``) and returns each dependent's new
count; ``core.dependencies`` then reads only the dependents that reached zero.
"""

from __future__ import annotations

import functools

from django.db import connections

from django_jobs.models import AwaitingExecution, JobDependency


def settle_succeeded(db: str, parent_ids: list[int]) -> list[tuple[int, int]]:
    """Settle the unsettled edges of the succeeded jobs ``parent_ids``: flip each, and
    take one off its dependent's count for each. Returns ``(dependent, remaining)`` for
    every dependent that still had an awaiting row.

    An edge another transaction settled while this one waited for it is skipped (the
    locking read rechecks ``settled`` on the row it finally locks), and a count is
    moved from its latest value (the UPDATE re-reads the row it waited for), so an edge
    counts once however many paths settle it at the same instant.
    """
    with connections[db].cursor() as cursor:
        cursor.execute(statement(db), [sorted(set(parent_ids))])
        return [(job_id, remaining) for job_id, remaining in cursor.fetchall()]


@functools.cache
def statement(db: str) -> str:
    quote = connections[db].ops.quote_name
    edges = quote(JobDependency._meta.db_table)
    awaiting = quote(AwaitingExecution._meta.db_table)
    return (
        f"WITH picked AS (SELECT id, job_id FROM {edges} "
        f"WHERE depends_on_id = ANY(%s) AND NOT settled "
        f"ORDER BY depends_on_id, id FOR UPDATE), "
        f"flipped AS (UPDATE {edges} AS e SET settled = TRUE FROM picked "
        f"WHERE e.id = picked.id RETURNING e.job_id), "
        f"counts AS (SELECT job_id, COUNT(*) AS n FROM picked GROUP BY job_id), "
        f"locked AS (SELECT a.job_id FROM {awaiting} AS a "
        f"WHERE a.job_id IN (SELECT job_id FROM counts) ORDER BY a.job_id FOR UPDATE), "
        f"moved AS (UPDATE {awaiting} AS a SET remaining = GREATEST(0, a.remaining - counts.n) "
        f"FROM counts, locked WHERE a.job_id = counts.job_id AND a.job_id = locked.job_id "
        f"RETURNING a.job_id, a.remaining) "
        f"SELECT job_id, remaining FROM moved ORDER BY job_id"
    )
