"""PostgreSQL: data-modifying CTEs do in one statement what the portable path does in a
transaction of several (claim and start, start, finish, recount and promote, insert), and
LISTEN/NOTIFY wakes idle workers. The statements are written in ``claims``, ``admission``,
``insert``, ``dependencies`` and ``rate_limits`` beside this module, each with its name and
purpose."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.db.models import Model, QuerySet
from django.db.models.functions import Collate

from django_jobs.db import base
from django_jobs.db.base import RowT
from django_jobs.db.postgresql import (
    admin_reads,
    admission,
    claims,
    dependencies,
    insert,
    pruning,
    rate_limits,
)
from django_jobs.db.rows import PrunedRound, Started, StartRow

if TYPE_CHECKING:
    from django.db.models import Q

    from django_jobs.models import Job, RateLimit, Semaphore


class Features(base.Features):
    can_claim_in_one_statement = True
    can_start_in_one_statement = True
    can_finish_in_one_statement = True
    can_promote_in_one_statement = True
    can_insert_ready_in_one_statement = True
    can_settle_in_one_statement = True
    # One statement starts rate-limited jobs when every one of them is admitted: it locks
    # and decides as core.starting.start_locked would, or writes nothing and says so
    # (Operations.start_rated). Not on base.Features yet: core reads it with getattr.
    can_start_rated_in_one_statement = True
    has_listen_notify = True
    # jsonb refuses \u0000, and text columns refuse NUL.
    refuses_nul_in_text = True
    can_prune_in_one_statement = True
    # One statement per round, locking only the rows it deletes: fewer commits (each a WAL
    # flush) for the same work, 58k against 46k jobs/s at 1,000 (bench/history.py).
    prune_batch_size = 5000

    @cached_property
    def can_listen(self) -> bool:  # type: ignore[override]
        """Through psycopg 3, which the listener and the notifier use."""
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        return bool(is_psycopg3)


class Operations(base.Operations):
    # KEY SHARE: the heartbeat's UPDATE (no key changed) goes on beside it; a DELETE waits.
    own_process_lock = " FOR KEY SHARE"

    def lock_in_key_order(self, rows: QuerySet[RowT], keys: Iterable[str]) -> list[RowT]:
        """One statement: PostgreSQL locks the rows of ``ORDER BY ... FOR UPDATE`` in the
        sorted order, sorted by code point (collation "C") as Python sorts."""
        keys = sorted(set(keys))
        if not keys:
            return []
        rows = rows.select_for_update().filter(key__in=keys)
        return list(rows.order_by(Collate("key", "C")))

    def claim_matching(
        self,
        db: str,
        process_id: int,
        condition: Q,
        limit: int,
        now: datetime,
        worker_id: str | None = None,
    ) -> list[Job]:
        return claims.claim_matching(db, process_id, condition, limit, now, worker_id)

    def start_held(
        self, db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
    ) -> dict[int, Started]:
        return claims.start_held(db, job_ids, process_id, worker_id, now)

    def finish_unbatched(
        self,
        db: str,
        process_id: int,
        return_values: dict[int, object],
        now: datetime,
        *,
        keyed: bool = False,
    ) -> dict[int, str | None]:
        return claims.finish_unbatched(db, process_id, return_values, now, keyed=keyed)

    def finish_keyed(
        self,
        db: str,
        process_id: int,
        return_values: dict[int, object],
        keys: Collection[str],
        now: datetime,
    ) -> list[int] | None:
        finished = claims.finish_keyed(db, process_id, return_values, keys, now)
        return None if finished is None else list(finished)

    def recount_and_promote(self, db: str, semaphores: list[Semaphore], now: datetime) -> int:
        return admission.recount_and_promote(db, semaphores, now)

    def finish_with_dependents(
        self, db: str, process_id: int, return_values: dict[int, object], now: datetime
    ) -> dict[int, tuple[str | None, int | None]]:
        return claims.finish_with_dependents(db, process_id, return_values, now)

    def settle_succeeded(self, db: str, parent_ids: list[int]) -> list[tuple[int, int]]:
        return dependencies.settle_succeeded(db, parent_ids)

    def prune_round(
        self, db: str, status: str, cutoff: datetime, after: datetime | None, batch_size: int
    ) -> PrunedRound:
        return pruning.prune_round(db, status, cutoff, after, batch_size)

    def insert_ready_jobs(self, db: str, jobs: Sequence[Job]) -> None:
        insert.insert_ready_jobs(db, jobs)

    insert_chunk_size = insert.CHUNK_SIZE

    def insert_jobs(self, db: str, jobs: Sequence[Job]) -> None:
        """One statement per :attr:`insert_chunk_size` jobs, from column arrays."""
        insert.insert_jobs(db, jobs)

    def insert_rows(self, db: str, model: type[Model], rows: Sequence[Model]) -> None:
        """One statement per :attr:`insert_chunk_size` rows, from column arrays."""
        insert.insert_rows(db, model, rows)

    def ensure_rate_rows(self, db: str, keys: Collection[str], now: datetime) -> None:
        """One statement, ``INSERT ... ON CONFLICT DO NOTHING`` (``rate_limits``)."""
        rate_limits.ensure_rate_rows(db, keys, now)

    def start_rated(
        self, db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
    ) -> tuple[dict[int, Started] | None, list[str]]:
        """One statement: claims and rate rows locked, every rate decided and written, or
        nothing written and None, with the keys that have no row (``rate_limits.start_rated``)."""
        return rate_limits.start_rated(db, job_ids, process_id, worker_id, now)

    def lock_start_rows(self, db: str, process_id: int, job_ids: list[int]) -> list[StartRow]:
        """One statement: the claims locked, then their jobs read (``rate_limits``)."""
        return rate_limits.lock_start_rows(db, process_id, job_ids)

    def lock_rate_rows(self, db: str, keys: Iterable[str]) -> list[RateLimit]:
        """One statement written once, not compiled by the ORM at every start."""
        return rate_limits.lock_rate_rows(db, keys)

    def write_rated_starts(
        self,
        db: str,
        windows: Sequence[RateLimit],
        rows: list[StartRow],
        worker_id: str,
        now: datetime,
        starts: dict[int, datetime],
    ) -> dict[int, Started]:
        """One statement: the windows and the starts, from column arrays."""
        return rate_limits.write_rated_starts(db, windows, rows, worker_id, now, starts)

    def keyword_argument_condition(self, name: str, values: Sequence[Any]) -> Q:
        """``kwargs @> {name: value}``, served by the GIN index ``jobs_job_kwargs_gin``."""
        return admin_reads.keyword_argument(name, values)

    def any_argument_condition(self, values: Sequence[Any]) -> Q:
        """jsonpath ``@?`` on ``args`` and ``kwargs``, served by their GIN indexes."""
        return admin_reads.any_argument(values)

    def statement_timeout(self, db: str, seconds: float) -> AbstractContextManager[None]:
        return admin_reads.statement_timeout(db, seconds)

    def is_statement_timeout(self, error: BaseException) -> bool:
        return admin_reads.is_statement_timeout(error)
