"""The numbers behind the metrics, read from the database in a fixed, small set of queries.

Every query reads the execution tables (ready, scheduled, blocked, claimed: as large as
the backlog, not the history), the process, pause and semaphore tables, or the
``(status, finished_at)`` index range of ``Job`` for the last minute: the cost follows
the backlog and the jobs finished per minute, never the number of finished jobs kept.
Blocked keys and processes come from ``django_jobs.observability.inspection``, as in
``manage.py jobs``.

Not ``inspection.queue_counts``: it also counts the jobs finished in the last hour per
queue, whose cost follows the hour's throughput (each row of the range is looked up for
its queue): 370 ms per scrape on MariaDB with 38,000 jobs finished in the hour, for a
number the last minute's gauge gives better. The four grouped counts it shares with this
module are a few lines; the ready one here also reads the oldest ready row in the same scan.

No transaction is opened (on SQLite, with ``transaction_mode=IMMEDIATE``, one would take
the write lock); each query sees the database as it is when it runs, so values may
disagree by what changed during the scrape's few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, Min
from django.tasks import task_backends
from django.utils import timezone

from django_jobs.backend import JobsBackend
from django_jobs.conf import JobsSettings
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    Pause,
    ReadyExecution,
    ScheduledExecution,
)
from django_jobs.observability.inspection import BlockedKey, ProcessInfo, blocked_keys, processes

# The states of ``django_jobs_jobs`` ("running": a claimed execution, started or about to
# be, as ``manage.py jobs`` counts it).
PENDING_STATES = ("ready", "scheduled", "blocked", "running")
OUTCOMES = (str(JobStatus.SUCCEEDED), str(JobStatus.FAILED), str(JobStatus.DISCARDED))
LAST_MINUTE = timedelta(seconds=60)


@dataclass
class Facts:
    """One scrape's worth of numbers, in plain Python (no ``prometheus_client`` needed)."""

    taken_at: datetime
    # queue -> {ready, scheduled, blocked, running}
    pending: dict[str, dict[str, int]]
    # queue -> when its oldest ready job became ready (queues with ready jobs only)
    oldest_ready_at: dict[str, datetime]
    # queue -> {succeeded, failed, discarded} finished in the last 60 seconds
    finished_last_minute: dict[str, dict[str, int]]
    paused: set[str]
    # How many keys have blocked jobs, and the ``top`` of them with the most.
    blocked_key_count: int
    top_blocked_keys: list[BlockedKey]
    processes: list[ProcessInfo] = field(default_factory=list)

    @property
    def queues(self) -> list[str]:
        """Every queue with a series: configured, seen in a table, or paused."""
        return sorted(set(self.pending) | set(self.finished_last_minute) | self.paused)


def configured_queues(db: str) -> set[str]:
    """The ``QUEUES`` of every jobs backend writing to ``db``: listed even while empty, so
    each queue's series exist (at 0) before its first job, and alerts need no ``absent()``."""
    names: set[str] = set()
    for backend in task_backends.all():
        if isinstance(backend, JobsBackend) and backend.database == db:
            names.update(backend.queues)
    return names


def pending_counts(db: str) -> tuple[dict[str, dict[str, int]], dict[str, datetime]]:
    """Jobs per queue in each execution table, and each queue's oldest ready row.

    The oldest ``created_at`` is when that job became ready (enqueued, admitted from
    blocked, promoted from scheduled, or handed back), read in the same scan as the
    ready count. Four grouped queries, one per table.
    """
    pending: dict[str, dict[str, int]] = {}

    def add(state: str, queue: str, n: int) -> None:
        pending.setdefault(queue, dict.fromkeys(PENDING_STATES, 0))[state] = n

    oldest: dict[str, datetime] = {}
    ready = (
        ReadyExecution.objects.using(db)
        .values_list("queue_name")
        .annotate(n=Count("pk"), oldest=Min("created_at"))
        .values_list("queue_name", "n", "oldest")
        .order_by()
    )
    for queue, n, first in ready:
        add("ready", queue, n)
        oldest[queue] = first
    for state, table in (
        ("scheduled", ScheduledExecution),
        ("blocked", BlockedExecution),
        ("running", ClaimedExecution),
    ):
        rows = table.objects.using(db).values_list("queue_name").annotate(n=Count("pk"))
        for queue, n in rows.values_list("queue_name", "n").order_by():
            add(state, queue, n)
    return pending, oldest


def finished_last_minute(db: str, now: datetime) -> dict[str, dict[str, int]]:
    """Per queue, jobs that reached each outcome in the last minute.

    ``status IN (...) AND finished_at >= now - 60s`` is a range of the
    ``jobs_job_status_finished`` index per status: it reads the minute's rows and
    nothing older, however many finished jobs the table keeps.
    """
    rows = (
        Job.objects.using(db)
        .filter(status__in=OUTCOMES, finished_at__gte=now - LAST_MINUTE)
        .values_list("queue_name", "status")
        .annotate(n=Count("pk"))
        .values_list("queue_name", "status", "n")
        .order_by()
    )
    result: dict[str, dict[str, int]] = {}
    for queue, status, n in rows:
        result.setdefault(queue, dict.fromkeys(OUTCOMES, 0))[str(status)] = n
    return result


def top_blocked_keys(db: str, now: datetime, top: int) -> tuple[int, list[BlockedKey]]:
    """How many keys have blocked jobs, and the ``top`` with the most (ties by name).

    Two reads of the blocked table (as large as the blocked backlog); limit, holders
    and oldest blocked job are then asked of ``inspection.blocked_keys`` for those keys
    alone (five indexed queries), not for every blocked key.
    """
    # COUNT(*) over SELECT DISTINCT, not COUNT(DISTINCT ...): PostgreSQL hashes the
    # former and sorts every blocked row for the latter (3x slower on 20,000 rows).
    count = BlockedExecution.objects.using(db).values("concurrency_key").distinct().count()
    if not count or not top:
        return count, []
    names = list(
        BlockedExecution.objects.using(db)
        .values("concurrency_key")
        .annotate(n=Count("pk"))
        .order_by("-n", "concurrency_key")
        .values_list("concurrency_key", flat=True)[:top]
    )
    details = {key.key: key for key in blocked_keys(db, now, keys=names)}
    # A key whose blocked jobs left between the two queries is gone from ``details``.
    return count, [details[name] for name in names if name in details]


def gather(top_keys: int = 20, conf: JobsSettings | None = None) -> Facts:
    """Every number of one scrape: 9 queries, 15 when some job is blocked."""
    conf = conf or JobsSettings.load()
    db = conf.database
    now = timezone.now()
    pending, oldest = pending_counts(db)
    paused = set(Pause.objects.using(db).values_list("queue_name", flat=True))
    for name in configured_queues(db):
        pending.setdefault(name, dict.fromkeys(PENDING_STATES, 0))
    key_count, keys = top_blocked_keys(db, now, top_keys)
    return Facts(
        taken_at=now,
        pending=pending,
        oldest_ready_at=oldest,
        finished_last_minute=finished_last_minute(db, now),
        paused=paused,
        blocked_key_count=key_count,
        top_blocked_keys=keys,
        processes=processes(db, now, conf),
    )
