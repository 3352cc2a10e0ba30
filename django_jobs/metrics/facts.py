"""The numbers behind the metrics, read from the database in a fixed, small set of queries.

Most come from ``django_jobs.inspection``, the same functions ``manage.py jobs`` uses, so
the endpoint and the command never disagree. Every query reads the execution tables
(ready, scheduled, blocked, claimed: as large as the backlog, not the history), the
process and pause tables, or a ``(status, finished_at)`` index range of ``Job`` for the
last hour or minute: the cost follows the backlog and the recent throughput, never the
number of finished jobs kept. No transaction is opened (on SQLite, with
``transaction_mode=IMMEDIATE``, one would take the write lock); each query sees the
database as it is when it runs, so values may disagree by what changed during the
scrape's few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Count, Min
from django.tasks import task_backends
from django.utils import timezone

from ..backend import JobsBackend
from ..conf import JobsSettings
from ..inspection import (
    STATES,
    BlockedKey,
    ProcessInfo,
    blocked_keys,
    processes,
    queue_counts,
)
from ..models import BlockedExecution, Job, JobStatus, Pause, ReadyExecution

# The pending states of ``django_jobs_jobs``, as ``inspection.queue_counts`` names them
# ("running": a claimed execution, started or about to be).
PENDING_STATES = ("ready", "scheduled", "blocked", "running")
OUTCOMES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DISCARDED)
LAST_MINUTE = timedelta(seconds=60)


@dataclass
class Facts:
    """One scrape's worth of numbers, in plain Python (no ``prometheus_client`` needed)."""

    taken_at: datetime
    alive_threshold: float
    # queue -> {ready, scheduled, blocked, running, failed_last_hour, finished_last_hour}
    queues: dict[str, dict[str, int]]
    # queue -> when its oldest ready job became ready (queues with ready jobs only)
    oldest_ready_at: dict[str, datetime]
    # queue -> {succeeded, failed, discarded} finished in the last 60 seconds
    finished_last_minute: dict[str, dict[str, int]]
    paused: set[str]
    # How many keys have blocked jobs, and the ``top`` of them with the most.
    blocked_key_count: int
    top_blocked_keys: list[BlockedKey]
    processes: list[ProcessInfo] = field(default_factory=list)


def configured_queues(db: str) -> set[str]:
    """The ``QUEUES`` of every jobs backend writing to ``db``: listed even while empty, so
    each queue's series exist (at 0) before its first job, and alerts need no ``absent()``."""
    names: set[str] = set()
    for backend in task_backends.all():
        if isinstance(backend, JobsBackend) and backend.database == db:
            names.update(backend.queues)
    return names


def oldest_ready(db: str) -> dict[str, datetime]:
    """Per queue, the ``created_at`` of its oldest ready row: when that job became ready
    (enqueued, admitted from blocked, promoted from scheduled, or handed back)."""
    rows = (
        ReadyExecution.objects.using(db)
        .values_list("queue_name")
        .annotate(oldest=Min("created_at"))
        .values_list("queue_name", "oldest")
        .order_by()
    )
    return dict(rows)


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
        result.setdefault(queue, dict.fromkeys(map(str, OUTCOMES), 0))[str(status)] = n
    return result


def top_blocked_keys(db: str, now: datetime, top: int) -> tuple[int, list[BlockedKey]]:
    """How many keys have blocked jobs, and the ``top`` with the most (ties by name).

    The grouping reads the blocked table once through its ``(concurrency_key, ...)``
    index; limit, holders and oldest blocked job are then asked of
    ``inspection.blocked_keys`` for those keys alone, not for every blocked key.
    """
    count = (
        BlockedExecution.objects.using(db).aggregate(n=Count("concurrency_key", distinct=True))["n"]
        or 0
    )
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
    """Every number of one scrape (see docs/metrics.md for the queries it costs)."""
    conf = conf or JobsSettings.load()
    db = conf.database
    now = timezone.now()
    queues = queue_counts(db, now)
    paused = set(Pause.objects.using(db).values_list("queue_name", flat=True))
    for name in configured_queues(db) | paused:
        queues.setdefault(name, dict.fromkeys(STATES, 0))
    key_count, keys = top_blocked_keys(db, now, top_keys)
    return Facts(
        taken_at=now,
        alive_threshold=conf.alive_threshold,
        queues=dict(sorted(queues.items())),
        oldest_ready_at=oldest_ready(db),
        finished_last_minute=finished_last_minute(db, now),
        paused=paused,
        blocked_key_count=key_count,
        top_blocked_keys=keys,
        processes=processes(db, now, conf),
    )
