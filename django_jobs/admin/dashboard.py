"""The dashboard: queues and their states, the fair queues' groups, throughput, processes,
pause and resume."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone

from django_jobs.admin.base import EMPTY, REFRESH_SECONDS, PageAdmin
from django_jobs.admin.chart import bars
from django_jobs.admin.processes import process_rows
from django_jobs.conf import JobsSettings
from django_jobs.core import operator as operations
from django_jobs.models import Dashboard, JobStatus, Pause
from django_jobs.observability import inspection

# The queue table's columns: the execution tables now, then the outcomes over the chart's
# hour, so that its succeeded and failed totals are the chart's; or, past
# ``inspection.QUEUE_ROWS_READ`` jobs in the hour, over its latest minutes, and the
# columns say which ("Succeeded (12 min)").
PENDING_COLUMNS = tuple(state.capitalize() for state in inspection.PENDING_STATES)


def outcome_window(recent: inspection.RecentOutcomes) -> str:
    """How the outcome columns name their window: "1h", or "12 min" when cut."""
    if not recent.queue_window_cut:
        return "1h"
    return f"{recent.queue_minutes} min"


def percent(part: int, whole: int) -> str:
    """``part`` of ``whole`` as the page shows a share ("12.5%"); an en dash of nothing."""
    return f"{part / whole:.1%}" if whole else EMPTY


def fair_sections(queues: list[inspection.FairQueue]) -> list[dict[str, Any]]:
    """Each fair queue's groups as the dashboard's table shows them: the groups with the
    most ready jobs, then a row for the other groups and one for the jobs of no group, each
    only when it has jobs. A key is user data: the template escapes it."""
    sections = []
    for found in queues:
        rows: list[dict[str, Any]] = [
            {
                "key": group.key,
                "ready": f"{group.ready:,}",
                "ready_share": percent(group.ready, found.ready_read),
                "starts": f"{group.starts:,}",
                "share": percent(group.starts, found.starts),
                "turns": EMPTY if group.turns_queued is None else f"{group.turns_queued:,.1f}",
            }
            for group in found.groups
        ]
        others = found.groups_seen - len(found.groups)
        rest = (
            ("others", others, found.other_ready, found.other_starts),
            ("ungrouped", None, found.ungrouped_ready, found.ungrouped_starts),
        )
        for kind, count, ready, starts in rest:
            if ready or starts:
                rows.append(
                    {
                        kind: True,
                        "count": count,
                        "ready": f"{ready:,}",
                        "ready_share": percent(ready, found.ready_read),
                        "starts": f"{starts:,}",
                        "share": percent(starts, found.starts),
                        "turns": EMPTY,
                    }
                )
        sections.append(
            {
                "found": found,
                "rows": rows,
                "ready_read": f"{found.ready_read:,}",
                "groups_seen": f"{found.groups_seen:,}",
                "starts": f"{found.starts:,}",
            }
        )
    return sections


def columns(window: str) -> tuple[str, ...]:
    return (
        *PENDING_COLUMNS,
        *(f"{JobStatus(status).label} ({window})" for status in inspection.OUTCOMES),
    )


@admin.register(Dashboard)
class DashboardAdmin(PageAdmin):
    template_name = "admin/django_jobs/dashboard.html"
    title = "Jobs dashboard"
    refresh_seconds = REFRESH_SECONDS

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        conf = JobsSettings.load()
        db = conf.database
        now = timezone.now()
        # The hour per minute for the chart; per queue for the table, over the hour or
        # (past QUEUE_ROWS_READ jobs) its latest minutes.
        recent = inspection.recent_outcomes(db, now)
        chart = bars(recent.per_minute)
        counted = inspection.count_queues(db)
        counted.finished = recent.per_queue
        window = outcome_window(recent)
        paused = sorted(Pause.objects.using(db).values_list("queue_name", flat=True))
        rows = {}
        for queue in sorted({*counted.pending, *counted.finished, *paused}):
            states = counted.pending.get(queue, {})
            done = counted.finished.get(queue, {})
            counts = [states.get(state, 0) for state in inspection.PENDING_STATES]
            counts += [done.get(status, 0) for status in inspection.OUTCOMES]
            if any(counts) or queue in paused:
                rows[queue] = counts
        width = len(PENDING_COLUMNS) + len(inspection.OUTCOMES)
        totals = [sum(column) for column in zip(*rows.values(), strict=True)] if rows else []
        return {
            "now": now,
            "columns": columns(window),
            "window": window,
            "window_cut": recent.queue_window_cut,
            "queue_rows_read": f"{inspection.QUEUE_ROWS_READ:,}",
            "queue_since": recent.queue_since,
            "queues": [
                {"name": queue, "counts": counts, "paused": queue in paused}
                for queue, counts in rows.items()
            ],
            "totals": totals or [0] * width,
            "chart": chart,
            "processes": process_rows(db, inspection.processes(db, now, conf)),
            "paused": paused,
            # Nothing read, and no section, when no queue is fair.
            "fair_queues": fair_sections(
                inspection.fair_groups(db, inspection.fair_queue_list(conf), now)
            ),
            "fair_ready_read": f"{inspection.FAIR_READY_READ:,}",
            "fair_starts_read": f"{inspection.FAIR_STARTS_READ:,}",
        }

    def get_urls(self):
        def wrap(view):
            return self.admin_site.admin_view(view)

        return [
            path("pause/", wrap(self.pause_view), name="django_jobs_dashboard_pause"),
            path("resume/", wrap(self.resume_view), name="django_jobs_dashboard_resume"),
            *super().get_urls(),
        ]

    def dashboard_url(self) -> str:
        return reverse(f"{self.admin_site.name}:django_jobs_dashboard_changelist")

    def queue_from(self, request: HttpRequest) -> str:
        self.check_can_act(request)
        return request.POST.get("queue", "").strip()

    def pause_view(self, request: HttpRequest) -> HttpResponse:
        queue = self.queue_from(request)
        if not queue or len(queue) > 128:
            messages.error(request, "Give the name of the queue to pause (at most 128 characters).")
        elif operations.pause_queue(JobsSettings.load().database, queue):
            messages.success(
                request,
                f"Queue “{queue}” paused: workers claim nothing more from it; "
                "jobs already running finish.",
            )
        else:
            messages.warning(request, f"Queue “{queue}” was already paused.")
        return HttpResponseRedirect(self.dashboard_url())

    def resume_view(self, request: HttpRequest) -> HttpResponse:
        queue = self.queue_from(request)
        if operations.resume_queue(JobsSettings.load().database, queue):
            messages.success(request, f"Queue “{queue}” resumed.")
        else:
            messages.warning(request, f"Queue “{queue}” was not paused.")
        return HttpResponseRedirect(self.dashboard_url())
