"""The async step's figures, read from the fetch jobs' own rows (``manage.py demo``).

What the tour claims of its fan-out (200 fetches that each wait a second end in about a
second or two, on one event loop) is shown from what the jobs recorded, not from the
demo's own clock: the span from the first ``started_at`` to the last ``finished_at``,
and the most that were running at once by those same times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django_jobs.models import FINISHED_STATUSES, Job, JobStatus


@dataclass(frozen=True)
class FanOut:
    """Where a group of jobs stands: counts by status, and the times of those that ran."""

    total: int
    by_status: Counter[str]
    first_start: datetime | None
    last_end: datetime | None
    peak: int

    @property
    def ended(self) -> int:
        return sum(n for status, n in self.by_status.items() if status in FINISHED_STATUSES)

    @property
    def succeeded(self) -> int:
        return self.by_status[JobStatus.SUCCEEDED]

    @property
    def span(self) -> float | None:
        """Seconds from the first start to the last end, once every job has ended."""
        if self.ended < self.total or self.first_start is None or self.last_end is None:
            return None
        return (self.last_end - self.first_start).total_seconds()


def fan_out(job_ids: Iterable[int]) -> FanOut:
    ids = list(job_ids)
    rows = list(Job.objects.filter(pk__in=ids).values_list("status", "started_at", "finished_at"))
    runs = [(started, finished) for _, started, finished in rows if started and finished]
    return FanOut(
        total=len(ids),
        by_status=Counter(status for status, _, _ in rows),
        first_start=min((started for started, _ in runs), default=None),
        last_end=max((finished for _, finished in runs), default=None),
        peak=most_at_once(runs),
    )


def most_at_once(runs: Sequence[tuple[datetime, datetime]]) -> int:
    """The most intervals that overlap at one instant; one that ends as another starts
    does not overlap it (ends are counted first)."""
    edges = sorted([(started, 1) for started, _ in runs] + [(finished, -1) for _, finished in runs])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak
