"""What one metrics scrape costs over a large job table: its queries, each one's time, the total.

    python bench/metrics_scrape.py [--jobs 100000] [--recent 0] [--repeat 20] [--fresh]

Run from the repository root with the ``prometheus`` extra installed. ``DATABASE_URL``
picks the database, as for bench/admin_pages.py, whose planted mix this reuses (most jobs
finished over a week, a backlog of ready, scheduled and blocked jobs on ~200 keys, a few
running); ``--recent N`` adds N succeeded jobs finished over the last hour (a busy hour:
360,000 is 100 jobs a second), of which the last-minute query reads its minute's share. Times
the collector as the endpoint runs it (queries and exposition, no HTTP), ``--repeat``
times after one warm-up, and prints the median per query. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import admin_pages as planted
from django.db import connection, transaction
from django.utils import timezone
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from django_jobs.metrics.collector import JobsCollector
from django_jobs.models import Job, JobStatus


class PerQuery:
    """An execute wrapper timing each query of a scrape, in order."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.times.append((sql, (time.perf_counter() - began) * 1000))


def plant_recent(total: int, start: float, end: float, seed: int = 11) -> None:
    """``total`` succeeded jobs whose finished_at spreads between ``start`` and ``end``
    seconds ago (from when each chunk is written)."""
    rng = random.Random(seed)
    for offset in range(0, total, planted.BATCH):
        now = timezone.now()
        jobs = []
        for _ in range(min(planted.BATCH, total - offset)):
            finished = now - timedelta(seconds=rng.uniform(end, start))
            jobs.append(
                Job(
                    task_path=rng.choice(planted.TASKS[:-1]),
                    queue_name=rng.choice(planted.QUEUES),
                    status=JobStatus.SUCCEEDED,
                    enqueued_at=finished - timedelta(seconds=2),
                    started_at=finished - timedelta(seconds=1),
                    last_attempted_at=finished - timedelta(seconds=1),
                    finished_at=finished,
                    attempts=1,
                    args=[1],
                    return_value={"ok": True},
                )
            )
        with transaction.atomic():
            Job.objects.bulk_create(jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs to plant (100,000)")
    parser.add_argument("--recent", type=int, default=0, help="extra jobs finished in the hour")
    parser.add_argument("--repeat", type=int, default=20, help="timed scrapes (20)")
    parser.add_argument("--fresh", action="store_true", help="delete every django_jobs row first")
    args = parser.parse_args()

    planted.ensure_jobs(args.jobs, args.fresh)
    if args.recent:
        # The hour but its last two minutes first (slow to write), then the last two minutes
        # just before timing, so the last minute holds its share when the scrapes run.
        last = args.recent * 120 // 3600
        print(f"planting {args.recent:,} jobs finished in the last hour ...", flush=True)
        plant_recent(args.recent - last, 3600, 120)
        planted.analyze()
        plant_recent(last, 120, 0)
    planted.print_header(args.jobs, args.repeat)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobsCollector())
    generate_latest(registry)  # warm-up
    totals: list[float] = []
    per_query: dict[int, list[float]] = defaultdict(list)
    sqls: dict[int, str] = {}
    for _ in range(args.repeat):
        clock = PerQuery()
        with connection.execute_wrapper(clock):
            began = time.perf_counter()
            body = generate_latest(registry)
            totals.append((time.perf_counter() - began) * 1000)
        for index, (sql, ms) in enumerate(clock.times):
            per_query[index].append(ms)
            sqls[index] = sql
    print(
        f"\nscrape: {len(sqls)} queries, median {statistics.median(totals):.1f} ms "
        f"(fastest {min(totals):.1f} ms), {len(body):,} bytes, "
        f"{sum(1 for line in body.splitlines() if not line.startswith(b'#'))} samples"
    )
    print(f"\n{'median ms':>10}  query")
    for index in sorted(sqls):
        sql = sqls[index]
        print(f"{statistics.median(per_query[index]):>10.2f}  {sql[:150]}")


if __name__ == "__main__":
    main()
