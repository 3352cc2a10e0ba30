"""The dashboard's per-minute chart, drawn as inline SVG on the server: no script, no CDN."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.utils.dateformat import format as format_date

from django_jobs.admin.base import local_time

WIDTH, HEIGHT, BAR_GAP = 600, 120, 1


@dataclass
class Bar:
    x: float
    width: float
    succeeded_y: float
    succeeded_height: float
    failed_y: float
    failed_height: float
    title: str


def bars(per_minute: list[dict[str, Any]]) -> dict[str, Any]:
    """Stacked bars (failed on top of succeeded) scaled to the busiest minute."""
    peak = max((m["succeeded"] + m["failed"] for m in per_minute), default=0)
    scale = (HEIGHT - 4) / peak if peak else 0.0
    slot = WIDTH / max(1, len(per_minute))
    drawn = []
    for i, minute in enumerate(per_minute):
        ok_h = minute["succeeded"] * scale
        failed_h = minute["failed"] * scale
        drawn.append(
            Bar(
                x=round(i * slot, 2),
                width=round(max(1.0, slot - BAR_GAP), 2),
                succeeded_y=round(HEIGHT - ok_h, 2),
                succeeded_height=round(ok_h, 2),
                failed_y=round(HEIGHT - ok_h - failed_h, 2),
                failed_height=round(failed_h, 2),
                title=(
                    f"{format_date(local_time(minute['minute']), 'H:i')}: "
                    f"{minute['succeeded']} succeeded, {minute['failed']} failed"
                ),
            )
        )
    return {
        "bars": drawn,
        "width": WIDTH,
        "height": HEIGHT,
        "peak": peak,
        "succeeded": sum(m["succeeded"] for m in per_minute),
        "failed": sum(m["failed"] for m in per_minute),
        "start": per_minute[0]["minute"] if per_minute else None,
    }
