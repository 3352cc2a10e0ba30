"""What an operator asks of the queue: counts, blocked keys, stuck jobs, live processes,
the progress of running jobs, the latest workflows and the groups of the fair queues.

Shared by ``manage.py jobs``, the admin and the metrics: every query reads the small
execution tables or an index range of ``Job`` (jobs finished in a window the caller
names), never the whole job history. :func:`count_queues` is the one place queues are
counted.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Count, Min
from django.db.models.functions import TruncMinute
from django.utils import timezone

from django_jobs.conf import JobsSettings, fair_queues_problem
from django_jobs.core.fairness import TURN_SCALE, is_sane
from django_jobs.core.progress import from_row
from django_jobs.core.queues import QueueSelector
from django_jobs.core.workflows import WorkflowState, workflow_states
from django_jobs.models import (
    FINISHED_STATUSES,
    AwaitingExecution,
    BlockedExecution,
    ClaimedExecution,
    FairTurn,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
    Workflow,
)
from django_jobs.observability.process_metadata import async_loop, served_queues

# A waiting or running job's execution table, as the counts name it ("awaiting": waiting
# for the jobs it depends on; "running": a claimed execution, started or about to be).
PENDING_STATES = ("ready", "scheduled", "blocked", "awaiting", "running")
PENDING_TABLES = (
    ("ready", ReadyExecution),
    ("scheduled", ScheduledExecution),
    ("blocked", BlockedExecution),
    ("awaiting", AwaitingExecution),
    ("running", ClaimedExecution),
)
# How a job ends, as plain strings (dict keys, metric labels, JSON): the finished statuses.
OUTCOMES: tuple[str, ...] = tuple(status.value for status in FINISHED_STATUSES)
# ``manage.py jobs``' columns, in its order.
STATES = (*PENDING_STATES, "failed_last_hour", "finished_last_hour")
STUCK_SAMPLE = 50
# A task's usual duration (``running_too_long``): the median of at most SAMPLES_KEPT of
# its successes, judged from SAMPLES_NEEDED; found among the latest RECENT_SUCCESSES
# successes, else among TASK_ROWS_READ of the task's jobs.
SAMPLES_KEPT = 50
SAMPLES_NEEDED = 5
RECENT_SUCCESSES = 5_000
TASK_ROWS_READ = 500
# Keys per IN (...) list: well under every backend's limit on query parameters.
KEY_CHUNK = 500
# Keys with blocked jobs that a snapshot (and the stuck page) reads, in the grouped
# query's LIMIT: a backlog of a million keys costs what 500 do. Past it they are counted,
# up to COUNT_CAP, not read.
KEYS_READ = KEY_CHUNK
COUNT_CAP = 10_000
# Finished jobs read for their queue (``recent_outcomes``): past it, the per-queue outcome
# counts cover the latest minutes that hold at most this many, and say so.
QUEUE_ROWS_READ = 10_000
# The latest workflows a snapshot shows (``manage.py jobs``); the admin lists them all.
WORKFLOWS_SHOWN = 10
# Fair queues (``fair_groups``, docs/fairness.md): the groups shown per queue, those with the
# most ready jobs; the ready rows read per queue, the next ones in claim order, to count
# them among (past it, "10,000+"); the jobs of each outcome read for the recent starts, the
# latest to finish within FAIR_STARTS_WINDOW. However many keys there are, these bound the
# rows read: 100,000 keys cost what 10 do.
FAIR_GROUPS_SHOWN = 10
FAIR_READY_READ = 10_000
FAIR_STARTS_READ = 1_000
FAIR_STARTS_WINDOW = timedelta(hours=1)


@dataclass
class BlockedKey:
    key: str
    limit: int | None
    free: int | None
    holders: int
    blocked: int
    oldest_blocked_at: datetime | None
    lease_expires_at: datetime | None = None


@dataclass
class ProcessInfo:
    id: int
    kind: str
    name: str
    hostname: str
    pid: int
    last_heartbeat_at: datetime
    alive: bool
    running_jobs: list[int] = field(default_factory=list)
    # A worker's event loop of ``async def`` jobs, from its row's metadata
    # (``process_metadata.async_loop``); None for the other kinds, and for a figure the
    # row does not hold as a number in range. ``async_jobs``: how many at once (0: they
    # run on its threads); ``loop_stalls``: times the loop was held past
    # ``event_loop_block_threshold`` since the process started; ``loop_stalled_seconds``:
    # for how long in all.
    async_jobs: int | None = None
    loop_stalls: int | None = None
    loop_stalled_seconds: float | None = None


@dataclass
class RunningProgress:
    """A running job that has reported progress (``django_jobs.set_progress``)."""

    job_id: int
    task_path: str
    queue_name: str
    done: float
    total: float | None
    fraction: float | None
    message: str
    updated_at: datetime


@dataclass
class Snapshot:
    taken_at: datetime
    queues: dict[str, dict[str, int]]
    paused: list[str]
    blocked_keys: list[BlockedKey]
    stuck: dict[str, list[int]]
    processes: list[ProcessInfo]
    progress: list[RunningProgress] = field(default_factory=list)
    # How many keys have blocked jobs: ``blocked_keys`` holds the first KEYS_READ of them
    # (by name); counted up to COUNT_CAP + 1, which means "more than COUNT_CAP".
    blocked_key_count: int = 0
    # The latest WORKFLOWS_SHOWN workflows, newest first, as their jobs say they stand.
    workflows: list[WorkflowState] = field(default_factory=list)
    # Where the queues' failed_last_hour and finished_last_hour start: the hour's first
    # minute, or a later one when the hour held more than QUEUE_ROWS_READ finished jobs.
    finished_since: datetime | None = None
    # How many minutes that is (60: the whole hour, the minute under way included).
    finished_minutes: int = 60
    # Each fair queue's groups with the most ready jobs and their shares of recent starts
    # (``fair_groups``); empty when no queue is fair.
    fair_queues: list[FairQueue] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        def encode(value: Any) -> Any:
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, dict):
                return {k: encode(v) for k, v in value.items()}
            if isinstance(value, list):
                return [encode(v) for v in value]
            return value

        return encode(asdict(self))


@dataclass
class QueueCounts:
    """Per queue, what :func:`count_queues` was asked for.

    ``pending``: queue -> {ready, scheduled, blocked, awaiting, running}, for the queues
    with a row in some execution table. ``finished``: queue -> {succeeded, failed,
    discarded} in the window asked for, for the queues with a job that finished in it
    (empty if none was asked). ``oldest_ready_at``: queue -> its oldest ready row's
    ``created_at``, when that job became ready (only if asked, and for the queues with
    ready jobs).
    """

    pending: dict[str, dict[str, int]] = field(default_factory=dict)
    finished: dict[str, dict[str, int]] = field(default_factory=dict)
    oldest_ready_at: dict[str, datetime] = field(default_factory=dict)


def count_queues(
    db: str,
    *,
    finished_since: datetime | None = None,
    finished_until: datetime | None = None,
    oldest_ready: bool = False,
) -> QueueCounts:
    """Jobs per queue in each execution table, and those that finished in a window.

    One grouped query per execution table: as large as the backlog, not the history.
    The jobs finished in ``[finished_since, finished_until)`` (no end: up to now) are
    one more, ``status IN (...) AND finished_at >= since``: a range of the
    ``(status, finished_at)`` index per outcome, whose cost follows the jobs finished
    in the window. So each caller names the narrowest window it shows (the metrics one
    minute, ``manage.py jobs`` the hour), and none reads it when ``finished_since`` is
    None (the dashboard reads its hour with ``recent_outcomes``, once for its chart and
    its table). ``oldest_ready``: also each queue's oldest ready row, read in the same scan
    as the ready count.
    """
    counts = QueueCounts()

    def add(state: str, queue: str, n: int) -> None:
        counts.pending.setdefault(queue, dict.fromkeys(PENDING_STATES, 0))[state] = n

    for state, table in PENDING_TABLES:
        rows = table.objects.using(db).values_list("queue_name").order_by()
        if state == "ready" and oldest_ready:
            grouped = rows.annotate(n=Count("pk"), oldest=Min("created_at"))
            for queue, n, first in grouped.values_list("queue_name", "n", "oldest"):
                add(state, queue, n)
                counts.oldest_ready_at[queue] = first
        else:
            for queue, n in rows.annotate(n=Count("pk")).values_list("queue_name", "n"):
                add(state, queue, n)
    if finished_since is not None:
        counts.finished = finished_counts(db, finished_since, finished_until)
    return counts


def finished_counts(
    db: str, since: datetime, until: datetime | None = None
) -> dict[str, dict[str, int]]:
    """Per queue, the jobs that reached each outcome in ``[since, until)``."""
    rows = Job.objects.using(db).filter(status__in=OUTCOMES, finished_at__gte=since)
    if until is not None:
        rows = rows.filter(finished_at__lt=until)
    grouped = (
        rows.values_list("queue_name", "status")
        .annotate(n=Count("pk"))
        .values_list("queue_name", "status", "n")
        .order_by()
    )
    result: dict[str, dict[str, int]] = {}
    for queue, status, n in grouped:
        result.setdefault(queue, dict.fromkeys(OUTCOMES, 0))[status] = n
    return result


def queue_counts(
    db: str, now: datetime, recent: RecentOutcomes | None = None
) -> dict[str, dict[str, int]]:
    """``manage.py jobs``' table: per queue (sorted), its ``STATES``: the execution tables
    now, the jobs that failed and that finished (any outcome) in the last hour, or in its
    latest minutes past ``QUEUE_ROWS_READ`` jobs (``recent.queue_since`` says which)."""
    counts = count_queues(db)
    recent = recent or recent_outcomes(db, now)
    table = {}
    for queue in sorted({*counts.pending, *recent.per_queue}):
        pending = counts.pending.get(queue, dict.fromkeys(PENDING_STATES, 0))
        finished = recent.per_queue.get(queue, {})
        table[queue] = {
            **pending,
            "failed_last_hour": finished.get(JobStatus.FAILED.value, 0),
            "finished_last_hour": sum(finished.values()),
        }
    return table


def blocked_keys(
    db: str, now: datetime, keys: list[str] | None = None, limit: int | None = None
) -> list[BlockedKey]:
    """The keys with blocked jobs (only ``keys``, or the first ``limit`` by name): each
    one's limit, holders and waiters.

    A fixed number of grouped queries per chunk of keys, not a few per key; ``limit`` is
    the grouped query's LIMIT, read in the key index's order.
    """
    rows = BlockedExecution.objects.using(db)
    if keys is not None:
        rows = rows.filter(concurrency_key__in=keys)
    grouped = (
        rows.values("concurrency_key")
        .annotate(n=Count("pk"), oldest=Min("created_at"))
        .order_by("concurrency_key")
    )
    groups = list(grouped if limit is None else grouped[:limit])
    result = []
    for start in range(0, len(groups), KEY_CHUNK):
        chunk = groups[start : start + KEY_CHUNK]
        names = [group["concurrency_key"] for group in chunk]
        semaphores = {
            key: (limit, value)
            for key, limit, value in Semaphore.objects.using(db)
            .filter(key__in=names)
            .values_list("key", "limit", "value")
        }
        ready = count_by_key(ReadyExecution.objects.using(db).filter(concurrency_key__in=names))
        claims = ClaimedExecution.objects.using(db).filter(concurrency_key__in=names)
        live = count_by_key(claims.exclude(lease_expires_at__lt=now))
        leases = dict(
            claims.exclude(lease_expires_at=None)
            .values_list("concurrency_key")
            .annotate(first=Min("lease_expires_at"))
            .values_list("concurrency_key", "first")
        )
        for group in chunk:
            key = group["concurrency_key"]
            limit, free = semaphores.get(key, (None, None))
            result.append(
                BlockedKey(
                    key=key,
                    limit=limit,
                    free=free,
                    holders=ready.get(key, 0) + live.get(key, 0),
                    blocked=group["n"],
                    oldest_blocked_at=group["oldest"],
                    lease_expires_at=leases.get(key),
                )
            )
    return result


def blocked_key_count(db: str, cap: int = COUNT_CAP) -> int:
    """How many keys have blocked jobs, counted up to ``cap + 1`` (a ``LIMIT`` in the
    subquery): past the cap the answer is "more than ``cap``"."""
    keys = BlockedExecution.objects.using(db).values("concurrency_key").distinct()
    return keys.order_by()[: cap + 1].count()


def first_blocked_keys(db: str, now: datetime) -> tuple[list[BlockedKey], int]:
    """The first ``KEYS_READ`` keys with blocked jobs (by name), and how many there are
    (counted only when there are more, up to ``COUNT_CAP + 1``)."""
    keys = blocked_keys(db, now, limit=KEYS_READ)
    return keys, blocked_key_count(db) if len(keys) >= KEYS_READ else len(keys)


def count_by_key(rows) -> dict[str, int]:
    grouped = rows.values_list("concurrency_key").annotate(n=Count("pk"))
    return dict(grouped.values_list("concurrency_key", "n"))


def processes(db: str, now: datetime, conf: JobsSettings) -> list[ProcessInfo]:
    running: dict[int, list[int]] = defaultdict(list)
    for job_id, process_id in ClaimedExecution.objects.using(db).values_list(
        "job_id", "process_id"
    ):
        running[process_id].append(job_id)
    cutoff = now - timedelta(seconds=conf.alive_threshold)
    result = []
    for p in Process.objects.using(db).order_by("kind", "pk"):
        loop = async_loop(p.kind, p.metadata)
        result.append(
            ProcessInfo(
                id=p.pk,
                kind=p.kind,
                name=p.name,
                hostname=p.hostname,
                pid=p.pid,
                last_heartbeat_at=p.last_heartbeat_at,
                alive=p.last_heartbeat_at >= cutoff,
                running_jobs=sorted(running.get(p.pk, [])),
                async_jobs=loop.async_jobs if loop else None,
                loop_stalls=loop.stalls if loop else None,
                loop_stalled_seconds=loop.stalled_seconds if loop else None,
            )
        )
    return result


def stuck_jobs(
    db: str, now: datetime, conf: JobsSettings, live: list[ProcessInfo], keys: list[BlockedKey]
) -> dict[str, list[int]]:
    """Job ids (at most ``STUCK_SAMPLE`` of each kind) for every way a job can be stuck.

    Jobs blocked behind a free slot are looked for among ``keys`` only (a snapshot's
    first KEYS_READ)."""
    alive_ids = [p.id for p in live if p.alive]
    dead_claims = (
        ClaimedExecution.objects.using(db)
        .exclude(process_id__in=alive_ids)
        .order_by("job_id")
        .values_list("job_id", flat=True)[:STUCK_SAMPLE]
    )
    free_keys = [k.key for k in keys if k.limit is not None and k.holders < k.limit]
    behind_free_slot: list[int] = []
    for start in range(0, len(free_keys), KEY_CHUNK):
        behind_free_slot += (
            BlockedExecution.objects.using(db)
            .filter(concurrency_key__in=free_keys[start : start + KEY_CHUNK])
            .order_by("job_id")
            .values_list("job_id", flat=True)[: STUCK_SAMPLE - len(behind_free_slot)]
        )
        if len(behind_free_slot) >= STUCK_SAMPLE:
            break
    served = [
        QueueSelector(queues)
        for queues in map(
            served_queues,
            Process.objects.using(db)
            .filter(pk__in=[p.id for p in live if p.alive and p.kind == Process.Kind.WORKER])
            .values_list("metadata", flat=True),
        )
        if queues
    ]
    paused = set(Pause.objects.using(db).values_list("queue_name", flat=True))
    ready_queues = ReadyExecution.objects.using(db).values_list("queue_name", flat=True).distinct()
    unserved = sorted(
        q for q in ready_queues if q not in paused and not any(s.matches(q) for s in served)
    )
    unserved_jobs = (
        ReadyExecution.objects.using(db)
        .filter(queue_name__in=unserved)
        .order_by("job_id")
        .values_list("job_id", flat=True)[:STUCK_SAMPLE]
    )
    overdue_after = max(300.0, conf.dispatcher_interval * 10)
    overdue = (
        ScheduledExecution.objects.using(db)
        .filter(scheduled_at__lt=now - timedelta(seconds=overdue_after))
        .order_by("scheduled_at")
        .values_list("job_id", flat=True)[:STUCK_SAMPLE]
    )
    return {
        "claimed_by_dead_process": list(dead_claims),
        "blocked_behind_free_slot": behind_free_slot,
        "ready_in_unserved_queue": list(unserved_jobs),
        "scheduled_long_past_due": list(overdue),
        "running_far_too_long": running_too_long(db, now),
    }


def running_too_long(db: str, now: datetime, factor: float = 5.0) -> list[int]:
    """Running jobs past ``factor`` times their task's usual (median) duration.

    A task's usual duration is read with LIMITs only, so its cost never follows the
    history: the median of its successes among the latest ``RECENT_SUCCESSES`` successes
    (one read of the ``(status, finished_at)`` index's end, for every task at once), or,
    for a task with fewer than ``SAMPLES_NEEDED`` there (a rare one, or one that has not
    succeeded lately), of its successes among ``TASK_ROWS_READ`` of its jobs (read
    through the ``task_path`` index). Asking each task for its latest successes instead
    walked the index back past every success since its last one: 3 days of history for
    a task failing since a deploy 3 days ago, whose retry runs.
    """
    running = list(
        Job.objects.using(db)
        .filter(status=JobStatus.RUNNING)
        .order_by("last_attempted_at")
        .values_list("pk", "task_path", "last_attempted_at")[:500]
    )
    if not running:
        return []
    durations: dict[str, list[float]] = defaultdict(list)
    recent = (
        Job.objects.using(db)
        .filter(status=JobStatus.SUCCEEDED)
        .order_by("-finished_at")
        .values_list("task_path", "last_attempted_at", "finished_at")[:RECENT_SUCCESSES]
    )
    for task_path, start, end in recent:
        if start and end and len(durations[task_path]) < SAMPLES_KEPT:
            durations[task_path].append((end - start).total_seconds())
    for task_path in {path for _, path, _ in running}:
        if len(durations[task_path]) < SAMPLES_NEEDED:
            durations[task_path] = task_durations(db, task_path)
    late = []
    for pk, task_path, began in running:
        median = median_of(durations[task_path])
        if (
            median is not None
            and began
            and (now - began).total_seconds() > max(1.0, median * factor)
        ):
            late.append(pk)
    return late[:STUCK_SAMPLE]


def task_durations(db: str, task_path: str) -> list[float]:
    """The durations of ``task_path``'s successes among ``TASK_ROWS_READ`` of its jobs
    (in the index's order, not the latest: no index orders a task's jobs by time)."""
    rows = (
        Job.objects.using(db)
        .filter(task_path=task_path)
        .order_by()
        .values_list("status", "last_attempted_at", "finished_at")[:TASK_ROWS_READ]
    )
    return [
        (end - start).total_seconds()
        for status, start, end in rows
        if status == JobStatus.SUCCEEDED and start and end
    ][:SAMPLES_KEPT]


def median_of(durations: list[float]) -> float | None:
    """The median of ``durations``; None for fewer than ``SAMPLES_NEEDED``."""
    if len(durations) < SAMPLES_NEEDED:
        return None
    ordered = sorted(durations)
    return ordered[len(ordered) // 2]


def running_progress(db: str, limit: int = STUCK_SAMPLE) -> list[RunningProgress]:
    """Running jobs that have reported progress, at most ``limit``, oldest job first.

    Reads the running jobs through the ``(status, finished_at)`` index: as many rows
    as jobs run now, never the history.
    """
    rows = (
        Job.objects.using(db)
        .filter(status=JobStatus.RUNNING, progress_at__isnull=False)
        .order_by("pk")
        .values_list(
            "pk",
            "task_path",
            "queue_name",
            "progress_done",
            "progress_total",
            "progress_message",
            "progress_at",
        )[:limit]
    )
    result = []
    for pk, task_path, queue_name, done, total, message, at in rows:
        reported = from_row(done, total, message, at)
        if reported is not None:
            result.append(
                RunningProgress(
                    job_id=pk,
                    task_path=task_path,
                    queue_name=queue_name,
                    done=reported.done,
                    total=reported.total,
                    fraction=reported.fraction,
                    message=reported.message,
                    updated_at=reported.updated_at,
                )
            )
    return result


def snapshot(conf: JobsSettings | None = None) -> Snapshot:
    conf = conf or JobsSettings.load()
    db = conf.database
    now = timezone.now()
    keys, key_count = first_blocked_keys(db, now)
    procs = processes(db, now, conf)
    recent = recent_outcomes(db, now)
    return Snapshot(
        taken_at=now,
        queues=queue_counts(db, now, recent),
        finished_since=recent.queue_since,
        finished_minutes=recent.queue_minutes,
        paused=sorted(Pause.objects.using(db).values_list("queue_name", flat=True)),
        blocked_keys=keys,
        stuck=stuck_jobs(db, now, conf, procs, keys),
        processes=procs,
        progress=running_progress(db),
        blocked_key_count=key_count,
        workflows=latest_workflows(db),
        fair_queues=fair_groups(db, fair_queue_list(conf), now),
    )


def latest_workflows(db: str, limit: int = WORKFLOWS_SHOWN) -> list[WorkflowState]:
    """The newest ``limit`` workflows, each one's state from ``workflow_states`` (the one
    place it is computed): two queries, the second grouped over their jobs' index."""
    rows = list(Workflow.objects.using(db).order_by("-pk")[:limit])
    states = workflow_states(db, rows)
    return [states[row.pk] for row in rows]


@dataclass
class Holder:
    """A job counted against its key's limit: ready (admitted, not yet claimed) or claimed."""

    job_id: int
    state: str
    since: datetime
    process_id: int | None = None
    lease_expires_at: datetime | None = None
    # Its process's name, for a page that shows it (the admin's blocked page fills it).
    process_name: str = ""


def key_holders(db: str, key: str, limit: int = STUCK_SAMPLE) -> list[Holder]:
    """The jobs holding ``key``'s slots, claimed ones first (read through the key indexes)."""
    claimed = (
        ClaimedExecution.objects.using(db)
        .filter(concurrency_key=key)
        .order_by("created_at")
        .values_list("job_id", "created_at", "process_id", "lease_expires_at")[:limit]
    )
    holders = [
        Holder(job_id, "claimed", since, process_id, lease)
        for job_id, since, process_id, lease in claimed
    ]
    ready = (
        ReadyExecution.objects.using(db)
        .filter(concurrency_key=key)
        .order_by("created_at")
        .values_list("job_id", "created_at")[: max(0, limit - len(holders))]
    )
    holders += [Holder(job_id, "ready", since) for job_id, since in ready]
    return holders


@dataclass
class RecentOutcomes:
    """The jobs finished over the last minutes: per minute (the dashboard's chart) and
    per queue (its table's and ``manage.py jobs``' outcome columns).

    ``per_minute``: ``{"minute", "succeeded", "failed", "discarded"}`` for every minute,
    oldest first (the last one is the minute under way). ``per_queue``: queue ->
    ``{succeeded, failed, discarded}`` finished since ``queue_since``, for the queues with
    a job finished then: the whole window, or its latest minutes when the window held more
    than ``QUEUE_ROWS_READ`` jobs (``queue_since`` then says from when).
    """

    per_minute: list[dict[str, Any]]
    per_queue: dict[str, dict[str, int]]
    queue_since: datetime

    @property
    def start(self) -> datetime:
        return self.per_minute[0]["minute"]

    @property
    def end(self) -> datetime:
        return self.per_minute[-1]["minute"] + timedelta(minutes=1)

    @property
    def queue_minutes(self) -> int:
        """How many minutes ``per_queue`` counts (of ``len(per_minute)``)."""
        return round((self.end - self.queue_since).total_seconds() / 60)

    @property
    def queue_window_cut(self) -> bool:
        return self.queue_since > self.start


def recent_outcomes(
    db: str, now: datetime, minutes: int = 60, queue_rows: int | None = None
) -> RecentOutcomes:
    """The jobs that reached each outcome over the last ``minutes`` (the one under way
    included): per minute, and per queue over the latest of those minutes that hold at
    most ``queue_rows`` jobs (``QUEUE_ROWS_READ``; at least the minute under way).

    Two grouped reads of the ``(status, finished_at)`` index range, whose cost follows
    the jobs finished in it, never the table's size. Per minute needs nothing outside
    that index (MySQL, MariaDB and SQLite count it from the index alone, PostgreSQL as
    far as its visibility map allows); per queue needs each row's queue, a look-up per
    row, so it reads at most ``queue_rows`` of them: 90,000 jobs finish in an hour of a
    30,000,000-job history kept 14 days, whose look-ups took 360 ms on MariaDB.
    """
    cap = QUEUE_ROWS_READ if queue_rows is None else queue_rows
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    buckets = {start + timedelta(minutes=i): dict.fromkeys(OUTCOMES, 0) for i in range(minutes)}
    rows = (
        finished_between(db, start, end)
        # Minutes in UTC: the same minutes as in any zone with whole-minute offsets, and
        # MariaDB/MySQL need no time-zone tables for it (a named zone made the dashboard
        # answer 500 where they are not loaded).
        .annotate(minute=TruncMinute("finished_at", tzinfo=UTC))
        .values_list("minute", "status")
        .annotate(n=Count("*"))
        .values_list("minute", "status", "n")
    )
    for minute, status, n in rows:
        bucket = buckets.get(minute)
        if bucket is not None and status in bucket:
            bucket[status] += n
    per_minute: list[dict[str, Any]] = [
        {"minute": minute, **counts} for minute, counts in buckets.items()
    ]
    since: datetime = per_minute[-1]["minute"]
    total = 0
    for minute in reversed(per_minute):
        total += sum(minute[status] for status in OUTCOMES)
        if total > cap and minute is not per_minute[-1]:
            break
        since = minute["minute"]
    per_queue: dict[str, dict[str, int]] = {}
    grouped = (
        finished_between(db, since, end)
        .values_list("queue_name", "status")
        .annotate(n=Count("*"))
        .values_list("queue_name", "status", "n")
    )
    for queue, status, n in grouped:
        if status in OUTCOMES:
            per_queue.setdefault(queue, dict.fromkeys(OUTCOMES, 0))[status] += n
    return RecentOutcomes(per_minute=per_minute, per_queue=per_queue, queue_since=since)


def finished_between(db: str, start: datetime, end: datetime):
    """The jobs that reached an outcome in ``[start, end)``: a range of the ``(status,
    finished_at)`` index per outcome."""
    return (
        Job.objects.using(db)
        .filter(status__in=OUTCOMES, finished_at__gte=start, finished_at__lt=end)
        .order_by()
    )


@dataclass
class FairGroup:
    """One group of a fair queue: its ``fair_key`` ('' for the jobs that give none), its
    jobs among the ready rows read (``FairQueue.ready_read``), its jobs among the recent
    starts counted (``FairQueue.starts``) and their share of those (None when none was
    counted). ``turns_queued``: how far its newest ready job stands behind the queue's head
    (the lowest turn ready at the highest priority ready), in turns of a group of weight 1:
    a group of weight 1 with 40 jobs waiting stands about 40 turns back, one of weight 2
    about 20. None where its stamp says nothing of it: no stamp, no ready job of the group
    at the head's priority among those read, or a stamp edited by hand."""

    key: str
    ready: int
    starts: int
    share: float | None
    turns_queued: float | None = None


@dataclass
class FairQueue:
    """What :func:`fair_groups` found of one fair queue.

    ``groups``: the groups with the most jobs among the ready rows read, most first (ties by
    key). ``ready_read``: the ready rows read, the queue's next ones in claim order, at most
    the ``sample`` asked for; ``ready_capped``: the queue has more ready jobs than that, so
    the counts are of its next ``ready_read`` jobs, not of all. ``groups_seen``: the groups
    among the rows read. ``other_ready``: the rows read of the groups not shown;
    ``ungrouped_ready``: of jobs with no group (``fair_key`` NULL: enqueued before the
    queue was made fair, they take their FIFO turns). ``starts``: the queue's jobs running
    now or finished since ``starts_since`` (the starts counted, the shares' whole), of
    which ``other_starts`` by the groups not shown and ``ungrouped_starts`` by jobs with no
    group; ``starts_cut``: some recent starts were left out (``starts_since`` is later than
    the window's start, or more jobs run than were read). ``head_priority``,
    ``head_turn``: where the claims are now (None with nothing ready)."""

    queue: str
    groups: list[FairGroup]
    ready_read: int
    ready_capped: bool
    groups_seen: int
    other_ready: int
    ungrouped_ready: int
    starts: int
    other_starts: int
    ungrouped_starts: int
    starts_since: datetime
    starts_cut: bool
    head_priority: int | None = None
    head_turn: int | None = None

    @property
    def ready_text(self) -> str:
        """The ready rows read as a page shows them: "10,000+" when capped."""
        return f"{self.ready_read:,}" + ("+" if self.ready_capped else "")


@dataclass
class RecentStarts:
    """Per fair queue, per group (None: no group), the jobs running now or finished since
    ``since``; ``cut``: some were left out (``since`` past the window's start, or more
    running jobs than were read)."""

    counts: dict[str, Counter[str | None]]
    since: datetime
    cut: bool


def fair_queue_list(conf: JobsSettings) -> list[str]:
    """The fair queues of ``conf`` (``DJANGO_JOBS["fair_queues"]``), sorted; none while the
    setting is malformed (check E025), as the enqueue reads it (``conf.fair_queue_names``)."""
    value = conf.fair_queues
    if not value or fair_queues_problem(value) is not None:
        return []
    return sorted(set(value))


def fair_groups(
    db: str,
    queues: Sequence[str],
    now: datetime,
    *,
    top: int | None = None,
    sample: int | None = None,
    starts: int | None = None,
    stamps: bool = True,
) -> list[FairQueue]:
    """For each of ``queues`` (fair queues, docs/fairness.md), the ``top`` groups by ready
    jobs and each one's share of the recent starts (None: ``FAIR_GROUPS_SHOWN``,
    ``FAIR_READY_READ``, ``FAIR_STARTS_READ``, read at the call).

    Every read is bounded by ``sample``, ``starts`` and ``top``, never by the number of
    keys or of ready rows, so 100,000 keys cost what 10 do (``tests/test_fair_inspection.py``
    counts the queries and checks the caps):

    - per queue, its next ``sample`` ready rows in claim order, then their jobs' ``fair_key``
      (:func:`fair_ready_rows`): one range of the ``jobs_ready_poll`` index,
      ``(queue_name, -priority, turn, job)``, stopped by a ``LIMIT``, then those jobs by
      their primary key; the groups are counted in Python among those rows. Not a
      ``GROUP BY`` of the queue's ready rows: its cost would follow the backlog (a million
      rows for a million ready jobs) and its result the keys (100,000 groups to sort).
      Past ``sample`` the counts are of the queue's next jobs, those the claims take next,
      and ``ready_capped`` says so;
    - once for all the queues, the recent starts (:func:`recent_starts`): at most
      ``starts`` running jobs of the queues, through an index led by the status (or
      ``jobs_job_queue_status``): the jobs running now, as many as the workers run; and the
      latest ``starts`` jobs to reach each outcome within ``FAIR_STARTS_WINDOW``, each a
      backward range of ``jobs_job_status_finished`` with a ``LIMIT``: ``4 * starts`` rows
      at most (0 reads with ``starts=0``);
    - per queue with jobs ready and ``stamps``, the shown groups' ``FairTurn`` rows at the
      head's priority: at most ``top`` rows, by the stamps' unique index.

    So ``3 * len(queues) + 4`` queries (with the default ``sample``, on the three
    databases' default limits on parameters), each bounded.
    """
    if not queues:
        return []
    top = FAIR_GROUPS_SHOWN if top is None else top
    sample = FAIR_READY_READ if sample is None else sample
    started = recent_starts(db, queues, now, FAIR_STARTS_READ if starts is None else starts)
    return [
        fair_queue(db, queue, started, top=top, sample=sample, stamps=stamps) for queue in queues
    ]


def fair_ready_rows(db: str, queue: str, limit: int) -> list[tuple[int, int, str | None]]:
    """The next ``limit`` ready rows of ``queue`` in claim order (priority descending, turn,
    job id: the order of the claims, which read the same index), as (priority, turn, the
    job's ``fair_key``).

    Two reads, each bounded by ``limit``: the ready rows alone, a range of
    ``jobs_ready_poll`` in its order from its start for ``queue``, ended by the ``LIMIT``
    (every column it reads is in that index); then those jobs' keys by their primary key
    (``id IN (...)``, in as few statements as the database's limit on parameters allows:
    one on PostgreSQL, MariaDB and SQLite at the default ``limit``). Not one join: given
    the ready table joined to the jobs, PostgreSQL may hash the queue's every ready row
    with the whole job table and sort them (it did on a small table), a cost that follows
    the backlog; here the join's side is at most ``limit`` ids whatever the plan. A job
    pruned between the two reads is left out."""
    rows = list(
        ReadyExecution.objects.using(db)
        .filter(queue_name=queue)
        .order_by("-priority", "turn", "job_id")
        .values_list("priority", "turn", "job_id")[:limit]
    )
    keys: dict[int, str | None] = {}
    chunk = connections[db].features.max_query_params or len(rows) or 1
    ids = [job_id for _, _, job_id in rows]
    for start in range(0, len(ids), chunk):
        found = Job.objects.using(db).filter(pk__in=ids[start : start + chunk])
        keys.update(found.order_by().values_list("pk", "fair_key"))
    return [(priority, turn, keys[job_id]) for priority, turn, job_id in rows if job_id in keys]


def recent_starts(db: str, queues: Sequence[str], now: datetime, limit: int) -> RecentStarts:
    """The jobs of ``queues`` that started lately, per queue and group: those running now
    and those finished since the window's start (``FAIR_STARTS_WINDOW`` ago), read with
    ``LIMIT``s only.

    No index orders a queue's jobs by their start (``last_attempted_at`` has none), and the
    one that orders jobs by their end, ``(status, finished_at)``, has no queue: asking it
    for a queue's latest jobs would walk back past every other queue's. So each outcome's
    latest ``limit`` jobs of every queue are read (a backward range of that index: ``limit``
    entries and look-ups, whatever the history) and those of ``queues`` kept in Python.
    Where a read was cut (``limit`` rows), the window starts after its last row for every
    outcome alike, so that no outcome is counted over a longer time than another. The
    running jobs are read through an index of their status (PostgreSQL and MariaDB chose
    ``(status, ...)``, SQLite ``(queue_name, status)``): the jobs running now, a number the
    workers' threads bound, and at most ``limit`` of them. A job that finished without
    starting (discarded while it waited) is no start; a job retried after a failed attempt
    is counted when it ends."""
    window_start = now - FAIR_STARTS_WINDOW
    counts: dict[str, Counter[str | None]] = {queue: Counter() for queue in queues}
    if limit <= 0:
        return RecentStarts(counts=counts, since=now, cut=False)
    since, cut = window_start, False
    finished: list[tuple[str, str | None, datetime | None, datetime | None]] = []
    for status in OUTCOMES:
        rows = list(
            Job.objects.using(db)
            .filter(status=status, finished_at__gte=window_start)
            .order_by("-finished_at")
            .values_list("queue_name", "fair_key", "finished_at", "last_attempted_at")[:limit]
        )
        last = rows[-1][2] if len(rows) >= limit else None
        if last is not None:
            since, cut = max(since, last), True
        finished += rows
    for queue, key, finished_at, started_at in finished:
        tally = counts.get(queue)
        if tally is None or started_at is None or finished_at is None:
            continue
        # Past a cut, the rows at its very instant are left out too: another outcome's
        # rows of that instant may not all have been read.
        if not cut or finished_at > since:
            tally[key] += 1
    running = list(
        Job.objects.using(db)
        .filter(queue_name__in=list(queues), status=JobStatus.RUNNING)
        .order_by()
        .values_list("queue_name", "fair_key")[:limit]
    )
    cut = cut or len(running) >= limit
    for queue, key in running:
        if queue in counts:
            counts[queue][key] += 1
    return RecentStarts(counts=counts, since=since, cut=cut)


def fair_queue(
    db: str, queue: str, started: RecentStarts, *, top: int, sample: int, stamps: bool
) -> FairQueue:
    """One queue of :func:`fair_groups`: its ready rows read and counted, its top groups,
    their shares of ``started``, their stamps."""
    sample = max(1, sample)
    rows = fair_ready_rows(db, queue, sample + 1)
    capped = len(rows) > sample
    rows = rows[:sample]
    ready: Counter[str] = Counter(key for _, _, key in rows if key is not None)
    ungrouped = len(rows) - ready.total()
    shown = sorted(ready, key=lambda key: (-ready[key], key))[: max(0, top)]
    head_priority, head_turn = (rows[0][0], rows[0][1]) if rows else (None, None)
    at_head = {key for priority, _, key in rows if priority == head_priority}
    queued: dict[str, float] = {}
    if stamps and shown and head_turn is not None:
        queued = turns_queued(
            db, queue, head_priority, head_turn, [k for k in shown if k in at_head]
        )
    starts = started.counts.get(queue, Counter())
    total = sum(starts.values())
    groups = [
        FairGroup(
            key=key,
            ready=ready[key],
            starts=starts.get(key, 0),
            share=starts.get(key, 0) / total if total else None,
            turns_queued=queued.get(key),
        )
        for key in shown
    ]
    shown_starts = sum(group.starts for group in groups)
    ungrouped_starts = starts.get(None, 0)
    return FairQueue(
        queue=queue,
        groups=groups,
        ready_read=len(rows),
        ready_capped=capped,
        groups_seen=len(ready),
        other_ready=sum(ready.values()) - sum(group.ready for group in groups),
        ungrouped_ready=ungrouped,
        starts=total,
        other_starts=total - shown_starts - ungrouped_starts,
        ungrouped_starts=ungrouped_starts,
        starts_since=started.since,
        starts_cut=started.cut,
        head_priority=head_priority,
        head_turn=head_turn,
    )


def turns_queued(
    db: str, queue: str, priority: int | None, head: int, keys: list[str]
) -> dict[str, float]:
    """Per key of ``keys`` (at most the groups shown), how many turns of weight 1 its stamp
    (``FairTurn.last_turn``: the turn of its newest ready job) stands behind ``head`` at
    ``priority``: one read of the stamps' unique index per key, in one query. A stamp
    the enqueue would not trust (``fairness.is_sane``) or behind the head gives nothing."""
    if not keys or priority is None:
        return {}
    stamps = FairTurn.objects.using(db).filter(
        queue_name=queue, priority=priority, fair_key__in=keys
    )
    return {
        key: (last - head) / TURN_SCALE
        for key, last in stamps.values_list("fair_key", "last_turn")
        if last is not None and is_sane(last, head) and last >= head
    }
