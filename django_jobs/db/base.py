"""The portable side of the database seam: the feature flags every database starts from, and
the operations written once for all of them.

In the manner of Django's ``connection.features`` / ``connection.ops``: the core asks
``features(db)`` which path a database can take and ``ops(db)`` to run a database operation,
so that what PostgreSQL, MariaDB/MySQL and SQLite do differently lives in one vendor module
each (``postgresql/``, ``mysql.py``, ``sqlite.py``), never in an ``if vendor ==`` of the core.
A flag is False (or the portable value) here; a vendor turns on only what it does better.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections, models
from django.db.models import QuerySet

from django_jobs.db.columns import column, pk_column  # also base.column, as before
from django_jobs.db.rows import HeldClaim, PrunedRound, Started, StartRow
from django_jobs.limits import later

if TYPE_CHECKING:
    from django.db.models import Q

    from django_jobs.models import Job, RateLimit, Semaphore

RowT = TypeVar("RowT", bound=models.Model)

# Documents nest at most this deep before we refuse them (Python's own recursion keeps a
# margin below this).
JSON_MAX_DEPTH = 100


class Features:
    """What a database can do, as the core needs to know it; the portable answers."""

    # One statement claims a queue pattern's jobs and starts those it can (a data-modifying
    # CTE with SKIP LOCKED); the portable claim is a transaction of several.
    can_claim_in_one_statement = False
    # One statement locks a process's claims and counts their jobs' attempts.
    can_start_in_one_statement = False
    # One statement locks a process's claims and their keys' rate rows, decides the rate
    # limits of the usual start (every job admitted) and writes it (Operations.start_rated).
    can_start_rated_in_one_statement = False
    # One statement finishes jobs without a batch (with concurrency keys: in one round trip
    # with the release of their slots).
    can_finish_in_one_statement = False
    # One statement recounts locked semaphores' holders and promotes their blocked jobs.
    can_promote_in_one_statement = False
    # One statement inserts ready jobs and their ready rows (column arrays).
    can_insert_ready_in_one_statement = False
    # Settle the edges of succeeded jobs and move their dependents' counts in one
    # statement (Operations.settle_succeeded).
    can_settle_in_one_statement = False
    # The database has LISTEN/NOTIFY (``DJANGO_JOBS["listen_notify"]`` may name it) ...
    has_listen_notify = False
    # ... and our listener and notifier can use it here: idle workers are woken at once
    # (else they poll).
    can_listen = False
    # A locking read locks every row it reads, not only those it returns (InnoDB): a
    # ``prefix*`` claim picks its candidates by plain reads first (core.claims.prefix_queues).
    locks_every_row_read = False
    # Starting a transaction by a statement of our own saves round trips (db.transactions).
    begins_transactions_by_statement = False
    # How deeply a stored JSON document may nest.
    max_json_depth = JSON_MAX_DEPTH
    # A NUL character (``\\u0000``) in a JSON document or text column is refused.
    refuses_nul_in_text = False
    # A round of the prune (jobs, failure rows, edges) is one statement
    # (``Operations.prune_round``; core.maintenance has the portable round).
    can_prune_in_one_statement = False
    # Jobs per transaction of the prune by default: each locks that many job rows (and on
    # SQLite the whole database) for the transaction's length.
    prune_batch_size = 1000
    # A write transaction holds the database's one write lock from its BEGIN (SQLite's
    # BEGIN IMMEDIATE): what it reads no other writer can change before its commit, so a
    # fair group's stamp is read and written back by plain statements, no row lock
    # (``Operations.fair_group_state``, ``core.fairness``).
    writes_hold_the_database = False


class Operations:
    """Database operations written once for every database; vendors override some."""

    # How a claim locks its own process's row (lock_own_process): shared, since the
    # process's heartbeat writes the row meanwhile. SQLite's BEGIN IMMEDIATE already holds
    # the database's one write lock (testproject/settings.py): a plain read.
    own_process_lock = ""

    def lock_own_process(self, db: str, process_id: int) -> bool:
        """Lock the claiming process's row before a claim takes a job; False if it is gone.

        A process pruned as dead may still run (a long pause, a clock jump) and claim until
        its heartbeat finds its row gone. The prune deletes the row first and recovers the
        process's claims after (``core.processes.prune_dead_processes``); with this lock a
        claim either commits before the delete, which waits for it, and the recovery sees
        it, or finds no row and must claim nothing: no claim outlives the prune, and none
        takes again, under the old id, a job the prune recovered (tests/test_pruned_claims.py).
        """
        from django_jobs.models import Process

        table = connections[db].ops.quote_name(Process._meta.db_table)
        with connections[db].cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM {table} WHERE id = %s{self.own_process_lock}", [process_id]
            )
            return cursor.fetchone() is not None

    def lock_in_key_order(self, rows: QuerySet[RowT], keys: Iterable[str]) -> list[RowT]:
        """Lock the rows of ``keys`` (a ``key`` column) in ascending key order, by code point
        as Python sorts: every path that holds several semaphores (or rate-limit rows) takes
        them in this order, so no two can deadlock on them (docs/design.md section 4)."""
        keys = sorted(set(keys))
        if not keys:
            return []
        return list(rows.select_for_update().filter(key__in=keys).order_by("key"))

    def delete_executions(
        self, db: str, model: type[models.Model], job_ids: Collection[int]
    ) -> int:
        """Delete the rows of an execution table (keyed by ``job_id``) for ``job_ids``,
        locking no row but those; returns how many."""
        if not job_ids:
            return 0
        return model._default_manager.using(db).filter(job_id__in=list(job_ids)).delete()[0]

    def delete_by_pk(self, db: str, model: type[models.Model], ids: Collection[int]) -> int:
        """Delete ``model`` rows by primary key, locking only those rows, without the ORM's
        cascade: for a job ``QuerySet.delete()`` would first read every column of each row,
        then run a ``DELETE ... IN`` on each execution table, where a finished job has no
        row. Returns how many."""
        return self.delete_where(db, model, pk_column(model), ids)

    def delete_where(
        self, db: str, model: type[models.Model], column: str, ids: Collection[int]
    ) -> int:
        """Delete the rows of ``model`` whose ``column`` is one of ``ids``, in chunks of
        :data:`DELETE_CHUNK`, each by :meth:`delete_statement`; returns how many."""
        if not ids:
            return 0
        connection = connections[db]
        quote = connection.ops.quote_name
        table, name = quote(model._meta.db_table), quote(column)
        ordered = sorted(ids)
        deleted = 0
        with connection.cursor() as cursor:
            for start in range(0, len(ordered), DELETE_CHUNK):
                chunk = ordered[start : start + DELETE_CHUNK]
                cursor.execute(self.delete_statement(table, name, len(chunk)), chunk)
                deleted += cursor.rowcount
        return deleted

    def delete_statement(self, table: str, column: str, count: int) -> str:
        """Delete by ids: the rows of ``table`` (quoted) whose ``column`` is one of
        ``count`` parameters."""
        marks = ", ".join(["%s"] * count)
        return f"DELETE FROM {table} WHERE {column} IN ({marks})"

    # The statements of a claim, a start and a finish, written once in SQL rather than built
    # by the ORM: on SQLite (and on MariaDB where its procedures do not apply) they are every
    # worker's every batch, and building the queries (a ``CASE`` per return value, in
    # ``bulk_update``) cost more CPU than the database spent running them (docs/running.md,
    # "What runs").

    def read_jobs(self, db: str, ids: list[int], *, lock: bool = False) -> dict[int, Job]:
        """Read jobs: the jobs ``ids``, by id, as ``Job.objects`` would build them.

        ``lock``: with their rows locked (ascending), as a claim takes them before it
        inserts their claimed rows. On InnoDB that insert's foreign key check takes a
        shared lock on each job row, which the claim's own UPDATE then had to upgrade:
        anyone asking for the row meanwhile (an enqueue waiting for it, a cancel)
        deadlocked with it. Locked first, there is nothing to upgrade.
        """
        from django_jobs.db.job_rows import job_from_row, select_list
        from django_jobs.models import Job

        connection = connections[db]
        marks = ", ".join(["%s"] * len(ids))
        table = connection.ops.quote_name(Job._meta.db_table)
        locking = (
            " ORDER BY id FOR UPDATE" if lock and connection.features.has_select_for_update else ""
        )
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {select_list(db)} FROM {table} WHERE id IN ({marks}){locking}", ids
            )
            rows = cursor.fetchall()
        jobs = (job_from_row(db, connection, row) for row in rows)
        return {job.pk: job for job in jobs}

    def insert_claims(
        self, db: str, process_id: int, picked: list[tuple[Job, str]], now: datetime
    ) -> None:
        """Insert claims: one INSERT of the claimed rows of ``picked`` (each job with the
        queue it was claimed from), as ``bulk_create`` would write them, ascending by job
        id. The order is a lock order on InnoDB: a row inserted into the claims' index on
        ``process_id`` whose key is there delete-marked (a claim of the same job by the same
        process, gone since: a retry due at once, claimed again) waits for the lock of that
        entry, which a finish of this process's other claims takes as it reads the index
        ascending (``lock_held_claims``). Inserted in claim order, a claim held a higher
        entry while it waited for a lower one the finish held, and the finish waited for
        the higher one: a deadlock (tests/test_workflow_stress.py met it). Ascending, the
        two take the entries in one order."""
        from django_jobs.models import ClaimedExecution

        connection = connections[db]
        fields = ClaimedExecution._meta
        created = fields.get_field("created_at").get_db_prep_save(now, connection)
        lease_field = fields.get_field("lease_expires_at")
        params: list[Any] = []
        for job, queue in sorted(picked, key=lambda pair: pair[0].pk):
            lease = lease_field.get_db_prep_save(lease_end(job, now), connection)
            params += [job.pk, process_id, queue, job.concurrency_key, lease, job.batch_id, created]
        values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s)"] * len(picked))
        table = connection.ops.quote_name(ClaimedExecution._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (job_id, process_id, queue_name, concurrency_key, "
                f"lease_expires_at, batch_id, created_at) VALUES {values}",
                params,
            )

    def write_starts(
        self,
        db: str,
        rows: list[StartRow],
        worker_id: str,
        now: datetime,
        starts: dict[int, datetime],
    ) -> dict[int, Started]:
        """Write starts: count the attempt of each job of ``rows`` (read under a lock the
        caller holds) and return each one as written. ``starts``: the recorded start of
        each rate-limited one. Jobs whose new column values coincide share one UPDATE
        (usually all of them)."""
        from django_jobs.models import Job, JobStatus, UniqueUntil

        written: dict[int, Started] = {}
        groups: dict[tuple, list[int]] = defaultdict(list)
        for row in rows:
            stamp = now if row.rate_key is None else starts[row.pk]
            worker_ids = [*(row.worker_ids or []), worker_id]
            written[row.pk] = Started(row.attempts + 1, worker_ids, row.started_at or stamp, stamp)
            shape = (
                row.attempts + 1,
                json.dumps(worker_ids),
                row.started_at is None,
                row.unique_until == UniqueUntil.START,
                stamp,
                row.rate_key is not None,
            )
            groups[shape].append(row.pk)
        connection = connections[db]
        quote = connection.ops.quote_name
        moment = Job._meta.get_field("last_attempted_at")
        ids_field = Job._meta.get_field("worker_ids")
        with connection.cursor() as cursor:
            for shape, pks in groups.items():
                attempts, worker_ids_json, first_start, releases_key, stamp, rated = shape
                at = moment.get_db_prep_save(stamp, connection)
                ids_value = ids_field.get_db_prep_save(json.loads(worker_ids_json), connection)
                # A job unique only while waiting lets go of its key as it starts.
                extra = (
                    (", started_at = %s" if first_start else "")
                    + (", unique_lock = NULL" if releases_key else "")
                    + (", rate_reserved_at = NULL" if rated else "")
                )
                marks = ", ".join(["%s"] * len(pks))
                cursor.execute(
                    f"UPDATE {quote(Job._meta.db_table)} SET status = %s, attempts = %s, "
                    f"worker_ids = %s, last_attempted_at = %s{extra} WHERE id IN ({marks})",
                    [
                        JobStatus.RUNNING,
                        attempts,
                        ids_value,
                        at,
                        *([at] if first_start else []),
                        *pks,
                    ],
                )
        return written

    # A start that decides rates (core.starting.start_locked): its claims and jobs read under
    # lock, its keys' rate rows locked, then its windows and starts written.

    def ensure_rate_rows(self, db: str, keys: Collection[str], now: datetime) -> None:
        """Ensure rate rows: create the missing ``RateLimit`` rows of ``keys``, in short
        statements of their own, never inside a start (``core.rate_limits.ensure_rate_rows``
        says why). Here a plain read, which locks nothing, finds the missing ones, and an
        INSERT that ignores conflicts creates them."""
        from django_jobs.models import RateLimit

        keys = sorted(set(keys))
        if not keys:
            return
        connection = connections[db]
        quote = connection.ops.quote_name
        marks = ", ".join(["%s"] * len(keys))
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {quote('key')} FROM {quote(RateLimit._meta.db_table)} "
                f"WHERE {quote('key')} IN ({marks})",
                keys,
            )
            existing = {row[0] for row in cursor.fetchall()}
        missing = [key for key in keys if key not in existing]
        if missing:
            RateLimit.objects.using(db).bulk_create(
                [RateLimit(key=key, created_at=now, updated_at=now) for key in missing],
                ignore_conflicts=True,
            )

    def lock_start_rows(self, db: str, process_id: int, job_ids: list[int]) -> list[StartRow]:
        """Lock start rows: lock the claims of ``job_ids`` that ``process_id`` still holds
        (ascending job id), then read their jobs under those locks, in claim order
        (priority, then id). A claim gone (recovered, pruned) leaves its job out. Two
        statements written once per count of ids, where the ORM compiled both at every
        rate-limited start."""
        from django_jobs.db.job_rows import converted

        if not job_ids:
            return []
        connection = connections[db]
        with connection.cursor() as cursor:
            cursor.execute(held_claims_statement(db, len(job_ids)), [*job_ids, process_id])
            held = [job_id for (job_id,) in cursor.fetchall()]
            if not held:
                return []
            cursor.execute(start_rows_statement(db, len(held)), held)
            fetched = cursor.fetchall()
        converters = start_row_converters(db)
        return [StartRow(*converted(connection, converters, row)) for row in fetched]

    def lock_rate_rows(self, db: str, keys: Iterable[str]) -> list[RateLimit]:
        """Lock rate rows: the ``RateLimit`` rows of ``keys``, in ascending key order by code
        point (:meth:`lock_in_key_order`), each with its starts and plan."""
        from django_jobs.models import RateLimit

        return self.lock_in_key_order(RateLimit.objects.using(db), keys)

    def write_rated_starts(
        self,
        db: str,
        windows: Sequence[RateLimit],
        rows: list[StartRow],
        worker_id: str,
        now: datetime,
        starts: dict[int, datetime],
    ) -> dict[int, Started]:
        """Write a start's rate windows (rows :meth:`lock_rate_rows` locked, with their new
        ``starts``, ``planned``, ``limit`` and ``period`` set on them, ``updated_at`` to
        ``now``), then its starts (:meth:`write_starts`); returns each start as written."""
        self.write_rate_windows(db, windows, now)
        return self.write_starts(db, rows, worker_id, now, starts) if rows else {}

    def write_rate_windows(self, db: str, windows: Sequence[RateLimit], now: datetime) -> None:
        """Write rate windows: one UPDATE of the locked rows ``windows``, a ``CASE`` per
        column written by hand (``bulk_update`` built the same statement from expressions, at
        a cost in CPU that was most of a rate-limited start's)."""
        from django_jobs.models import RateLimit

        if not windows:
            return
        connection = connections[db]
        quote = connection.ops.quote_name
        meta = RateLimit._meta
        params: list[Any] = []
        sets = []
        for name in ("starts", "planned", "limit", "period"):
            field = meta.get_field(name)
            assert isinstance(field, models.Field)
            prep = field.get_db_prep_save
            sql, values = case_by_id(
                quote(column(field)),
                [(row.pk, prep(getattr(row, name), connection)) for row in windows],
            )
            sets.append(sql)
            params += values
        updated = meta.get_field("updated_at")
        params.append(updated.get_db_prep_save(now, connection))
        ids = [row.pk for row in windows]
        marks = ", ".join(["%s"] * len(ids))
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {quote(meta.db_table)} SET {', '.join(sets)}, "
                f"{quote(column(updated))} = %s WHERE id IN ({marks})",
                [*params, *ids],
            )

    def lock_held_claims(self, db: str, process_id: int, ids: list[int]) -> list[HeldClaim]:
        """Lock held claims: those of ``ids`` that ``process_id`` still holds, locked in
        job id order (a finish's first statement), each with its job's row, whose
        workflow mark (a job that may have dependents) is read under that lock."""
        from django_jobs.models import ClaimedExecution, Job

        connection = connections[db]
        quote = connection.ops.quote_name
        marks = ", ".join(["%s"] * len(ids))
        lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
        claimed, job = quote(ClaimedExecution._meta.db_table), quote(Job._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT c.job_id, c.concurrency_key, c.batch_id, j.workflow_id "
                f"FROM {claimed} c INNER JOIN {job} j ON j.id = c.job_id "
                f"WHERE c.process_id = %s AND c.job_id IN ({marks}) ORDER BY c.job_id{lock}",
                [process_id, *sorted(ids)],
            )
            return [HeldClaim(*row) for row in cursor.fetchall()]

    def mark_succeeded(
        self, db: str, done: list[int], return_values: dict[int, object], now: datetime
    ) -> None:
        """Mark succeeded: ``done`` SUCCEEDED, each with its return value (a job that
        returned None gets NULL, whatever an earlier run left: the CASE has no ELSE)."""
        from django_jobs.models import Job, JobStatus

        connection = connections[db]
        quote = connection.ops.quote_name
        field = Job._meta.get_field("return_value")
        finished_at = Job._meta.get_field("finished_at").get_db_prep_save(now, connection)
        params: list[Any] = [JobStatus.SUCCEEDED, finished_at]
        valued = [pk for pk in done if return_values[pk] is not None]
        # No job of the batch returned anything: no CASE, every value NULL all the same.
        value_sql = ", return_value = NULL"
        if valued:
            sql, values = case_by_id(
                "return_value",
                [(pk, field.get_db_prep_save(return_values[pk], connection)) for pk in valued],
            )
            value_sql = f", {sql}"
            params += values
        marks = ", ".join(["%s"] * len(done))
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {quote(Job._meta.db_table)} SET status = %s, finished_at = %s, "
                f"unique_lock = NULL{value_sql} WHERE id IN ({marks})",
                [*params, *done],
            )

    def insert_jobs(self, db: str, jobs: Sequence[Job]) -> None:
        """Insert job rows (no execution row), setting ``pk`` on each: a workflow's nodes."""
        from django_jobs.models import Job

        Job.objects.using(db).bulk_create(jobs, batch_size=1000)
        if any(job.pk is None for job in jobs):
            for job in jobs:  # MySQL (unlike MariaDB) returns no ids from a bulk insert
                job.save(using=db, force_insert=True)

    def insert_rows(self, db: str, model: type[models.Model], rows: Sequence[models.Model]) -> None:
        """Insert rows whose ids nobody reads back (a workflow's edges, awaiting rows)."""
        model._default_manager.using(db).bulk_create(rows, batch_size=1000)

    # The fast paths below exist where a vendor's feature flag says so; the core checks the
    # flag first, so the portable versions are never called.

    def claim_matching(
        self,
        db: str,
        process_id: int,
        condition: Q,
        limit: int,
        now: datetime,
        worker_id: str | None = None,
    ) -> list[Job]:
        """``features.can_claim_in_one_statement``: claim (and start) in one statement."""
        raise NotImplementedError

    def start_held(
        self, db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
    ) -> dict[int, Started]:
        """``features.can_start_in_one_statement``: start this process's claimed jobs."""
        raise NotImplementedError

    def start_rated(
        self, db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
    ) -> tuple[dict[int, Started] | None, list[str]]:
        """``features.can_start_rated_in_one_statement``: the starts as written, or None if
        it decided nothing (``core.starting.start_in_one_statement``); and the keys of the
        start that have no rate row."""
        raise NotImplementedError

    def finish_unbatched(
        self,
        db: str,
        process_id: int,
        return_values: dict[int, object],
        now: datetime,
        *,
        keyed: bool = False,
    ) -> dict[int, str | None]:
        """``features.can_finish_in_one_statement``: finish jobs without a batch."""
        raise NotImplementedError

    def finish_keyed(
        self,
        db: str,
        process_id: int,
        return_values: dict[int, object],
        keys: Collection[str],
        now: datetime,
    ) -> list[int] | None:
        """``features.can_finish_in_one_statement``: finish keyed jobs and free their slots
        in one round trip, returning their ids; None where the connection cannot send
        several statements."""
        raise NotImplementedError

    def recount_and_promote(self, db: str, semaphores: list[Semaphore], now: datetime) -> int:
        """``features.can_promote_in_one_statement``: recount and promote in one statement."""
        raise NotImplementedError

    # A release's two reads where the recount and the promotion are not one statement
    # (core.admission.release_slots): written once per count of keys, where the ORM
    # compiled a UNION and a windowed query at every finish of keyed jobs (py-spy on
    # MariaDB: half of a keyed drain's completer).

    def count_holders(self, db: str, keys: Sequence[str], now: datetime) -> dict[str, int]:
        """Count holders: the ready and claimed rows of each of ``keys``, in one statement;
        a claim whose lease ran out by ``now`` no longer counts. Keys with none are left
        out."""
        if not keys:
            return {}
        connection = connections[db]
        moment = connection.ops.adapt_datetimefield_value(now)
        counts: dict[str, int] = defaultdict(int)
        with connection.cursor() as cursor:
            cursor.execute(count_holders_statement(db, len(keys)), [*keys, *keys, moment])
            for key, n in cursor.fetchall():
                counts[key] += int(n)
        return counts

    def set_semaphore_values(self, db: str, by_value: dict[int, list[int]], now: datetime) -> None:
        """Set semaphore values: for each value, the semaphores of its ids (locked by the
        caller) take it, ``updated_at`` now; one UPDATE per distinct value, written once per
        count of ids."""
        from django_jobs.models import Semaphore

        connection = connections[db]
        moment = connection.ops.adapt_datetimefield_value(now)
        with connection.cursor() as cursor:
            for value, pks in by_value.items():
                cursor.execute(
                    update_by_ids_statement(db, Semaphore, ("value", "updated_at"), len(pks)),
                    [value, moment, *pks],
                )

    def set_job_status(self, db: str, job_ids: Sequence[int], status: str) -> None:
        """Set job status: the jobs of ``job_ids`` (whose rows the caller may write) take
        ``status``; one UPDATE written once per count of ids."""
        from django_jobs.models import Job

        if job_ids:
            with connections[db].cursor() as cursor:
                statement = update_by_ids_statement(db, Job, ("status",), len(job_ids))
                cursor.execute(statement, [str(status), *job_ids])

    def blocked_in_order(
        self, db: str, keys: Sequence[str], most: int
    ) -> list[tuple[int, str, int, str, int, bool, str | None, float | None]]:
        """Blocked in order: the first ``most`` blocked jobs of each of ``keys`` by priority,
        then age, as ``(job id, queue, priority, key, position, is_async, fair key, fair
        weight)``, position counted from 1 within the key (the last three read from the
        job's row, by its key)."""
        if not keys:
            return []
        with connections[db].cursor() as cursor:
            cursor.execute(blocked_in_order_statement(db, len(keys)), [*keys, most])
            return [
                (int(job_id), queue, int(priority), key, int(position), bool(is_async), fair, w)
                for job_id, queue, priority, key, position, is_async, fair, w in cursor.fetchall()
            ]

    def finish_with_dependents(
        self, db: str, process_id: int, return_values: dict[int, object], now: datetime
    ) -> dict[int, tuple[str | None, int | None]]:
        """``features.can_finish_in_one_statement``: finish jobs without a batch, those
        of a workflow included, inside the caller's transaction; ``{id: (concurrency key,
        workflow)}`` of those finished, the workflow read under the row's lock."""
        raise NotImplementedError

    def prune_round(
        self, db: str, status: str, cutoff: datetime, after: datetime | None, batch_size: int
    ) -> PrunedRound:
        """``features.can_prune_in_one_statement``: delete up to ``batch_size`` jobs of
        ``status`` finished before ``cutoff`` (from ``after`` on), oldest first, with their
        failure rows and edges, skipping rows others hold."""
        raise NotImplementedError

    def settle_succeeded(self, db: str, parent_ids: list[int]) -> list[tuple[int, int]]:
        """``features.can_settle_in_one_statement``: settle the unsettled edges of these
        succeeded jobs, returning ``(dependent, remaining)`` for each dependent with an
        awaiting row."""
        raise NotImplementedError

    def insert_ready_jobs(self, db: str, jobs: Sequence[Job]) -> None:
        """``features.can_insert_ready_in_one_statement``: insert ready jobs in one statement
        per :attr:`insert_chunk_size` jobs."""
        raise NotImplementedError

    insert_chunk_size = 5000

    def claim_ready(
        self,
        db: str,
        process_id: int,
        queues: Sequence[str] | None,
        limit: int,
        worker_id: str | None,
        now: datetime,
    ) -> list[Job] | None:
        """Claim, and start those that start at claim (``core.ready.starts_at_claim``), up to
        ``limit`` ready jobs of ``queues`` (exact names in order; None: every queue) in one
        round trip, where the database has a way (MySQL/MariaDB: a stored procedure) that
        takes the statements' locks in their order; the jobs as written, in claim order.
        None, having done nothing, where it has none: the caller takes the statements'
        path (``core.ready.claim_jobs``)."""
        return None

    def finish_plain(
        self, db: str, process_id: int, return_values: dict[int, object], now: datetime
    ) -> set[int] | None:
        """Record the success of the jobs of ``return_values`` whose claim ``process_id``
        holds and which, read under that claim's lock, have no concurrency key, no batch
        and no workflow, in one round trip, where the database has a way (MySQL/MariaDB:
        a stored procedure) that takes ``core.claimed.finish_locked``'s locks in its
        order; the ids it finished (the caller finishes the others its own way). None,
        having done nothing, where it has none."""
        return None

    def read_through_index(self, sql: str, table: str, index: str) -> str:
        """``sql`` (a SELECT from ``table``) reading ``table`` through ``index`` where the
        database takes such a hint (MySQL/MariaDB); elsewhere ``sql`` as it is."""
        return sql

    def fair_group_state(
        self, db: str, queue: str, priority: int, key: str
    ) -> tuple[int | None, bool, int | None, bool]:
        """``features.writes_hold_the_database``: one read of what stamping a job of the
        group (``queue``, ``priority``, ``key``) needs, inside the caller's write
        transaction: the level's head (lowest ready turn, None if nothing is ready), whether
        the group's ``FairTurn`` row exists, its ``last_turn``, and whether its
        ``last_job_id`` still has a ready row (``core.fairness.still_waiting``)."""
        raise NotImplementedError

    def write_fair_stamp(
        self, db: str, queue: str, priority: int, key: str, turn: int, job_id: int, now: datetime
    ) -> None:
        """``features.writes_hold_the_database``: set the group's ``FairTurn`` row to
        ``turn``, given to job ``job_id``, making the row if it is missing."""
        raise NotImplementedError

    def enqueue_ready(self, db: str, job: Job) -> bool:
        """Insert one job that is ready at once with nothing to lock or check, and its
        ready row, in one round trip, where the database has a way (MySQL/MariaDB: a
        stored procedure); False, having written nothing, where it has none."""
        return False

    # --- the admin's reads: its search (admin/search.py) and its statement timeout
    # (admin/base.py, bounded_view) ---

    def prefix_condition(self, field: str, prefix: str) -> Q:
        """``field`` starts with ``prefix`` (its ``%``, ``_`` and ``\\`` taken as text), in a
        form an index of ``field`` serves: ``LIKE 'prefix%'``, a range scan on a btree
        whose order is the column's (MySQL/MariaDB; PostgreSQL with the
        ``varchar_pattern_ops`` index ``jobs_job_task_prefix``)."""
        from django.db.models import Q

        return Q(**{f"{field}__startswith": prefix})

    def keyword_argument_condition(self, name: str, values: Sequence[Any]) -> Q | None:
        """Jobs whose keyword argument ``name`` equals one of ``values``, from an index of
        the arguments; None where the database has none (the caller scans a bounded
        window with ``scanned_keyword_condition``)."""
        return None

    def any_argument_condition(self, values: Sequence[Any]) -> Q | None:
        """Jobs with any argument, positional or keyword (top level), equal to one of
        ``values``, from an index; None where the database has none."""
        return None

    def scanned_keyword_condition(self, name: str, values: Sequence[Any]) -> Q:
        """``keyword_argument_condition`` as a condition read row by row (JSON path
        ``$."name"``): only for a window of rows the caller bounds."""
        from django.db.models import Q
        from django.db.models.fields.json import KeyTransform, KeyTransformExact

        condition = Q(pk__in=[])
        for value in values:
            if value is not None:
                # The value as JSON text: a lookup built here is not prepared by the field.
                condition |= Q(KeyTransformExact(KeyTransform(name, "kwargs"), json.dumps(value)))
        return condition

    def statement_timeout(self, db: str, seconds: float) -> AbstractContextManager[None]:
        """Within the block, a statement on ``db`` that runs longer than ``seconds`` is
        interrupted with an error ``is_statement_timeout`` recognises; afterwards the
        connection is as before. Portable version: no limit (a database we do not know)."""
        return nullcontext()

    def is_statement_timeout(self, error: BaseException) -> bool:
        """Whether ``error`` is a statement interrupted by ``statement_timeout``."""
        return False


# Ids per DELETE statement.
DELETE_CHUNK = 500


def case_by_id(target: str, values: Sequence[tuple[int, Any]]) -> tuple[str, list[Any]]:
    """``target = CASE id WHEN %s THEN %s ... END`` and its parameters, for one UPDATE that
    gives each row of ``values`` (id, value) its own value. No ELSE: a row the UPDATE
    reaches but ``values`` does not name gets NULL."""
    sql = f"{target} = CASE id" + " WHEN %s THEN %s" * len(values) + " END"
    return sql, [param for pair in values for param in pair]


def lease_end(job: Job, now: datetime) -> datetime | None:
    """When a claim of ``job`` stops counting as a holder of its key's slot, if ever."""
    if job.concurrency_key and job.concurrency_duration:
        return later(now, job.concurrency_duration)
    return None


@functools.lru_cache(maxsize=64)
def count_holders_statement(db: str, count: int) -> str:
    """``Operations.count_holders``' statement for ``count`` keys (given twice, then now)."""
    from django_jobs.models import ClaimedExecution, ReadyExecution

    quote = connections[db].ops.quote_name
    ready, claimed = quote(ReadyExecution._meta.db_table), quote(ClaimedExecution._meta.db_table)
    marks = ", ".join(["%s"] * count)
    return (
        f"SELECT concurrency_key, COUNT(*) FROM {ready} WHERE concurrency_key IN ({marks}) "
        f"GROUP BY concurrency_key UNION ALL "
        f"SELECT concurrency_key, COUNT(*) FROM {claimed} WHERE concurrency_key IN ({marks}) "
        f"AND (lease_expires_at IS NULL OR lease_expires_at >= %s) GROUP BY concurrency_key"
    )


@functools.lru_cache(maxsize=64)
def blocked_in_order_statement(db: str, count: int) -> str:
    """``Operations.blocked_in_order``' statement for ``count`` keys (then the most per key)."""
    from django_jobs.models import BlockedExecution, Job

    quote = connections[db].ops.quote_name
    marks = ", ".join(["%s"] * count)
    return (
        f"SELECT ranked_.job_id, ranked_.queue_name, ranked_.priority, "
        f"ranked_.concurrency_key, ranked_.position_, job_.is_async, job_.fair_key, "
        f"job_.fair_weight FROM "
        f"(SELECT job_id, queue_name, priority, concurrency_key, ROW_NUMBER() OVER "
        f"(PARTITION BY concurrency_key ORDER BY priority DESC, job_id) AS position_ "
        f"FROM {quote(BlockedExecution._meta.db_table)} WHERE concurrency_key IN ({marks})) "
        f"AS ranked_ JOIN {quote(Job._meta.db_table)} AS job_ ON job_.id = ranked_.job_id "
        f"WHERE ranked_.position_ <= %s"
    )


@functools.lru_cache(maxsize=64)
def update_by_ids_statement(
    db: str, model: type[models.Model], columns: tuple[str, ...], count: int
) -> str:
    """Set ``columns`` (parameters, in order) of the rows of ``count`` ids (parameters after
    them) of ``model``'s table."""
    quote = connections[db].ops.quote_name
    table = quote(model._meta.db_table)
    sets = ", ".join(f"{quote(name)} = %s" for name in columns)
    return f"UPDATE {table} SET {sets} WHERE id IN ({', '.join(['%s'] * count)})"


@functools.lru_cache(maxsize=64)
def held_claims_statement(db: str, count: int) -> str:
    """The job ids of ``count`` ids (parameters, then the process id) whose claims the
    process holds, locked in ascending job id where the database locks rows."""
    from django_jobs.models import ClaimedExecution

    connection = connections[db]
    quote = connection.ops.quote_name
    marks = ", ".join(["%s"] * count)
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    return (
        f"SELECT job_id FROM {quote(ClaimedExecution._meta.db_table)} "
        f"WHERE job_id IN ({marks}) AND process_id = %s ORDER BY job_id{lock}"
    )


@functools.lru_cache(maxsize=64)
def start_rows_statement(db: str, count: int) -> str:
    """``StartRow``'s columns of ``count`` jobs (parameters), in claim order."""
    from django_jobs.models import Job

    quote = connections[db].ops.quote_name
    names = ", ".join(quote(column(field)) for field in start_fields())
    marks = ", ".join(["%s"] * count)
    return (
        f"SELECT {names} FROM {quote(Job._meta.db_table)} WHERE id IN ({marks}) "
        f"ORDER BY priority DESC, id"
    )


def start_fields() -> list[models.Field]:
    """``Job``'s fields of ``StartRow``'s, in its order (``pk`` is ``id``)."""
    from django_jobs.models import Job

    fields = []
    for name in StartRow._fields:
        field = Job._meta.get_field("id" if name == "pk" else name)
        assert isinstance(field, models.Field)
        fields.append(field)
    return fields


@functools.cache
def start_row_converters(db: str) -> tuple:
    """The converters of ``StartRow``'s columns that have any (JSON, datetimes)."""
    from django_jobs.db.job_rows import converters_of

    return converters_of(connections[db], start_fields())
