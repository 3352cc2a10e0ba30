"""What the fair queues' inspection costs with 100,000 tenants against 10, the same backlog, same
database, same run (issue 38, item 6: "100,000 keys cost no more than 10").

    python bench/fair_inspection.py           # PostgreSQL, database jobs_fair_inspection
    DATABASE_URL=mysql://root@127.0.0.1:3306/jobs_fair_inspection python bench/fair_inspection.py
    python bench/fair_inspection.py --ready 1000000           # a larger backlog on both sides

``observability.inspection.fair_groups`` is what the dashboard's fair section, ``manage.py
jobs`` and the metrics scrape read (docs/fairness.md, "Seeing it"). Each side is planted
through ``bulk_enqueue`` (the real enqueue path, stamps and all) of ``bench/fair_tasks.py``'s
``fair_noop`` over its tenants, round robin: ``--ready`` jobs over ``--small-keys`` tenants,
then the same over ``--keys``. A tenth of each side's jobs are then marked finished in the last
minute (half succeeded, half failed) and their ready rows deleted, so that the recent starts
have rows to read; then the tables are analysed (not on SQLite). The read is timed
``--repeat`` times (median and p95 printed), with its query count. The ratio of the two
medians is the figure: the reads are bounded by ``LIMIT``s (the ready rows sampled, the
starts read, the groups shown), not by the keys, so it should stay near 1; the cost of a
read is that of its sample (``FAIR_READY_READ`` rows and their jobs), reached by any backlog
that large. Figures are printed, never asserted. The database's name must contain
"fair_inspection": its django_jobs tables are emptied first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/jobs_fair_inspection")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models import F  # noqa: E402
from django.tasks import default_task_backend  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.fair_tasks import FAIR_QUEUE, fair_noop  # noqa: E402
from bench.tables import analyze, empty, refuse_unless_named, tables_of  # noqa: E402
from django_jobs.models import Job, JobStatus, ReadyExecution  # noqa: E402
from django_jobs.observability.inspection import fair_groups  # noqa: E402

CHUNK = 20_000  # calls per bulk_enqueue while planting


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="tenants of the many side")
    parser.add_argument("--small-keys", type=int, default=10, help="tenants of the few side")
    parser.add_argument("--ready", type=int, default=200_000, help="jobs of each side")
    parser.add_argument("--repeat", type=int, default=30, help="timed reads per side")
    return parser.parse_args()


def plant(keys: int, jobs: int) -> float:
    """``jobs`` fair jobs over ``keys`` tenants; a tenth of them finished a moment ago. The
    seconds it took."""
    empty(tables_of("django_jobs"))
    began = time.perf_counter()
    for start in range(0, jobs, CHUNK):
        calls = [
            (fair_noop, (f"tenant-{n % keys:06d}",), {})
            for n in range(start, min(jobs, start + CHUNK))
        ]
        default_task_backend.bulk_enqueue(calls)
    now = timezone.now()
    finished = Job.objects.annotate(tenth=F("id") % 10).filter(tenth=0)
    ids = list(finished.values_list("id", flat=True))
    for status, part in ((JobStatus.SUCCEEDED, ids[0::2]), (JobStatus.FAILED, ids[1::2])):
        for start in range(0, len(part), CHUNK):
            chunk = part[start : start + CHUNK]
            Job.objects.filter(pk__in=chunk).update(
                status=status,
                last_attempted_at=now - timedelta(seconds=30),
                finished_at=now - timedelta(seconds=10),
                attempts=1,
            )
            ReadyExecution.objects.filter(job_id__in=chunk).delete()
    analyze(tables_of("django_jobs"))
    return time.perf_counter() - began


def timed_reads(repeat: int) -> tuple[list[float], int, int]:
    """``repeat`` reads' times (ms), the queries of one, and the groups it showed."""
    fair_groups("default", [FAIR_QUEUE], timezone.now())  # connection and caches warm
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fair_groups("default", [FAIR_QUEUE], timezone.now())
        times.append((time.perf_counter() - began) * 1000)
    with CaptureQueriesContext(connection) as queries:
        (queue,) = fair_groups("default", [FAIR_QUEUE], timezone.now())
    return times, len(queries), len(queue.groups)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> int:
    options = parse_args()
    refuse_unless_named("fair_inspection")
    call_command("migrate", verbosity=0)
    print(f"database: {connection.vendor}, {connection.settings_dict['NAME']}")
    sides = {
        "few keys": (options.small_keys, options.ready),
        "many keys": (options.keys, options.ready),
    }
    medians = {}
    for side, (keys, jobs) in sides.items():
        took = plant(keys, jobs)
        ready = ReadyExecution.objects.count()
        times, queries, groups = timed_reads(options.repeat)
        medians[side] = statistics.median(times)
        print(
            f"{side}: {keys:,} tenants, {jobs:,} jobs ({ready:,} ready) planted in {took:.1f} s; "
            f"fair_groups median {medians[side]:.2f} ms, p95 {p95(times):.2f} ms, "
            f"{queries} queries, {groups} groups shown"
        )
    print(f"many keys / few keys: {medians['many keys'] / medians['few keys']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
