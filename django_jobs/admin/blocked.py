"""Blocked jobs grouped by concurrency key: who holds the slots, who waits, and repair."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone

from django_jobs.admin.base import REFRESH_SECONDS, PageAdmin
from django_jobs.conf import JobsSettings
from django_jobs.core import operator as operations
from django_jobs.models import BlockedExecution, BlockedKey, Process
from django_jobs.observability import inspection

KEYS_PER_PAGE = 25
WAITING_SHOWN = 10


@admin.register(BlockedKey)
class BlockedKeyAdmin(PageAdmin):
    template_name = "admin/django_jobs/blocked.html"
    title = "Blocked jobs by concurrency key"
    refresh_seconds = REFRESH_SECONDS

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        db = JobsSettings.load().database
        now = timezone.now()
        keys = (
            BlockedExecution.objects.using(db)
            .values_list("concurrency_key", flat=True)
            .distinct()
            .order_by("concurrency_key")
        )
        page = Paginator(keys, KEYS_PER_PAGE).get_page(request.GET.get("p"))
        groups = inspection.blocked_keys(db, now, keys=list(page.object_list))
        holders = {key.key: inspection.key_holders(db, key.key) for key in groups}
        process_ids = {h.process_id for hs in holders.values() for h in hs if h.process_id}
        found = Process.objects.using(db).filter(pk__in=process_ids).values_list("pk", "name")
        names: dict[int | None, str] = dict(found)
        for hs in holders.values():
            for holder in hs:
                holder.process_name = names.get(holder.process_id, "")
        return {
            "now": now,
            "page": page,
            "groups": [
                {
                    "key": key,
                    "holders": holders[key.key],
                    "waiting": list(
                        BlockedExecution.objects.using(db)
                        .filter(concurrency_key=key.key)
                        .order_by("-priority", "job_id")
                        .values_list("job_id", flat=True)[:WAITING_SHOWN]
                    ),
                    "oldest_age": now - key.oldest_blocked_at if key.oldest_blocked_at else None,
                }
                for key in groups
            ],
        }

    def get_urls(self):
        return [
            path(
                "reconcile/",
                self.admin_site.admin_view(self.reconcile_view),
                name="django_jobs_blockedkey_reconcile",
            ),
            *super().get_urls(),
        ]

    def reconcile_view(self, request: HttpRequest) -> HttpResponse:
        self.check_can_act(request)
        key = request.POST.get("key", "")
        promoted = operations.reconcile(JobsSettings.load().database, key)
        messages.success(
            request,
            f"Key “{key}” reconciled: holders recounted, "
            f"{promoted} blocked job{'' if promoted == 1 else 's'} promoted to ready.",
        )
        return HttpResponseRedirect(
            reverse(f"{self.admin_site.name}:django_jobs_blockedkey_changelist")
        )
