"""MariaDB and MySQL (InnoDB): locking reads lock every row they read, and rows are locked in
the order an index reads them, so deletes and multi-key locks are written to reach each row
by its own key."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from django.db import models
from django.db.models import QuerySet

from django_jobs.db import base
from django_jobs.db.base import RowT

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
