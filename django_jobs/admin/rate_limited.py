"""Rate-limited keys: how many starts the current window holds, when the next one
opens, and which jobs wait for it."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import HttpRequest
from django.utils import timezone

from ..conf import JobsSettings
from ..limits import bounded_seconds, is_number, later
from ..models import Job, JobStatus, RateLimit, RateLimitedKey
from .base import REFRESH_SECONDS, PageAdmin

KEYS_PER_PAGE = 25
EPOCH = datetime.fromtimestamp(0, tz=UTC)
WAITING_SHOWN = 10


def key_state(row: RateLimit, now: datetime) -> dict[str, Any]:
    """The window as of ``now``: its starts, and when the next start may be taken.

    Read from the row as data that may be anything (a hand-edited period of 1e300, a
    start that is no number): the page shows what it can, bounded, and never raises.
    """
    clock = now.timestamp()
    period = bounded_seconds(row.period)
    limit = row.limit if isinstance(row.limit, int) and row.limit > 0 else 1
    recent = sorted(t for t in timestamps(row.starts) if t > clock - period)
    opening = now
    if len(recent) >= limit:
        opening = later(EPOCH, recent[len(recent) - limit] + period)
    planned = max(timestamps(row.planned), default=0.0)
    return {
        "row": row,
        "rate": f"{limit} per {timedelta(seconds=period)}",
        "in_window": len(recent),
        "full": len(recent) >= limit,
        "next_opening": opening,
        "planned_until": later(EPOCH, planned) if planned > clock else None,
    }


def timestamps(values: Any) -> list[float]:
    """The finite numbers of a row's JSON list of times; whatever else it holds, skipped."""
    if not isinstance(values, list):
        return []
    return [float(v) for v in values if is_number(v) and math.isfinite(v) and abs(v) < 1e12]


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
