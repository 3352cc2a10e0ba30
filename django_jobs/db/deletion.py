"""Deleting execution rows by job id, locking no row but those.

On InnoDB (MariaDB/MySQL), ``DELETE ... WHERE job_id IN (...)`` on a small
table (the claims of a few workers, the tail of a drained ready table) is run
as a full scan, and a DELETE, unlike an UPDATE, gets no semi-consistent read in
READ COMMITTED: it waits for the lock of every row it reads, including the rows
other workers hold. Two finishing workers, each holding its own claims, each
scanning into the other's: a deadlock (and the same for two claimers deleting
the ready rows they picked; tests/test_finish_races.py forces both). There the
ids become a derived table joined first (``STRAIGHT_JOIN``), so each row is
reached by a primary-key lookup that locks that row alone: still one statement.
PostgreSQL and SQLite delete an ``IN`` list: PostgreSQL never waits for a row
its DELETE does not remove, and SQLite has no row locks.
"""

from __future__ import annotations

from collections.abc import Collection

from django.db import connections, models

# Ids per statement on InnoDB: the derived table is a UNION ALL of one SELECT each.
CHUNK = 500


def delete_executions(db: str, model: type[models.Model], job_ids: Collection[int]) -> int:
    """Delete the rows of ``model`` (keyed by ``job_id``) for ``job_ids``; return how many."""
    if not job_ids:
        return 0
    connection = connections[db]
    if connection.vendor != "mysql":
        return model.objects.using(db).filter(job_id__in=list(job_ids)).delete()[0]
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    ids = sorted(job_ids)
    deleted = 0
    with connection.cursor() as cursor:
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            derived = " UNION ALL ".join(["SELECT %s AS job_id"] * len(chunk))
            cursor.execute(
                f"DELETE rows_ FROM ({derived}) AS ids_ STRAIGHT_JOIN {table} AS rows_ "
                f"ON rows_.job_id = ids_.job_id",
                chunk,
            )
            deleted += cursor.rowcount
    return deleted
