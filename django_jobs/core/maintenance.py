"""Periodic repairs: keys with blocked jobs reconciled, finished jobs, idle rate limits and
idle fair stamps pruned.

:func:`prune_finished_jobs` is the one way finished jobs leave the database: the
dispatcher calls it (through :func:`clear_finished_jobs`, with
``clear_finished_jobs_after``), and so does ``manage.py prune_jobs``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from django_jobs.core.admission import reconcile_key
from django_jobs.core.fairness import still_waiting
from django_jobs.db import features, ops
from django_jobs.db.rows import PrunedRound
from django_jobs.models import (
    FINISHED_STATUSES,
    Batch,
    BlockedExecution,
    FailedExecution,
    FairTurn,
    Job,
    JobDependency,
    RateLimit,
    Workflow,
)

# Ids per DELETE statement (below SQLite's 999 parameters of old builds).
DELETE_CHUNK = 500


def reconcile_blocked_keys(db: str) -> int:
    """Recount every key that has blocked jobs; promote as many as fit. Returns promoted."""
    keys = (
        BlockedExecution.objects.using(db)
        .order_by("concurrency_key")
        .values_list("concurrency_key", flat=True)
        .distinct()
    )
    promoted = 0
    for key in list(keys):
        with transaction.atomic(using=db):
            promoted += reconcile_key(db, key)
    return promoted


# A rate-limited key's row is kept this long after its last start at least (and for a
# period after its last start or planned start, whichever is later).
RATE_LIMIT_IDLE = timedelta(days=1)


def prune_rate_limits(db: str, now: datetime | None = None) -> int:
    """Delete the rows of rate-limited keys that have nothing left to remember.

    A row is kept while any start or planned start is within its period, so
    pruning never forgets a start that still counts or a plan still ahead. One
    key per account would otherwise keep a row per account forever. A start
    that finds its row pruned under it recreates it (``core.starting``).

    The rows read here are only candidates: each chunk is locked in key order, as
    every start locks them (so a prune and a start never deadlock), and decided
    again on what is locked. Deleting by id what an unlocked read found forgot a
    start recorded in between: its key then began an empty window, and N + 1 starts
    could fall in one period (tests/test_rate_limits.py, the prune's race).
    """
    now = now or timezone.now()
    idle = RateLimit.objects.using(db).filter(updated_at__lt=now - RATE_LIMIT_IDLE)
    candidates = [
        row.key
        for row in idle.only("key", "period", "starts", "planned", "updated_at").iterator()
        if forgettable(row, now)
    ]
    deleted = 0
    for start in range(0, len(candidates), DELETE_CHUNK):
        deleted += delete_forgettable(db, candidates[start : start + DELETE_CHUNK], now)
    return deleted


def forgettable(row: RateLimit, now: datetime) -> bool:
    """Idle past RATE_LIMIT_IDLE, and no start or plan of it within its period of ``now``."""
    latest = max([0.0, *row.starts, *row.planned])
    return row.updated_at < now - RATE_LIMIT_IDLE and latest + row.period < now.timestamp()


def delete_forgettable(db: str, keys: list[str], now: datetime) -> int:
    """Delete the rows of ``keys`` still forgettable once locked; how many."""
    with transaction.atomic(using=db):
        rows = ops(db).lock_rate_rows(db, keys)
        gone = [row.pk for row in rows if forgettable(row, now)]
        if gone:
            RateLimit.objects.using(db).filter(pk__in=gone).delete()
    return len(gone)


# A fair group's stamp is pruned once it has not been written for this long and nothing of
# the group waits at its last turn.
FAIR_TURN_IDLE = timedelta(days=1)
# Stamps pruned at most per pass, each in a transaction of its own: a bound on one
# maintenance tick's work (1,000 a minute at the default interval); the rest wait.
FAIR_TURN_PRUNE_LIMIT = 1000


def prune_fair_turns(db: str, now: datetime | None = None) -> int:
    """Delete the stamps (``FairTurn``) of fair groups idle past ``FAIR_TURN_IDLE`` whose
    last job no longer waits; how many.

    Such a stamp decides nothing: a group with nothing waiting starts at the head, or at an
    idle level at its first job's place, and a group with no stamp starts at the same turn
    (core/fairness.py). So the delete changes no job's turn, and a tenant seen once no
    longer keeps a row forever. Each stamp is locked and decided again in a transaction of
    its own, which holds no other lock: it cannot deadlock with an enqueue that locks
    several stamps (in its own order). An enqueue that wrote the stamp since it was read
    (its ``updated_at`` moved) keeps it (tests/test_fairness.py, the prune's race).
    """
    now = now or timezone.now()
    cutoff = now - FAIR_TURN_IDLE
    candidates = list(
        FairTurn.objects.using(db)
        .filter(updated_at__lt=cutoff)
        .values_list("pk", flat=True)[:FAIR_TURN_PRUNE_LIMIT]
    )
    return sum(delete_idle_stamp(db, pk, cutoff) for pk in candidates)


def delete_idle_stamp(db: str, pk: int, cutoff: datetime) -> bool:
    """Delete stamp ``pk`` if, once locked, it is still idle; whether it was."""
    with transaction.atomic(using=db):
        row = FairTurn.objects.using(db).select_for_update().filter(pk=pk).first()
        if row is None or row.updated_at >= cutoff or still_waiting(db, row.last_job_id):
            return False
        FairTurn.objects.using(db).filter(pk=pk).delete()
    return True


@dataclass
class PruneCounts:
    """What a prune deleted (or, in a dry run, would delete)."""

    jobs: Counter[str] = field(default_factory=Counter)  # by status
    failures: int = 0
    batches: int = 0
    workflows: int = 0

    @property
    def total_jobs(self) -> int:
        return sum(self.jobs.values())


def prune_finished_jobs(
    db: str,
    cutoff: datetime | Mapping[str, datetime],
    *,
    statuses: Iterable[str] = FINISHED_STATUSES,
    batch_size: int | None = None,
    batches: bool = True,
    dry_run: bool = False,
    on_batch: Callable[[PruneCounts], None] | None = None,
    max_rounds: int | None = None,
    rest: float = 0.0,
) -> PruneCounts:
    """Delete jobs of ``statuses`` (finished ones only) that finished before ``cutoff``:
    one time for all, or one per status (a status the mapping leaves out is kept).

    With them go their failure rows (one per failed attempt) and, if ``batches``,
    the batches completed before the earliest cutoff whose callbacks have ended.

    Each round is one short transaction: it locks up to ``batch_size`` jobs (by
    default the database's ``prune_batch_size``: 5,000 on PostgreSQL, where a round is
    one statement, 1,000 elsewhere) of one status, oldest first (``SKIP LOCKED``: a
    job an operator is retrying right now is left for the next prune, and the prune
    never waits for it), and deletes them
    with their failure rows and edges. The status is read under that lock, so a job
    retried a moment earlier (ready again) is never deleted. A finished job has no
    ready, scheduled, blocked or claimed row, so the hot execution tables are not
    touched at all. ``on_batch`` is called after each commit with the running
    totals. ``max_rounds`` caps the transactions that delete jobs in this call (None:
    until none are left), for a caller with other work to get back to; the rest waits for the
    next call, and batches are then left for a call that finishes the jobs.

    ``rest`` is how long to sleep after each round per second the round took: 0
    runs flat out; 2 leaves the database to the workers two thirds of the time, for
    a prune of a large backlog beside busy workers (docs/housekeeping.md).

    ``dry_run`` counts what would go and deletes nothing.
    """
    cutoffs = cutoffs_by_status(cutoff, statuses)
    batch_size = batch_size or features(db).prune_batch_size
    counts = PruneCounts()
    if dry_run:
        return count_prunable(db, cutoffs, batches=batches)
    rounds = 0
    for status, status_cutoff in cutoffs.items():
        after: datetime | None = None
        while True:
            began = time.monotonic()
            pruned = prune_round(db, status, status_cutoff, after, batch_size)
            if not pruned.jobs:
                break
            rounds += 1
            counts.jobs[status] += pruned.jobs
            counts.failures += pruned.failures
            if on_batch is not None:
                on_batch(counts)
            if max_rounds is not None and rounds >= max_rounds:
                return counts
            if pruned.jobs < batch_size:
                break
            after = pruned.last_finished_at
            if rest > 0:
                time.sleep((time.monotonic() - began) * rest)
    if batches and cutoffs:
        earliest = min(cutoffs.values())
        prune_batches(db, earliest, batch_size, counts, on_batch)
        prune_workflows(db, earliest, batch_size, counts)
    return counts


def cutoffs_by_status(
    cutoff: datetime | Mapping[str, datetime], statuses: Iterable[str]
) -> dict[str, datetime]:
    """``{status: cutoff}`` for each of ``statuses`` that has one; an unknown or
    unfinished status raises ValueError (nothing is deleted)."""
    wanted = sorted(set(statuses))
    named = set(wanted) | (set(cutoff) if isinstance(cutoff, Mapping) else set())
    unknown = named - set(FINISHED_STATUSES)
    if unknown:
        raise ValueError(f"only finished jobs can be pruned, not {sorted(unknown)}")
    if isinstance(cutoff, Mapping):
        return {status: cutoff[status] for status in wanted if status in cutoff}
    return dict.fromkeys(wanted, cutoff)


def prune_workflows(db: str, cutoff: datetime, batch_size: int, counts: PruneCounts) -> None:
    """Delete workflows made before ``cutoff`` that have no job left (all pruned).

    A workflow's state is its jobs' (``core/workflows.py``): with none left there is
    nothing to show, and a job that joins it later (``using(after=...)``) needs a job of
    it to wait for, which would have kept it.
    """
    while True:
        ids = list(
            Workflow.objects.using(db)
            .filter(created_at__lt=cutoff)
            .exclude(Exists(Job.objects.using(db).filter(workflow_id=OuterRef("pk"))))
            .order_by("pk")
            .values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            return
        with transaction.atomic(using=db):
            counts.workflows += ops(db).delete_by_pk(db, Workflow, ids)
        if len(ids) < batch_size:
            return


def prune_round(
    db: str, status: str, cutoff: datetime, after: datetime | None, batch_size: int
) -> PrunedRound:
    """One transaction: lock, then delete, up to ``batch_size`` prunable jobs of ``status``
    finished before ``cutoff`` (and at or after ``after``), oldest first."""
    with transaction.atomic(using=db):
        if features(db).can_prune_in_one_statement:
            return ops(db).prune_round(db, status, cutoff, after, batch_size)
        prunable = Job.objects.using(db).filter(status=status, finished_at__lt=cutoff)
        if after is not None:
            prunable = prunable.filter(finished_at__gte=after)
        rows = list(
            prunable.select_for_update(skip_locked=True)
            .order_by("finished_at")
            .values_list("pk", "finished_at")[:batch_size]
        )
        ids = [pk for pk, _ in rows]
        if not ids:
            return PrunedRound(0, 0, None)
        failures = ops(db).delete_executions(db, FailedExecution, ids)
        # What a pruned job waited for. An edge to it from a job still kept stays: that
        # job's dependency_results() keeps its positions (docs/workflows.md).
        JobDependency.objects.using(db).filter(job_id__in=ids).delete()
        ops(db).delete_by_pk(db, Job, ids)
    # A finished job's finished_at is set (the filter above read it below the cutoff).
    return PrunedRound(len(ids), failures, max(finished for _, finished in rows if finished))


def prune_batches(
    db: str,
    cutoff: datetime,
    batch_size: int,
    counts: PruneCounts,
    on_batch: Callable[[PruneCounts], None] | None = None,
) -> None:
    """Delete batches completed before ``cutoff``, kept as long as their finished items.

    Only finished batches go: an unfinished one is still counting its items down.
    One whose callback job has not ended yet stays too, for the callback to read.
    """
    after = 0
    while True:
        rows = list(
            Batch.objects.using(db)
            .filter(finished_at__lt=cutoff, pk__gt=after)
            .order_by("pk")
            .values_list("pk", "callback_jobs")[:batch_size]
        )
        if not rows:
            return
        after = rows[-1][0]
        ids = [pk for pk, _ in rows]
        busy = busy_batches(db, rows)
        deletable = [pk for pk in ids if pk not in busy]
        if deletable:
            # Jobs point at their batch without a database constraint (DO_NOTHING): no
            # cascade, nothing else locked.
            with transaction.atomic(using=db):
                counts.batches += ops(db).delete_by_pk(db, Batch, deletable)
            if on_batch is not None:
                on_batch(counts)
        if len(rows) < batch_size:
            return


def busy_batches(db: str, rows: list[tuple[int, dict]]) -> set[int]:
    """Batches (of ``rows``: pk, callback_jobs) with a callback job that has not ended."""
    callbacks = {int(job_id): pk for pk, jobs in rows for job_id in (jobs or {}).values()}
    if not callbacks:
        return set()
    running = (
        Job.objects.using(db)
        .filter(pk__in=list(callbacks))
        .exclude(status__in=FINISHED_STATUSES)
        .values_list("pk", flat=True)
    )
    return {callbacks[job_id] for job_id in running}


def count_prunable(db: str, cutoffs: Mapping[str, datetime], *, batches: bool) -> PruneCounts:
    """What :func:`prune_finished_jobs` would delete now, counted, not deleted."""
    counts = PruneCounts()
    for status, cutoff in cutoffs.items():
        jobs = Job.objects.using(db).filter(status=status, finished_at__lt=cutoff)
        counts.jobs[status] = jobs.count()
        counts.failures += (
            FailedExecution.objects.using(db)
            .filter(job__status=status, job__finished_at__lt=cutoff)
            .count()
        )
    if batches and cutoffs:
        rows = list(
            Batch.objects.using(db)
            .filter(finished_at__lt=min(cutoffs.values()))
            .values_list("pk", "callback_jobs")
        )
        counts.batches = len(rows) - len(busy_batches(db, rows))
    return counts


# What ``clear_finished_jobs_after`` keeps a finished job for: seconds for every status,
# or a dict of status -> seconds (None: forever) where a status left out keeps the default.
Retention = float | Mapping[str, float | None]
DEFAULT_RETENTION = 86400.0 * 7


def retention_cutoffs(retention: Retention, now: datetime) -> dict[str, datetime]:
    """``{status: cutoff}``: a job of that status finished before its cutoff may go.

    A status whose retention is None is absent (kept forever)."""
    if not isinstance(retention, Mapping):
        return {status: now - timedelta(seconds=retention) for status in FINISHED_STATUSES}
    cutoffs: dict[str, datetime] = {}
    for status in FINISHED_STATUSES:
        seconds = retention.get(status, DEFAULT_RETENTION)
        if seconds is not None:
            cutoffs[status] = now - timedelta(seconds=seconds)
    return cutoffs


def clear_finished_jobs(
    db: str, older_than: Retention, batch_size: int | None = None, max_rounds: int | None = 20
) -> int:
    """The dispatcher's prune: finished jobs older than ``older_than`` seconds (for every
    status, or per status: see :data:`Retention`).

    At most ``max_rounds`` transactions of ``batch_size`` jobs per call (100,000 on
    PostgreSQL by default, 20,000 elsewhere): a first prune of a large backlog must not
    stall the dispatcher's other work (promoting due jobs, recovering dead workers) for
    minutes; the rest
    goes in the next maintenance rounds. Returns how many jobs were deleted.
    """
    cutoffs = retention_cutoffs(older_than, timezone.now())
    return prune_finished_jobs(db, cutoffs, batch_size=batch_size, max_rounds=max_rounds).total_jobs


def clear_finished_batches(db: str, cutoff: datetime, batch_size: int = 500) -> int:
    """Delete batches completed before ``cutoff`` (see :func:`prune_batches`)."""
    counts = PruneCounts()
    prune_batches(db, cutoff, batch_size, counts)
    return counts.batches
