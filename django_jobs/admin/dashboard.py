"""The dashboard: queues and their states, throughput, processes, pause and resume."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone

from .. import inspection, operations
from ..conf import JobsSettings
from ..models import Dashboard, Pause
from .base import PageAdmin
from .chart import bars


@admin.register(Dashboard)
class DashboardAdmin(PageAdmin):
    template_name = "admin/django_jobs/dashboard.html"
    title = "Jobs dashboard"

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        conf = JobsSettings.load()
        db = conf.database
        now = timezone.now()
        counts = inspection.queue_counts(db, now)
        paused = sorted(Pause.objects.using(db).values_list("queue_name", flat=True))
        for queue in paused:
            counts.setdefault(queue, dict.fromkeys(inspection.STATES, 0))
        totals = dict.fromkeys(inspection.STATES, 0)
        for row in counts.values():
            for state, n in row.items():
                totals[state] += n
        return {
            "now": now,
            "states": inspection.STATES,
            "queues": [
                {
                    "name": queue,
                    "counts": [counts[queue][state] for state in inspection.STATES],
                    "paused": queue in paused,
                }
                for queue in sorted(counts)
            ],
            "totals": [totals[s] for s in inspection.STATES],
            "chart": bars(inspection.finished_per_minute(db, now)),
            "processes": inspection.processes(db, now, conf),
            "paused": paused,
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
        if request.method != "POST" or not self.has_change_permission(request):
            raise PermissionDenied
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
