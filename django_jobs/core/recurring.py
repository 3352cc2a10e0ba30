"""Recurring tasks, the database side: settings to rows, and each tick enqueued once.

Exactly once per tick comes from one rule: the ``RecurringExecution`` row of a
tick (unique on ``(task_key, run_at)``) and the job it enqueues are written in
the same transaction. A second scheduler firing the same tick waits on the
first one's uncommitted row, then gets an IntegrityError and enqueues nothing;
a scheduler that dies before its commit leaves neither row nor job, so the tick
is still free for the next one. This is why the task's backend must write to
this same database (system check ``django_jobs.E020``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.tasks import Task
from django.utils import timezone

from django_jobs.models import RecurringExecution, RecurringTask
from django_jobs.tasks.backends import jobs_backends
from django_jobs.tasks.loading import load_task
from django_jobs.tasks.schedules import Schedule, ScheduleError, parse_schedule, whole_second
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.scheduler")

ENTRY_KEYS = frozenset(
    {"task", "schedule", "args", "kwargs", "queue_name", "priority", "timezone", "description"}
)
KEY_MAX_LENGTH = cast(int, RecurringTask._meta.get_field("key").max_length)


@dataclass(frozen=True)
class RecurringEntry:
    """One entry of ``DJANGO_JOBS["recurring"]``, parsed."""

    key: str
    task_path: str
    schedule: Schedule
    schedule_text: str
    time_zone: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    queue_name: str | None = None
    priority: int | None = None
    description: str = ""

    def task(self) -> Task:
        """The task with this entry's queue and priority, imported by path (invariant 7)."""
        task = load_task(self.task_path)
        if self.queue_name is None and self.priority is None:
            return task
        # None keeps the task's own value.
        return task.using(queue_name=self.queue_name, priority=self.priority)


def default_time_zone() -> str:
    return getattr(settings, "TIME_ZONE", None) or "UTC"


def parse_entry(key: str, raw: Mapping[str, Any]) -> RecurringEntry:
    """Parse one settings entry; ImproperlyConfigured says what is wrong (the checks say more)."""
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"recurring task {key!r}: entry must be a dict")
    unknown = sorted(set(raw) - ENTRY_KEYS)
    if unknown:
        raise ImproperlyConfigured(f"recurring task {key!r}: unknown key(s) {unknown}")
    if "task" not in raw or "schedule" not in raw:
        raise ImproperlyConfigured(f"recurring task {key!r} needs 'task' and 'schedule'")
    time_zone = raw.get("timezone") or default_time_zone()
    try:
        schedule = parse_schedule(raw["schedule"], time_zone)
    except ScheduleError as exc:
        raise ImproperlyConfigured(f"recurring task {key!r}: {exc}") from exc
    text = raw["schedule"] if isinstance(raw["schedule"], str) else schedule.text
    return RecurringEntry(
        key=key,
        task_path=raw["task"],
        schedule=schedule,
        schedule_text=text,
        time_zone=time_zone,
        args=list(raw.get("args") or []),
        kwargs=dict(raw.get("kwargs") or {}),
        queue_name=raw.get("queue_name"),
        priority=raw.get("priority"),
        description=raw.get("description") or "",
    )


def parse_entries(recurring: Mapping[str, Any]) -> list[RecurringEntry]:
    return [parse_entry(key, raw) for key, raw in recurring.items()]


def sync_recurring_tasks(db: str, entries: Iterable[RecurringEntry]) -> None:
    """Make a ``RecurringTask`` row match each entry.

    What settings define is overwritten; what only the database knows
    (``enabled``, ``active_since``, ``last_run_at``) is kept. A new row is
    active from now on: ticks before it are never caught up. Safe to run from
    several schedulers at once (conflict-ignoring insert, then plain updates).
    Rows of keys no longer in settings are left alone and never scheduled.
    """
    now = timezone.now()
    entries = list(entries)
    RecurringTask.objects.using(db).bulk_create(
        [RecurringTask(key=e.key, active_since=now, **settings_fields(e)) for e in entries],
        ignore_conflicts=True,
    )
    rows = task_rows(db, (e.key for e in entries))
    for entry in entries:
        wanted = settings_fields(entry)
        row = rows.get(entry.key)
        if row is not None and any(getattr(row, k) != v for k, v in wanted.items()):
            RecurringTask.objects.using(db).filter(key=entry.key).update(**wanted, updated_at=now)


def settings_fields(entry: RecurringEntry) -> dict[str, Any]:
    return {
        "task_path": entry.task_path,
        "schedule": entry.schedule_text,
        "time_zone": entry.time_zone,
        "args": entry.args,
        "kwargs": entry.kwargs,
        "queue_name": entry.queue_name,
        "priority": entry.priority,
    }


def task_rows(db: str, keys: Iterable[str]) -> dict[str, RecurringTask]:
    return {row.key: row for row in RecurringTask.objects.using(db).filter(key__in=list(keys))}


def enqueue_tick(db: str, entry: RecurringEntry, run_at: datetime) -> int | None:
    """Enqueue the job of one tick, unless it already was (then None).

    One transaction: the tick's execution row, the job, the job id on that row
    and the task's ``last_run_at``. The row goes in under a savepoint so that a
    duplicate (another scheduler got this tick first) leaves the outer
    transaction usable; it returns None and writes nothing. None too if the
    task is disabled (checked inside the transaction, after any disable that
    committed before it).
    """
    run_at = whole_second(run_at)
    task = resolved_task(db, entry)
    with transaction.atomic(using=db):
        if RecurringTask.objects.using(db).filter(key=entry.key, enabled=False).exists():
            return None
        try:
            with transaction.atomic(using=db):
                execution = insert_execution(db, entry.key, run_at)
        except IntegrityError:
            logger.debug("%s at %s: already enqueued", entry.key, run_at)
            return None
        job_id = enqueue_job(task, entry)
        record_job(db, entry.key, execution.pk, run_at, job_id)
    logger.info("enqueued %s for %s: job %s", entry.key, run_at.isoformat(), job_id)
    return job_id


def insert_execution(db: str, key: str, run_at: datetime) -> RecurringExecution:
    """The unique row of a tick; blocks while another transaction holds the same one."""
    return RecurringExecution.objects.using(db).create(task_key=key, run_at=run_at)


def enqueue_job(task: Task, entry: RecurringEntry) -> int:
    return int(task.enqueue(*entry.args, **entry.kwargs).id)


def record_job(db: str, key: str, execution_id: int, run_at: datetime, job_id: int) -> None:
    """The job id on the execution row; ``last_run_at`` moves forward only."""
    RecurringExecution.objects.using(db).filter(pk=execution_id).update(job_id=job_id)
    RecurringTask.objects.using(db).filter(
        Q(last_run_at__isnull=True) | Q(last_run_at__lt=run_at), key=key
    ).update(last_run_at=run_at, last_job_id=job_id)


def resolved_task(db: str, entry: RecurringEntry) -> Task:
    """The entry's task, refusing a backend outside ``db``: the tick row and the job
    would then be two transactions, and exactly-once would not hold."""
    task = entry.task()
    backend = task.get_backend()
    if backend.alias not in [ours.alias for ours in jobs_backends(db)]:
        raise ImproperlyConfigured(
            f"recurring task {entry.key!r}: {entry.task_path} must use a django-jobs "
            f"backend writing to database {db!r}"
        )
    return task


def has_execution(db: str, key: str, run_at: datetime) -> bool:
    return (
        RecurringExecution.objects.using(db)
        .filter(task_key=key, run_at=whole_second(run_at))
        .exists()
    )


def run_now(db: str, key: str) -> int:
    """Enqueue the task of ``key`` now, outside its tick series (the admin's "run now").

    Recorded as an execution whose ``run_at`` is now with a non-zero
    microsecond: ticks are whole seconds, so it never takes a tick's place.
    Works when the task is disabled (an explicit request); LookupError for an
    unknown key.
    """
    from django_jobs.conf import jobs_settings

    recurring = jobs_settings().recurring
    if key not in recurring:
        raise LookupError(f"no recurring task {key!r} in DJANGO_JOBS['recurring']")
    entry = parse_entry(key, recurring[key])
    sync_recurring_tasks(db, [entry])
    task = resolved_task(db, entry)
    now = timezone.now()
    if not now.microsecond:
        now += timedelta(microseconds=1)
    with transaction.atomic(using=db):
        execution = insert_execution(db, key, now)
        job_id = enqueue_job(task, entry)
        record_job(db, key, execution.pk, now, job_id)
    logger.info("enqueued %s on request: job %s", key, job_id)
    return job_id


def set_enabled(db: str, key: str, enabled: bool) -> bool:
    """Enable or disable a task; False if there is no such row.

    Re-enabling moves ``active_since`` to now, so the ticks missed while it was
    disabled are not caught up; enabling an enabled task changes nothing.
    """
    rows = RecurringTask.objects.using(db).filter(key=key)
    if not rows.exists():
        return False
    now = timezone.now()
    if enabled:
        rows.filter(enabled=False).update(enabled=True, active_since=now, updated_at=now)
    else:
        rows.filter(enabled=True).update(enabled=False, updated_at=now)
    return True
