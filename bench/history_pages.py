"""Something for every admin page to show on a big history, and each page's time over it.

    python bench/history_pages.py [--repeat 3] [--replant] [--slow-ms 50]

Run from the repository root after ``bench/history.py --keep`` built its history;
``DATABASE_URL`` names that database (its name must contain "jobs_history").

:func:`plant` adds, once (``--replant``: again, after removing what it added before),
what the pages other than the job list need to show something: batches (finished and
open), a workflow of ``BIG_WORKFLOW`` jobs (drawn) and a few small ones, blocked jobs on
``KEYS`` keys, a rate-limited key with jobs waiting for its window, a live worker, a
dispatcher and a dead worker holding a claim, a job scheduled long past due. Jobs go
through the public enqueue API; the states no API reaches without a worker (finished
batches, a claim by a dead process, a full rate window) are written directly, marked by
``MARK`` so that a replant finds them. ``bench/history.py`` may call :func:`plant` as a
phase of its own later.

Then every page is timed through Django's test client as bench/admin_pages.py does (the
median of ``--repeat`` rounds after a warm-up, its query count and slowest statement),
with ``manage.py jobs --json`` and the metrics scrape in this process. Figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from bench import admin_pages  # sets Django up (before the models below); its URLconf too
from django_jobs import enqueue_batch, workflow
from django_jobs.models import (
    Batch,
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    Process,
    RateLimit,
    ReadyExecution,
    ScheduledExecution,
    Workflow,
)
from testproject.demo.tasks import add, sync_account

MARK = "history-pages"
SAFE_NAME_PART = "jobs_history"
FINISHED_BATCHES = 60
BATCH_ITEMS = 20
OPEN_BATCH_ITEMS = 1_000
BIG_WORKFLOW = 300  # admin/graph.py draws up to 300 jobs
SMALL_WORKFLOWS = 60
KEYS = 5
BLOCKED_PER_KEY = 30
RATE_WAITING = 20
# Jobs a 30,000,000-job history kept 14 days finishes per hour (--recent-hour's default):
# what the dashboard's chart and the last hour's counts read at that size.
HOUR_AT_30M = 30_000_000 // (14 * 24)
QUEUES = ("default", "emails", "reports", "reports-daily", "slow")


def planted() -> bool:
    return Workflow.objects.filter(name=f"{MARK} big").exists()


def unplant() -> None:
    """What an earlier :func:`plant` added: the history's jobs are of ``shop.tasks.*``."""
    Job.objects.filter(task_path__in=[add.module_path, sync_account.module_path]).delete()
    Batch.objects.filter(description__startswith=MARK).delete()
    Workflow.objects.filter(name__startswith=MARK).delete()
    Process.objects.filter(name__startswith=MARK).delete()
    RateLimit.objects.filter(key__startswith=MARK).delete()


def finish(jobs, status: str = JobStatus.SUCCEEDED) -> None:
    """Mark ``jobs`` (ready ones) finished now, as a worker would leave them."""
    now = timezone.now()
    ids = list(jobs.values_list("pk", flat=True))
    ReadyExecution.objects.filter(job_id__in=ids).delete()
    Job.objects.filter(pk__in=ids).update(
        status=status, finished_at=now, last_attempted_at=now - timedelta(seconds=1), attempts=1
    )


def plant() -> None:
    now = timezone.now()
    with transaction.atomic():
        for n in range(FINISHED_BATCHES):
            result = enqueue_batch(
                [(add, (1, 2), {})] * BATCH_ITEMS, description=f"{MARK} finished {n}"
            )
            finish(Job.objects.filter(batch_id=result.id))
            Batch.objects.filter(pk=result.id).update(
                pending=0, succeeded=BATCH_ITEMS, finished_at=now
            )
        enqueue_batch([(add, (1, 2), {})] * OPEN_BATCH_ITEMS, description=f"{MARK} open")
    for n in range(SMALL_WORKFLOWS):
        with workflow(f"{MARK} small {n}") as wf:
            first = wf.add(add, 1, 2)
            wf.add(add, 1, 2, after=[first])
    with workflow(f"{MARK} big") as wf:
        root = wf.add(add, 1, 2)
        middle = [wf.add(add, 1, 2, after=[root]) for _ in range(BIG_WORKFLOW - 2)]
        wf.add(add, 1, 2, after=middle)
    big = Workflow.objects.get(name=f"{MARK} big")
    finish(Job.objects.filter(workflow=big, status=JobStatus.READY))
    for key in range(KEYS):
        for _ in range(BLOCKED_PER_KEY + 1):
            sync_account.enqueue(account_id=10_000_000 + key)
    plant_rate_limit(now)
    plant_processes(now)


def plant_recent_hour(total: int, chunk: int = 10_000) -> None:
    """``total`` jobs finished over the last hour (every 10th failed), bulk inserted."""
    now = timezone.now()
    for start in range(0, total, chunk):
        rows = []
        for n in range(start, min(total, start + chunk)):
            finished = now - timedelta(seconds=3600 * (n + 0.5) / total)
            rows.append(
                Job(
                    backend="default",
                    task_path=add.module_path,
                    queue_name=QUEUES[n % len(QUEUES)],
                    args=[1, 2],
                    kwargs={},
                    status=JobStatus.FAILED if n % 10 == 0 else JobStatus.SUCCEEDED,
                    attempts=1,
                    max_attempts=1,
                    enqueued_at=finished - timedelta(seconds=2),
                    last_attempted_at=finished - timedelta(seconds=1),
                    finished_at=finished,
                )
            )
        Job.objects.bulk_create(rows)


def plant_big(size: int, chunk: int = 10_000) -> None:
    """A finished workflow and a finished batch of ``size`` jobs each (bulk inserted: no
    edges), the largest a page may meet (docs/workflows.md, docs/batches.md)."""
    now = timezone.now()
    big_workflow = Workflow.objects.create(name=f"{MARK} huge")
    big_batch = Batch.objects.create(
        description=f"{MARK} huge", total=size, succeeded=size, finished_at=now
    )
    for owner in ({"workflow": big_workflow}, {"batch": big_batch}):
        for start in range(0, size, chunk):
            Job.objects.bulk_create(
                Job(
                    backend="default",
                    task_path=add.module_path,
                    queue_name="default",
                    args=[1, 2],
                    kwargs={},
                    status=JobStatus.SUCCEEDED,
                    attempts=1,
                    max_attempts=1,
                    last_attempted_at=now - timedelta(seconds=1),
                    finished_at=now - timedelta(hours=2),
                    **owner,
                )
                for _ in range(start, min(size, start + chunk))
            )


def plant_rate_limit(now) -> None:
    """A key whose window is full and ``RATE_WAITING`` jobs waiting for their turn."""
    key = f"{MARK}:rated"
    clock = now.timestamp()
    RateLimit.objects.create(
        key=key, limit=2, period=60.0, starts=[clock - 10, clock - 5], planned=[clock + 60]
    )
    for n in range(RATE_WAITING):
        result = add.using(run_after=now + timedelta(minutes=1 + n)).enqueue(1, 2)
        Job.objects.filter(pk=int(result.id)).update(
            rate_key=key, rate_reserved_at=now + timedelta(minutes=1 + n)
        )
    # Scheduled an hour ago and never promoted: "scheduled, long past due" on the stuck page.
    late = add.using(queue_name="slow", run_after=now + timedelta(hours=1)).enqueue(1, 2)
    ScheduledExecution.objects.filter(job_id=int(late.id)).update(
        scheduled_at=now - timedelta(hours=1)
    )


def plant_processes(now) -> None:
    """A live worker and dispatcher, and a dead worker still holding a running job."""
    common = {"hostname": "bench-host", "pid": 4242}
    Process.objects.create(
        kind=Process.Kind.WORKER,
        name=f"{MARK}-live-worker",
        metadata={"queues": ["default"], "threads": 4},
        **common,
    )
    Process.objects.create(kind=Process.Kind.DISPATCHER, name=f"{MARK}-dispatcher", **common)
    dead = Process.objects.create(
        kind=Process.Kind.WORKER,
        name=f"{MARK}-dead-worker",
        metadata={"queues": ["emails"], "threads": 1},
        last_heartbeat_at=now - timedelta(hours=1),
        **common,
    )
    held = add.using(queue_name="emails").enqueue(1, 2)
    ReadyExecution.objects.filter(job_id=int(held.id)).delete()
    Job.objects.filter(pk=int(held.id)).update(
        status=JobStatus.RUNNING, last_attempted_at=now - timedelta(hours=1), attempts=1
    )
    ClaimedExecution.objects.create(
        job_id=int(held.id), process=dead, queue_name="emails", created_at=now
    )


def pages() -> list[tuple[str, str]]:
    base = "/admin/django_jobs"
    big = Workflow.objects.get(name=f"{MARK} big").pk
    huge_workflow = Workflow.objects.get(name=f"{MARK} huge").pk
    huge_batch = Batch.objects.get(description=f"{MARK} huge").pk
    open_batch = Batch.objects.get(description=f"{MARK} open").pk
    finished_batch = Batch.objects.filter(description__startswith=f"{MARK} finished").first()
    keyed = BlockedExecution.objects.values_list("job_id", flat=True).first()
    return [
        ("dashboard", f"{base}/dashboard/"),
        ("stuck", f"{base}/stuckjob/"),
        ("blocked", f"{base}/blockedkey/"),
        ("rate-limited", f"{base}/ratelimitedkey/"),
        ("batch list", f"{base}/batch/"),
        ("batch list, unfinished", f"{base}/batch/?finished=no"),
        ("open batch", f"{base}/batch/{open_batch}/change/"),
        ("finished batch", f"{base}/batch/{finished_batch.pk}/change/"),
        ("workflow list", f"{base}/workflow/"),
        ("workflow list, running", f"{base}/workflow/?status=running"),
        ("workflow list, failed", f"{base}/workflow/?status=failed"),
        ("big workflow", f"{base}/workflow/{big}/change/"),
        ("huge workflow", f"{base}/workflow/{huge_workflow}/change/"),
        ("huge batch", f"{base}/batch/{huge_batch}/change/"),
        ("process list", f"{base}/process/"),
        ("recurring", f"{base}/recurringtask/"),
        ("blocked job page", f"{base}/job/{keyed}/change/"),
    ]


def time_call(name: str, call, repeat: int, slow_ms: float) -> None:
    """A warm-up, then ``repeat`` timed calls of ``call`` in this process."""
    call()
    times: list[float] = []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1000)
    print_row(name, statistics.median(times), captured.captured_queries, slow_ms)


def print_row(name: str, ms: float, queries: list[dict], slow_ms: float) -> None:
    slowest = max(queries, key=lambda q: float(q["time"]), default={"time": 0, "sql": ""})
    slowest_ms = float(slowest["time"]) * 1000
    print(f"{name:28} {ms:9.1f} ms {len(queries):4d} queries  slowest {slowest_ms:7.1f} ms")
    for query in queries:
        if float(query["time"]) * 1000 >= slow_ms:
            print(f"    {float(query['time']) * 1000:7.1f} ms  {query['sql'][:600]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--replant", action="store_true")
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument(
        "--recent-hour",
        type=int,
        default=HOUR_AT_30M,
        help=f"jobs finished in the last hour, planted ({HOUR_AT_30M:,}: a 30M history's rate)",
    )
    parser.add_argument(
        "--big", type=int, default=100_000, help="jobs of the huge workflow and batch (100,000)"
    )
    options = parser.parse_args()
    name = str(connection.settings_dict["NAME"])
    if SAFE_NAME_PART not in name:
        raise SystemExit(f"refusing database {name!r}: its name must contain {SAFE_NAME_PART!r}")
    if options.replant and planted():
        unplant()
    if not planted():
        began = time.perf_counter()
        plant()
        plant_recent_hour(options.recent_hour)
        plant_big(options.big)
        print(f"planted in {time.perf_counter() - began:.1f} s")
    last = Job.objects.order_by("-pk").values_list("pk", flat=True)[0]
    print(f"{connection.vendor}, {last:,} job ids")
    client = admin_pages.logged_in_client()
    with override_settings(ROOT_URLCONF="bench_urls"):
        for page, url in pages():

            def get(url=url):
                response = client.get(url)
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {response.status_code}")
                return response

            time_call(page, get, options.repeat, options.slow_ms)

    def jobs_json() -> None:
        call_command("jobs", "--json", stdout=io.StringIO())

    time_call("manage.py jobs --json", jobs_json, options.repeat, options.slow_ms)
    try:
        from prometheus_client import generate_latest
        from prometheus_client.registry import CollectorRegistry

        from django_jobs.metrics.collector import JobsCollector
    except ImportError as exc:
        print(f"metrics scrape: skipped ({exc})")
        return 0
    registry = CollectorRegistry()
    registry.register(JobsCollector())
    time_call("metrics scrape", lambda: generate_latest(registry), options.repeat, options.slow_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
