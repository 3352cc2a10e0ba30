"""Admin page timings with many jobs in the tables, against a stock ModelAdmin on the same rows.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/jobs_bench python bench/admin_pages.py

Plants ``--jobs`` jobs (default 100,000) once, in the mix a busy queue has, then
times each jobs admin page (median of ``--repeat`` requests after one warm-up)
and the same list pages served by a plain ``ModelAdmin`` with the filters people
usually write (full ``COUNT(*)``, ``SELECT DISTINCT`` filter choices). Figures
are printed, never asserted: the ratio column is the one to read on a noisy box.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
os.environ.setdefault("DATABASE_URL", "sqlite:////tmp/django-jobs-bench-admin.sqlite3")

import django  # noqa: E402

django.setup()

from django.contrib import admin  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.urls import path  # noqa: E402
from django.utils import timezone  # noqa: E402

from django_jobs.models import (  # noqa: E402
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)

MIX = [  # (status, share)
    (JobStatus.SUCCEEDED, 0.80),
    (JobStatus.FAILED, 0.05),
    (JobStatus.READY, 0.08),
    (JobStatus.SCHEDULED, 0.03),
    (JobStatus.BLOCKED, 0.02),
    (JobStatus.RUNNING, 0.02),
]
QUEUES = ["default", "emails", "reports"]
TASKS = [f"app.tasks.task_{n}" for n in range(10)]
KEYS = [f"app.tasks.task_0/account:{n}" for n in range(200)]
BATCH = 5_000


def plant(total: int) -> None:
    """Bulk-insert jobs and their execution rows, consistent with each job's status."""
    rng = random.Random(7)
    now = timezone.now()
    workers = [
        Process.objects.create(kind="worker", name=f"bench-{n}", hostname="bench", pid=90_000 + n)
        for n in range(4)
    ]
    Semaphore.objects.bulk_create([Semaphore(key=k, limit=1, value=0) for k in KEYS])
    statuses = [s for s, share in MIX for _ in range(round(share * total))][:total]
    rng.shuffle(statuses)
    for start in range(0, len(statuses), BATCH):
        jobs = [job_for(status, rng, now) for status in statuses[start : start + BATCH]]
        Job.objects.bulk_create(jobs)
        if connection.vendor == "mysql" or any(j.pk is None for j in jobs):
            jobs = list(Job.objects.order_by("-pk")[: len(jobs)])[::-1]
        plant_executions(jobs, workers, now)
    # Each key's one slot is held by a ready job, so its blocked jobs are waiting, not stuck.
    holders = Job.objects.bulk_create(
        Job(task_path=TASKS[0], queue_name="default", status="ready", concurrency_key=key)
        for key in KEYS
    )
    if any(j.pk is None for j in holders):
        holders = list(Job.objects.order_by("-pk")[: len(KEYS)])
    ReadyExecution.objects.bulk_create(
        ReadyExecution(job_id=j.pk, queue_name="default", concurrency_key=j.concurrency_key)
        for j in holders
    )


def job_for(status: str, rng: random.Random, now) -> Job:
    job = Job(
        task_path=rng.choice(TASKS),
        queue_name=rng.choice(QUEUES),
        args=[rng.randrange(10_000), "payload"],
        status=status,
        enqueued_at=now - timedelta(days=7 * rng.random()),
    )
    if status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        recent = rng.random() < 0.02
        job.finished_at = (
            now
            - timedelta(minutes=60 * rng.random() if recent else 0)
            - (timedelta() if recent else timedelta(days=7 * rng.random()))
        )
        job.attempts = 1
    if status == JobStatus.BLOCKED:
        job.concurrency_key, job.concurrency_limit = rng.choice(KEYS), 1
    return job


def plant_executions(jobs: list[Job], workers: list[Process], now) -> None:
    by_status: dict[str, list[Job]] = {}
    for job in jobs:
        by_status.setdefault(job.status, []).append(job)
    ReadyExecution.objects.bulk_create(
        ReadyExecution(job_id=j.pk, queue_name=j.queue_name) for j in by_status.get("ready", [])
    )
    ScheduledExecution.objects.bulk_create(
        ScheduledExecution(job_id=j.pk, queue_name=j.queue_name, scheduled_at=now + timedelta(1))
        for j in by_status.get("scheduled", [])
    )
    BlockedExecution.objects.bulk_create(
        BlockedExecution(job_id=j.pk, queue_name=j.queue_name, concurrency_key=j.concurrency_key)
        for j in by_status.get("blocked", [])
    )
    ClaimedExecution.objects.bulk_create(
        ClaimedExecution(job_id=j.pk, process=workers[j.pk % 4], queue_name=j.queue_name)
        for j in by_status.get("running", [])
    )
    FailedExecution.objects.bulk_create(
        FailedExecution(
            job_id=j.pk,
            attempt=1,
            exception_class_path="builtins.ValueError",
            message="boom",
            traceback="Traceback (most recent call last):\n  ...\nValueError: boom\n" * 5,
        )
        for j in by_status.get("failed", [])
    )


class StockJobAdmin(admin.ModelAdmin):
    """What a project writes without thinking about table size: the peer."""

    list_display = ("id", "task_path", "queue_name", "status", "attempts", "enqueued_at")
    list_filter = ("status", "queue_name", "task_path", "concurrency_key")
    search_fields = ("id",)
    list_per_page = 50
    change_list_template = "admin/change_list.html"  # not the app's, which links its pages


stock_site = admin.AdminSite(name="stock")
stock_site.register(Job, StockJobAdmin)
bench_urls = types.ModuleType("bench_urls")
bench_urls.urlpatterns = [path("admin/", admin.site.urls), path("stock/", stock_site.urls)]
sys.modules["bench_urls"] = bench_urls


def measure(client: Client, url: str, repeat: int) -> dict[str, float]:
    """Median wall time of ``repeat`` GETs after a warm-up, with the query count."""
    assert client.get(url).status_code == 200, url
    times, slowest, queries = [], 0.0, 0
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            began = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - began) * 1000)
        if response.status_code != 200:
            raise SystemExit(f"{url}: HTTP {response.status_code}")
        queries = len(captured)
        slowest = max([slowest, *(float(q["time"]) * 1000 for q in captured)])
    return {"ms": statistics.median(times), "queries": queries, "slowest_query_ms": slowest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="delete all jobs and plant again")
    options = parser.parse_args()
    call_command("migrate", verbosity=0)
    if options.fresh:
        for model in (ClaimedExecution, Process, Semaphore, Job):
            model.objects.all().delete()
    if Job.objects.count() < options.jobs:
        began = time.perf_counter()
        plant(options.jobs - Job.objects.count())
        print(f"planted in {time.perf_counter() - began:.1f}s")
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", "bench"
    )
    client = Client()
    client.force_login(user)
    failed_id = Job.objects.filter(status="failed").values_list("pk", flat=True).first()
    ours = {
        "dashboard": "/admin/django_jobs/dashboard/",
        "job list": "/admin/django_jobs/job/",
        "job list, failed": "/admin/django_jobs/job/?status__exact=failed",
        "job list, failed 24h": "/admin/django_jobs/job/?status__exact=failed&finished_since=24h",
        "job list, queue": "/admin/django_jobs/job/?queue_name=emails",
        "job list, page 50": "/admin/django_jobs/job/?p=50",
        "job page": f"/admin/django_jobs/job/{failed_id}/change/",
        "blocked keys": "/admin/django_jobs/blockedkey/",
        "stuck jobs": "/admin/django_jobs/stuckjob/",
        "processes": "/admin/django_jobs/process/",
    }
    stock = {
        "job list": "/stock/django_jobs/job/",
        "job list, failed": "/stock/django_jobs/job/?status__exact=failed",
        "job list, queue": "/stock/django_jobs/job/?queue_name__exact=emails",
        "job list, page 50": "/stock/django_jobs/job/?p=50",
    }
    with override_settings(ROOT_URLCONF="bench_urls"):
        ours_figures = {name: measure(client, url, options.repeat) for name, url in ours.items()}
        stock_figures = {name: measure(client, url, options.repeat) for name, url in stock.items()}
    counts = dict(Job.objects.values_list("status").annotate(n=django.db.models.Count("pk")))
    print(f"database: {connection.vendor}; jobs: {sum(counts.values()):,} {counts}")
    print(f"{'page':<24}{'ms':>9}{'queries':>9}{'slowest q ms':>14}{'stock ms':>10}{'ratio':>8}")
    for name, figures in ours_figures.items():
        peer = stock_figures.get(name)
        line = (
            f"{name:<24}{figures['ms']:>9.1f}{figures['queries']:>9}"
            f"{figures['slowest_query_ms']:>14.1f}"
        )
        if peer:
            line += f"{peer['ms']:>10.1f}{figures['ms'] / peer['ms']:>7.2f}x"
        print(line)


if __name__ == "__main__":
    main()
