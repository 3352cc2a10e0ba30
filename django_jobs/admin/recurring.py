"""Recurring tasks: each settings entry beside its database row, with run now and enable/disable.

Settings say what runs; the ``RecurringTask`` row says what only the database
knows (enabled, last run). The page merges the two, so an entry the scheduler
has not synced yet still shows, and a row whose key left the settings is
flagged instead of silently hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone

from django_jobs.admin.base import PageAdmin
from django_jobs.conf import JobsSettings
from django_jobs.core import recurring
from django_jobs.models import Job, RecurringExecution, RecurringTask

RECENT_EXECUTIONS = 5


@dataclass
class Tick:
    """One recent tick of a recurring task: when, its job, and that job's status (empty
    while unknown, or when the job is gone)."""

    run_at: datetime
    job_id: int | None
    job_status: str = ""


@dataclass
class RecurringRow:
    """One line of the page: what settings say, what the row says, and what follows."""

    key: str
    in_settings: bool
    synced: bool
    task_path: str
    schedule: str
    time_zone: str
    enabled: bool
    description: str = ""
    error: str = ""
    last_run_at: datetime | None = None
    last_job_id: int | None = None
    last_job_status: str = ""
    next_run_at: datetime | None = None
    executions: list[Tick] = field(default_factory=list)


def recurring_rows(db: str, now: datetime) -> list[RecurringRow]:
    """Every key of the settings or the table, ordered by key; one query per shown task
    for its recent ticks (recurring tasks are few: they are written in settings)."""
    configured = JobsSettings.load().recurring
    stored = {row.key: row for row in RecurringTask.objects.using(db).all()}
    rows = []
    for key in sorted(set(configured) | set(stored)):
        stored_row = stored.get(key)
        line = merged_row(key, configured.get(key), stored_row)
        if stored_row is not None:
            line.last_run_at = stored_row.last_run_at
            line.last_job_id = stored_row.last_job_id
        rows.append(line)
        if line.enabled and line.in_settings and not line.error:
            line.next_run_at = next_run(configured[key], now)
        ticks = (
            RecurringExecution.objects.using(db)
            .filter(task_key=key)
            .order_by("-run_at")
            .values_list("run_at", "job_id")[:RECENT_EXECUTIONS]
        )
        line.executions = [Tick(run_at, job_id) for run_at, job_id in ticks]
    attach_job_states(db, rows)
    return rows


def merged_row(key: str, raw: Any, stored: RecurringTask | None) -> RecurringRow:
    """The settings entry when there is one (it is what the scheduler will sync), else the row."""
    enabled = stored.enabled if stored is not None else True
    if raw is None:
        assert stored is not None
        return RecurringRow(
            key=key,
            in_settings=False,
            synced=True,
            task_path=stored.task_path,
            schedule=stored.schedule,
            time_zone=stored.time_zone,
            enabled=enabled,
        )
    try:
        entry = recurring.parse_entry(key, raw)
    except ImproperlyConfigured as exc:
        return RecurringRow(
            key=key,
            in_settings=True,
            synced=stored is not None,
            task_path=str(raw.get("task", "?")) if isinstance(raw, dict) else "?",
            schedule=str(raw.get("schedule", "?")) if isinstance(raw, dict) else "?",
            time_zone="",
            enabled=enabled,
            error=str(exc),
        )
    return RecurringRow(
        key=key,
        in_settings=True,
        synced=stored is not None,
        task_path=entry.task_path,
        schedule=entry.schedule_text,
        time_zone=entry.time_zone,
        enabled=enabled,
        description=entry.description,
    )


def next_run(raw: Any, now: datetime) -> datetime:
    """The schedule's first tick after ``now``: when the scheduler will enqueue it next."""
    return recurring.parse_entry("", raw).schedule.next(now)


def attach_job_states(db: str, rows: list[RecurringRow]) -> None:
    """Each execution's job status, in one query for the whole page."""
    ids = {e.job_id for row in rows for e in row.executions if e.job_id}
    ids |= {row.last_job_id for row in rows if row.last_job_id}
    found = Job.objects.using(db).filter(pk__in=ids).values_list("pk", "status")
    statuses: dict[int | None, str] = dict(found)
    for row in rows:
        row.last_job_status = statuses.get(row.last_job_id, "")
        for execution in row.executions:
            execution.job_status = statuses.get(execution.job_id, "")


@admin.register(RecurringTask)
class RecurringTaskAdmin(PageAdmin):
    template_name = "admin/django_jobs/recurring.html"
    title = "Recurring tasks"

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        now = timezone.now()
        return {"now": now, "tasks": recurring_rows(self.jobs_db(), now)}

    def get_urls(self):
        """The page and its actions only: a row is settings' to edit, never the admin's."""

        def wrap(view):
            return self.admin_site.admin_view(view)

        return [
            path("run-now/", wrap(self.run_now_view), name="django_jobs_recurringtask_run_now"),
            path("enable/", wrap(self.enable_view), name="django_jobs_recurringtask_enable"),
            path("disable/", wrap(self.disable_view), name="django_jobs_recurringtask_disable"),
            *super().get_urls(),
        ]

    def page_url(self) -> str:
        return reverse(f"{self.admin_site.name}:django_jobs_recurringtask_changelist")

    def key_from(self, request: HttpRequest) -> str:
        self.check_can_act(request)
        return request.POST.get("key", "")

    def run_now_view(self, request: HttpRequest) -> HttpResponse:
        key = self.key_from(request)
        try:
            job_id = recurring.run_now(self.jobs_db(), key)
        except LookupError:
            messages.error(request, unknown_key_message(key))
        except ImproperlyConfigured as exc:
            messages.error(request, f"Recurring task “{key}” was not run: {exc}")
        else:
            messages.success(request, f"Recurring task “{key}” enqueued now: job #{job_id}.")
        return HttpResponseRedirect(self.page_url())

    def enable_view(self, request: HttpRequest) -> HttpResponse:
        return self.set_enabled(request, self.key_from(request), enabled=True)

    def disable_view(self, request: HttpRequest) -> HttpResponse:
        return self.set_enabled(request, self.key_from(request), enabled=False)

    def set_enabled(self, request: HttpRequest, key: str, *, enabled: bool) -> HttpResponse:
        """Flip the row, creating it first from settings if the scheduler has not yet."""
        db = self.jobs_db()
        verb = "enabled" if enabled else "disabled"
        try:
            before = ensure_row(db, key)
        except LookupError:
            messages.error(request, unknown_key_message(key))
            return HttpResponseRedirect(self.page_url())
        except ImproperlyConfigured as exc:
            messages.error(request, f"Recurring task “{key}” was not {verb}: {exc}")
            return HttpResponseRedirect(self.page_url())
        if not recurring.set_enabled(db, key, enabled):
            messages.error(request, unknown_key_message(key))
        elif before == enabled:
            messages.warning(request, f"Recurring task “{key}” was already {verb}.")
        elif enabled:
            messages.success(
                request,
                f"Recurring task “{key}” enabled: its next tick runs; "
                "the ticks missed while it was disabled do not.",
            )
        else:
            messages.success(
                request,
                f"Recurring task “{key}” disabled: the scheduler enqueues none of its ticks "
                "until it is enabled again. Jobs already enqueued still run.",
            )
        return HttpResponseRedirect(self.page_url())

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        if request.method != "GET":
            raise PermissionDenied("use the page's buttons")
        return super().changelist_view(request, extra_context)


def ensure_row(db: str, key: str) -> bool:
    """The row's ``enabled`` now; a configured entry without a row is synced first.

    LookupError when the key is neither configured nor stored.
    """
    row = RecurringTask.objects.using(db).filter(key=key).values_list("enabled", flat=True)
    if row:
        return row[0]
    raw = JobsSettings.load().recurring.get(key)
    if raw is None:
        raise LookupError(key)
    recurring.sync_recurring_tasks(db, [recurring.parse_entry(key, raw)])
    return RecurringTask.objects.using(db).values_list("enabled", flat=True).get(key=key)


def unknown_key_message(key: str) -> str:
    return f"No recurring task “{key}”: it is not in DJANGO_JOBS['recurring']."
