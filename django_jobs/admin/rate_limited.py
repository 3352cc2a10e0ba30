"""Rate-limited keys: how many starts the current window holds, when the next one
opens, and which jobs wait for it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import HttpRequest
from django.utils import timezone

from django_jobs.admin.base import REFRESH_SECONDS, PageAdmin
from django_jobs.conf import JobsSettings
from django_jobs.core.rate_limits import times, usable_rate
from django_jobs.limits import MAX_SECONDS, later
from django_jobs.models import Job, JobStatus, RateLimit, RateLimitedKey
from django_jobs.tasks.rates import Rate

KEYS_PER_PAGE = 25
EPOCH = datetime.fromtimestamp(0, tz=UTC)
WAITING_SHOWN = 10


def key_state(row: RateLimit, now: datetime) -> dict[str, Any]:
    """The window as of ``now``: its starts, and when the next start may be taken.

    Read from the row as the starts read it (``rate_limits``: its rate made usable,
    only finite times, none past a century ahead), whatever a hand-edited row holds:
    the page shows what it can, bounded, and never raises.
    """
    clock = now.timestamp()
    rate = usable_rate(Rate(row.limit, row.period))
    horizon = clock + MAX_SECONDS
    recent = sorted(t for t in times(row.starts) if clock - rate.period < t <= horizon)
    opening = now
    if len(recent) >= rate.limit:
        opening = later(EPOCH, recent[len(recent) - rate.limit] + rate.period)
    planned = max((t for t in times(row.planned) if t <= horizon), default=0.0)
    return {
        "row": row,
        "rate": f"{rate.limit} per {timedelta(seconds=rate.period)}",
        "in_window": len(recent),
        "full": len(recent) >= rate.limit,
        "next_opening": opening,
        "planned_until": later(EPOCH, planned) if planned > clock else None,
    }


@admin.register(RateLimitedKey)
class RateLimitedKeyAdmin(PageAdmin):
    template_name = "admin/django_jobs/rate_limited.html"
    title = "Rate-limited keys"
    refresh_seconds = REFRESH_SECONDS

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        db = JobsSettings.load().database
        now = timezone.now()
        rows = RateLimit.objects.using(db).order_by("-updated_at", "key")
        page = Paginator(rows, KEYS_PER_PAGE).get_page(request.GET.get("p"))
        keys = [row.key for row in page.object_list]
        # Through the scheduled rows (few) to their jobs: Job.rate_key has no index.
        waiting_jobs = Job.objects.using(db).filter(
            scheduled_execution__isnull=False,
            status=JobStatus.SCHEDULED,
            rate_key__in=keys,
            rate_reserved_at__isnull=False,
        )
        counts = dict(
            waiting_jobs.values_list("rate_key")
            .annotate(n=Count("pk"))
            .values_list("rate_key", "n")
        )
        groups = []
        for row in page.object_list:
            state = key_state(row, now)
            state["waiting"] = counts.get(row.key, 0)
            state["next_jobs"] = list(
                waiting_jobs.filter(rate_key=row.key)
                .order_by("rate_reserved_at", "pk")
                .values("pk", "rate_reserved_at")[:WAITING_SHOWN]
                if state["waiting"]
                else []
            )
            groups.append(state)
        return {"now": now, "page": page, "groups": groups}
