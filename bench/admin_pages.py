"""Admin page timings over a large job table, against a stock ModelAdmin on the same rows.

    python bench/admin_pages.py [--jobs 100000] [--repeat 5] [--fresh] [--slow-ms 100]

Run from the repository root. ``DATABASE_URL`` picks the database (default: a
SQLite file in /tmp), e.g. ``postgres://postgres@127.0.0.1:5432/jobs_bench``.

Plants ``--jobs`` jobs once, in the mix of a busy queue (most finished, a
backlog waiting, some blocked on concurrency keys, a few running), and workflows
beside them (fan-out/fan-in graphs, one per 1,000 jobs, and one of 250 jobs whose
page is timed: drawn, near the graph's cap of 300), then times each jobs admin
page: the median of ``--repeat`` requests after one warm-up, with its SQL query
count and slowest query. The peer is a stock ``ModelAdmin`` over the same
``Job`` table, written the way projects usually write one (field list filters,
full ``COUNT(*)``), served by the same process in the same run, so the ratio
between the two is the figure to read on a noisy machine.
Figures are printed, never asserted; only a page that fails makes the exit
status non-zero.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATABASE_URL = "sqlite:////tmp/django-jobs-bench.sqlite3"

# Settings are read at django.setup(), so the environment must be ready before it.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
os.environ.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)

import django  # noqa: E402

django.setup()

from django.apps import apps  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib import admin  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, models, transaction  # noqa: E402
from django.http import HttpResponse  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.urls import include, path  # noqa: E402
from django.utils import timezone  # noqa: E402

from django_jobs.core.dependencies import DEPENDENCY_FAILED_ERROR  # noqa: E402
from django_jobs.models import (  # noqa: E402
    AwaitingExecution,
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobDependency,
    JobStatus,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
    Workflow,
)

# --- the planted data ------------------------------------------------------------------

MIX = {
    JobStatus.SUCCEEDED: 0.80,
    JobStatus.FAILED: 0.05,
    JobStatus.READY: 0.08,
    JobStatus.SCHEDULED: 0.03,
    JobStatus.BLOCKED: 0.02,
    JobStatus.RUNNING: 0.02,
}
QUEUES = ("default", "emails", "reports")
TASKS = tuple(
    f"bench.tasks.{name}"
    for name in (
        "send_welcome_email",
        "send_digest",
        "render_invoice",
        "build_report",
        "sync_crm",
        "resize_image",
        "charge_card",
        "expire_sessions",
        "index_document",
        "sync_account",
    )
)
KEYED_TASK = "bench.tasks.sync_account"
MAX_KEYS = 200
BLOCKED_PER_KEY = 10  # fewer keys when there are fewer blocked jobs than 200 x 10
RECENT_FINISHED = 0.02  # share of finished jobs that finished within the last hour
HISTORY = timedelta(days=7)
BATCH = 5_000
WORKERS = 3
PROCESS_PREFIX = "bench-"
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/app/django_jobs/runtime/worker.py", line 212, in perform\n'
    "    result = task.call(*job.args, **job.kwargs)\n"
    '  File "/srv/app/bench/tasks.py", line 48, in sync_crm\n'
    "    response = session.post(url, json=payload, timeout=10)\n"
    '  File "/usr/lib/python3/dist-packages/requests/sessions.py", line 637, in post\n'
    '    return self.request("POST", url, data=data, json=json, **kwargs)\n'
    "TimeoutError: the CRM did not answer within 10 seconds\n"
)

Spec = tuple[str, str | None]  # (status, concurrency key) of one job, in id order

# Workflows: a root, WORKFLOW_WIDTH jobs after it, a join after all of them. One per
# WORKFLOW_EVERY planted jobs (at least 20), created over the week: most succeeded, some
# running (half the middle ready, the join awaiting), some failed (a middle job failed,
# the join ended by it). Then the one whose page is timed: running, BIG_WORKFLOW jobs, as
# wide as a page draws (admin/graph.py draws up to 300).
WORKFLOW_WIDTH = 6
WORKFLOW_EVERY = 1_000
WORKFLOW_MIX = {"succeeded": 0.85, "running": 0.10, "failed": 0.05}
BIG_WORKFLOW = 250
WORKFLOW_TASKS = ("bench.tasks.fetch_feed", "bench.tasks.parse_chunk", "bench.tasks.merge_parts")


def status_counts(total: int) -> dict[str, int]:
    """Jobs per status for ``total`` jobs; rounding leftovers go to succeeded."""
    counts = {status: int(total * share) for status, share in MIX.items()}
    counts[JobStatus.SUCCEEDED] += total - sum(counts.values())
    return counts


def concurrency_keys(counts: dict[str, int]) -> list[str]:
    """About 200 keys, each with several blocked jobs and one ready holder."""
    wanted = min(MAX_KEYS, counts[JobStatus.BLOCKED] // BLOCKED_PER_KEY, counts[JobStatus.READY])
    return [f"{KEYED_TASK}:account-{n}" for n in range(max(1, wanted))]


def job_specs(
    counts: dict[str, int], keys: list[str], rng: random.Random
) -> tuple[list[Spec], int]:
    """Statuses in id (= enqueue) order, and how many belong to the history before the hour.

    Ids follow enqueue time as in a real table, so "latest first" pages and the
    filters that read the most recent jobs see what they would in production.
    """
    finished = [JobStatus.SUCCEEDED] * counts[JobStatus.SUCCEEDED]
    finished += [JobStatus.FAILED] * counts[JobStatus.FAILED]
    rng.shuffle(finished)
    recent = round(len(finished) * RECENT_FINISHED)
    holders: list[Spec] = [(JobStatus.READY, key) for key in keys]
    blocked: list[Spec] = [
        (JobStatus.BLOCKED, keys[n % len(keys)]) for n in range(counts[JobStatus.BLOCKED])
    ]
    last_hour: list[Spec] = [(status, None) for status in finished[:recent]]
    last_hour += [(JobStatus.READY, None)] * (counts[JobStatus.READY] - len(keys))
    last_hour += [(JobStatus.SCHEDULED, None)] * counts[JobStatus.SCHEDULED]
    last_hour += [(JobStatus.RUNNING, None)] * counts[JobStatus.RUNNING]
    last_hour += blocked
    rng.shuffle(last_hour)
    # Holders were admitted before the jobs now blocked behind them.
    history: list[Spec] = [(status, None) for status in finished[recent:]]
    return history + holders + last_hour, len(history)


def enqueue_time(index: int, old: int, total: int, now: datetime) -> datetime:
    """Spread the first ``old`` jobs over the week before the last hour, the rest over it."""
    hour = timedelta(hours=1)
    if index < old:
        return now - HISTORY + (HISTORY - hour) * (index / max(1, old))
    return now - hour + hour * ((index - old) / max(1, total - old))


def build_job(
    status: str, key: str | None, enqueued_at: datetime, now: datetime, rng: random.Random
) -> Job:
    """One job row whose times and counters agree with its status."""
    job = Job(
        task_path=KEYED_TASK if key else rng.choice(TASKS[:-1]),
        queue_name="default" if key else rng.choice(QUEUES),
        status=status,
        enqueued_at=enqueued_at,
        args=[rng.randrange(1_000_000)],
        kwargs={"source": "bench"},
        concurrency_key=key,
        concurrency_limit=1 if key else None,
    )
    worker = f"{PROCESS_PREFIX}worker-{rng.randrange(WORKERS)}"
    if status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        started = enqueued_at + timedelta(seconds=rng.uniform(0, 2))
        job.started_at = job.last_attempted_at = min(started, now)
        job.finished_at = min(started + timedelta(seconds=rng.uniform(0.05, 8)), now)
        job.attempts, job.worker_ids = 1, [worker]
        job.return_value = {"ok": True} if status == JobStatus.SUCCEEDED else None
    elif status == JobStatus.RUNNING:
        job.started_at = job.last_attempted_at = now - timedelta(seconds=rng.uniform(0, 20))
        job.attempts, job.worker_ids = 1, [worker]
    elif status == JobStatus.SCHEDULED:
        job.run_after = now + timedelta(seconds=rng.uniform(60, 86_400))
    return job


def insert_jobs(jobs: list[Job]) -> None:
    """Bulk-insert, then make sure every job has its id (the execution rows need it)."""
    Job.objects.bulk_create(jobs)
    if any(job.pk is None for job in jobs):  # a backend without INSERT ... RETURNING
        ids = Job.objects.order_by("-pk").values_list("pk", flat=True)[: len(jobs)]
        for job, pk in zip(jobs, reversed(list(ids)), strict=True):
            job.pk = pk


def execution_rows(jobs: Iterable[Job], workers: list[Process]) -> list[models.Model]:
    """The one execution row each job's status implies (the module docstring's invariant)."""
    rows: list[models.Model] = []
    for job in jobs:
        common = {"job_id": job.pk, "queue_name": job.queue_name}
        if job.status == JobStatus.READY:
            rows.append(
                ReadyExecution(
                    **common, concurrency_key=job.concurrency_key, created_at=job.enqueued_at
                )
            )
        elif job.status == JobStatus.SCHEDULED:
            rows.append(ScheduledExecution(**common, scheduled_at=job.run_after))
        elif job.status == JobStatus.BLOCKED:
            rows.append(
                BlockedExecution(
                    **common, concurrency_key=job.concurrency_key, created_at=job.enqueued_at
                )
            )
        elif job.status == JobStatus.RUNNING:
            worker = workers[job.pk % len(workers)]
            rows.append(ClaimedExecution(**common, process=worker, created_at=job.started_at))
        elif job.status == JobStatus.FAILED:
            rows.append(failure(job))
    return rows


def failure(job: Job) -> FailedExecution:
    return FailedExecution(
        job_id=job.pk,
        attempt=1,
        worker_id=job.worker_ids[0],
        exception_class_path="builtins.TimeoutError",
        message="the CRM did not answer within 10 seconds",
        traceback=TRACEBACK,
        failed_at=job.finished_at,
    )


def bulk_insert_mixed(rows: list[models.Model]) -> None:
    """One bulk_create per model, for a list that mixes execution tables."""
    by_model: dict[type[models.Model], list[models.Model]] = {}
    for row in rows:
        by_model.setdefault(type(row), []).append(row)
    for model, same in by_model.items():
        model.objects.bulk_create(same)


def create_processes(now: datetime) -> list[Process]:
    """A supervisor and its workers, serving every queue, so nothing looks stuck."""
    supervisor = Process.objects.create(
        kind=Process.Kind.SUPERVISOR,
        name=f"{PROCESS_PREFIX}supervisor",
        hostname="bench-host",
        pid=40_000,
        last_heartbeat_at=now,
    )
    return [
        Process.objects.create(
            kind=Process.Kind.WORKER,
            name=f"{PROCESS_PREFIX}worker-{n}",
            hostname="bench-host",
            pid=40_001 + n,
            supervisor=supervisor,
            metadata={"queues": ["*"], "threads": 3},
            last_heartbeat_at=now,
        )
        for n in range(WORKERS)
    ]


def plant(total: int, seed: int = 7) -> float:
    """Insert ``total`` jobs with their execution rows; returns the seconds it took."""
    began = time.perf_counter()
    rng = random.Random(seed)
    now = timezone.now()
    counts = status_counts(total)
    keys = concurrency_keys(counts)
    specs, old = job_specs(counts, keys, rng)
    with transaction.atomic():
        workers = create_processes(now)
        Semaphore.objects.bulk_create(
            Semaphore(key=key, limit=1, value=0, created_at=now, updated_at=now) for key in keys
        )
    for start in range(0, len(specs), BATCH):
        jobs = [
            build_job(status, key, enqueue_time(start + n, old, len(specs), now), now, rng)
            for n, (status, key) in enumerate(specs[start : start + BATCH])
        ]
        with transaction.atomic():
            insert_jobs(jobs)
            bulk_insert_mixed(execution_rows(jobs, workers))
    return time.perf_counter() - began


def workflow_shape(outcome: str, width: int) -> tuple[list[str], str]:
    """The statuses of a workflow's root and middle jobs, and its join's, for ``outcome``."""
    middle = [JobStatus.SUCCEEDED] * width
    if outcome == "running":
        middle[width // 2 :] = [JobStatus.READY] * (width - width // 2)
        return [JobStatus.SUCCEEDED, *middle], JobStatus.AWAITING
    if outcome == "failed":
        middle[-1] = JobStatus.FAILED
        return [JobStatus.SUCCEEDED, *middle], JobStatus.FAILED
    return [JobStatus.SUCCEEDED, *middle], JobStatus.SUCCEEDED


def workflow_jobs(workflow: Workflow, outcome: str, width: int, rng: random.Random) -> list[Job]:
    """A workflow's jobs, root first and join last, their times after its creation."""
    heads, join = workflow_shape(outcome, width)
    jobs = []
    for index, status in enumerate([*heads, join]):
        task = WORKFLOW_TASKS[0 if index == 0 else 2 if index == len(heads) else 1]
        job = Job(
            task_path=task,
            queue_name="default",
            status=status,
            enqueued_at=workflow.created_at,
            args=[index],
            kwargs={"source": "bench"},
            workflow=workflow,
        )
        ran = status == JobStatus.SUCCEEDED or (status == JobStatus.FAILED and index < len(heads))
        if ran:
            started = workflow.created_at + timedelta(seconds=index + rng.uniform(0, 1))
            job.started_at = job.last_attempted_at = started
            job.finished_at = started + timedelta(seconds=rng.uniform(0.05, 2))
            job.attempts = 1
            job.worker_ids = [f"{PROCESS_PREFIX}worker-{rng.randrange(WORKERS)}"]
            job.return_value = {"ok": True} if status == JobStatus.SUCCEEDED else None
        elif status == JobStatus.FAILED:  # the join, ended by its failed dependency
            job.finished_at = max(j.finished_at for j in jobs if j.finished_at)
        jobs.append(job)
    return jobs


def workflow_rows(jobs: list[Job]) -> list[models.Model]:
    """The edges (middle jobs after the root, the join after them), settled once their
    dependency succeeded, and the execution or error row each job's status implies."""
    root, *middle, join = jobs
    edges = [(child, [root]) for child in middle] + [(join, middle)]
    rows: list[models.Model] = []
    for child, parents in edges:
        for position, parent in enumerate(parents):
            done = parent.status == JobStatus.SUCCEEDED
            rows.append(
                JobDependency(job=child, depends_on=parent, position=position, settled=done)
            )
    remaining = sum(parent.status != JobStatus.SUCCEEDED for parent in middle)
    for job in jobs:
        common = {"job_id": job.pk, "queue_name": job.queue_name}
        if job.status == JobStatus.READY:
            rows.append(ReadyExecution(**common, created_at=job.enqueued_at))
        elif job.status == JobStatus.AWAITING:
            rows.append(AwaitingExecution(**common, remaining=remaining))
        elif job.status == JobStatus.FAILED and job is join:
            failed = next(parent for parent in middle if parent.status == JobStatus.FAILED)
            rows.append(
                FailedExecution(
                    job_id=job.pk,
                    attempt=0,
                    exception_class_path=DEPENDENCY_FAILED_ERROR,
                    message=f"dependency #{failed.pk} failed",
                    failed_at=job.finished_at,
                )
            )
        elif job.status == JobStatus.FAILED:
            rows.append(failure(job))
    return rows


def plant_workflows(total: int, seed: int = 13) -> int:
    """Plant the workflows beside ``total`` jobs; returns the id of the one timed."""
    rng = random.Random(seed)
    now = timezone.now()
    count = max(20, total // WORKFLOW_EVERY)
    plan = [
        (outcome, WORKFLOW_WIDTH)
        for outcome, share in WORKFLOW_MIX.items()
        for _ in range(round(count * share))
    ]
    rng.shuffle(plan)
    plan.append(("running", BIG_WORKFLOW - 2))
    with transaction.atomic():
        for index, (outcome, width) in enumerate(plan):
            created = now - HISTORY + HISTORY * (index / len(plan))
            if outcome == "running":  # still going: created in the last hour
                created = now - timedelta(minutes=rng.uniform(1, 60))
            workflow = Workflow.objects.create(name=f"import {index}", created_at=created)
            jobs = workflow_jobs(workflow, outcome, width, rng)
            insert_jobs(jobs)
            bulk_insert_mixed(workflow_rows(jobs))
    return workflow.pk


def ensure_workflows(total: int) -> int:
    """Plant the workflows unless some are there; returns the id of the one timed."""
    if not Workflow.objects.exists():
        print("planting workflows ...", flush=True)
        plant_workflows(total)
        analyze()
    timed = Workflow.objects.annotate(size=models.Count("jobs")).filter(size=BIG_WORKFLOW)
    return timed.order_by("-pk").values_list("pk", flat=True).first()


def jobs_tables() -> list[str]:
    """The app's tables, ``Job``'s last (the execution rows point at it)."""
    tables = [m for m in apps.get_app_config("django_jobs").get_models() if not m._meta.proxy]
    tables.sort(key=lambda model: model is Job)
    return [connection.ops.quote_name(model._meta.db_table) for model in tables]


def wipe() -> None:
    """Empty every django_jobs table with one DELETE each (the ORM would fetch every row)."""
    with transaction.atomic(), connection.cursor() as cursor:
        for table in jobs_tables():
            cursor.execute(f"DELETE FROM {table}")


def analyze() -> None:
    """Give the planted tables the statistics a table in service has.

    PostgreSQL's autovacuum and InnoDB's automatic statistics would get there
    on their own, some time after a bulk load: without this, the first run
    times plans made blind. SQLite gathers statistics only when asked, which
    Django never does, so it is left as deployed.
    """
    with connection.cursor() as cursor:
        for table in jobs_tables():
            if connection.vendor == "postgresql":
                cursor.execute(f"VACUUM ANALYZE {table}")
            elif connection.vendor == "mysql":
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()


def refresh_heartbeats() -> None:
    """Keep the bench workers alive on reruns, or their claims would show up as stuck."""
    Process.objects.filter(name__startswith=PROCESS_PREFIX).update(last_heartbeat_at=timezone.now())


# --- the peer: a stock ModelAdmin ------------------------------------------------------


class StockJobAdmin(admin.ModelAdmin):
    """The job list as projects usually write it, with Django's defaults for the rest.

    Field list filters run ``SELECT DISTINCT`` over the whole column for their
    choices, and the default paginator counts every matching row. The columns
    and page size are the app's, so both sides render the same amount of HTML.
    """

    list_display = (
        "id",
        "task_path",
        "queue_name",
        "status",
        "priority",
        "attempts",
        "concurrency_key",
        "enqueued_at",
        "finished_at",
    )
    list_filter = ("status", "queue_name", "task_path", "concurrency_key")
    list_per_page = 50
    show_full_result_count = True
    # Otherwise Django picks the app's admin/django_jobs/job/change_list.html first.
    change_list_template = "admin/change_list.html"


stock_site = admin.AdminSite(name="stock")
stock_site.register(Job, StockJobAdmin)

bench_urls = types.ModuleType("bench_urls")
bench_urls.urlpatterns = [path("admin/", admin.site.urls), path("stock/", stock_site.urls)]
# The metrics endpoint, mounted as docs/metrics.md mounts it.
if find_spec("prometheus_client") is not None:
    bench_urls.urlpatterns.append(path("jobs/metrics", include("django_jobs.metrics.urls")))
sys.modules["bench_urls"] = bench_urls


# --- measuring -------------------------------------------------------------------------


@dataclass
class PageResult:
    site: str
    name: str
    url: str
    times_ms: list[float] = field(default_factory=list)  # one per round
    sql_ms: list[float] = field(default_factory=list)
    queries: int = 0
    slowest_ms: float = 0.0
    slowest_sql: str = ""
    rows: int | None = None
    error: str = ""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("nan")

    @property
    def median_sql_ms(self) -> float:
        return statistics.median(self.sql_ms) if self.sql_ms else float("nan")


def get(client: Client, url: str) -> tuple[HttpResponse | None, str]:
    """The response and an error text: a raised exception's traceback, or a non-200 status."""
    try:
        response = client.get(url)
    except Exception:
        return None, traceback.format_exc()
    if response.status_code != 200:
        body = response.content.decode(errors="replace")
        title = re.search(r"<title>(.*?)</title>", body, re.DOTALL)
        what = response.get("Location") or (title.group(1).strip() if title else body[:500])
        return response, f"HTTP {response.status_code}: {what}"
    return response, ""


def result_count(response: HttpResponse) -> int | None:
    """Rows the changelist says match its filters (capped by the app's paginator)."""
    changelist = (getattr(response, "context_data", None) or {}).get("cl")
    return getattr(changelist, "result_count", None)


class QueryClock:
    """An execute wrapper adding up query time and keeping the slowest query.

    Timed to the microsecond: ``CaptureQueriesContext`` rounds each query to the
    millisecond, too coarse for the indexed reads these pages should be made of.
    The total tells the database's share of a page from the rendering's.
    """

    def __init__(self) -> None:
        self.total_ms = 0.0
        self.slowest_ms = 0.0
        self.slowest_sql = ""

    def __call__(
        self,
        execute: Callable[..., Any],
        sql: str,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            ms = (time.perf_counter() - began) * 1000
            self.total_ms += ms
            if ms > self.slowest_ms:
                self.slowest_ms = ms
                self.slowest_sql = connection.ops.last_executed_query(
                    context["cursor"], sql, params
                )


def time_once(client: Client, result: PageResult) -> None:
    """One timed GET of the page, adding its figures to ``result``."""
    clock = QueryClock()
    with CaptureQueriesContext(connection) as captured, connection.execute_wrapper(clock):
        began = time.perf_counter()
        response, result.error = get(client, result.url)
        elapsed = (time.perf_counter() - began) * 1000
    if result.error:
        return
    result.times_ms.append(elapsed)
    result.sql_ms.append(clock.total_ms)
    result.queries = len(captured.captured_queries)
    result.rows = result_count(response)
    if clock.slowest_ms > result.slowest_ms:
        result.slowest_ms, result.slowest_sql = clock.slowest_ms, clock.slowest_sql


def measure(client: Client, results: list[PageResult], repeat: int) -> None:
    """A warm-up GET of every page, then ``repeat`` rounds each timing every page once.

    Rounds rather than one page's requests back to back: a burst of load from
    elsewhere on the machine then costs one request of many pages, which the
    median drops, instead of every request of one page.
    """
    for result in results:
        _, result.error = get(client, result.url)
    for _ in range(repeat):
        for result in results:
            if not result.error:
                time_once(client, result)


def pages(failed_job_id: int | None, workflow_id: int | None) -> list[tuple[str, str, str]]:
    """(site, name, url) of every page timed; names shared by both sites are compared."""
    ours = "/admin/django_jobs"
    stock = "/stock/django_jobs"
    return [
        ("ours", "dashboard", f"{ours}/dashboard/"),
        ("ours", "job list", f"{ours}/job/"),
        ("ours", "job list, failed", f"{ours}/job/?status=failed"),
        ("ours", "job list, failed 24h", f"{ours}/job/?status=failed&finished_since=24h"),
        ("ours", "job list, queue emails", f"{ours}/job/?queue_name=emails"),
        ("ours", "job list, page 50", f"{ours}/job/?p=50"),
        ("ours", "failed job page", f"{ours}/job/{failed_job_id}/change/"),
        ("ours", "blocked keys", f"{ours}/blockedkey/"),
        ("ours", "stuck jobs", f"{ours}/stuckjob/"),
        ("ours", "processes", f"{ours}/process/"),
        ("ours", "workflows", f"{ours}/workflow/"),
        ("ours", f"workflow page, {BIG_WORKFLOW} jobs", f"{ours}/workflow/{workflow_id}/change/"),
        ("stock", "job list", f"{stock}/job/"),
        ("stock", "job list, failed", f"{stock}/job/?status=failed"),
        ("stock", "job list, queue emails", f"{stock}/job/?queue_name=emails"),
        ("stock", "job list, page 50", f"{stock}/job/?p=50"),
    ]


def logged_in_client() -> Client:
    """A client with the ``bench`` superuser's session (created once, no password)."""
    user_model = get_user_model()
    user = user_model.objects.filter(username="bench").first()
    if user is None:
        user = user_model.objects.create_superuser("bench", "bench@example.invalid", None)
    client = Client()
    client.force_login(user)
    return client


# --- reporting -------------------------------------------------------------------------


def server_version() -> str:
    query = "SELECT sqlite_version()" if connection.vendor == "sqlite" else "SELECT version()"
    with connection.cursor() as cursor:
        cursor.execute(query)
        return str(cursor.fetchone()[0])


def print_header(requested: int, repeat: int) -> None:
    counts = dict(
        Job.objects.values_list("status").annotate(n=models.Count("pk")).values_list("status", "n")
    )
    tables = (
        ReadyExecution,
        ScheduledExecution,
        BlockedExecution,
        AwaitingExecution,
        ClaimedExecution,
        FailedExecution,
        Semaphore,
        Process,
        Workflow,
        JobDependency,
    )
    name = settings.DATABASES["default"]["NAME"]
    print(f"database: {connection.vendor} {server_version()} ({name})")
    print(f"django {django.get_version()}, DEBUG={settings.DEBUG}, repeat={repeat} (+1 warm-up)")
    print(f"jobs: {sum(counts.values()):,} (asked for {requested:,})")
    print("by status: " + ", ".join(f"{s} {n:,}" for s, n in sorted(counts.items())))
    print("rows: " + ", ".join(f"{t.__name__} {t.objects.count():,}" for t in tables))


def print_table(results: list[PageResult]) -> None:
    print()
    print(
        f"{'site':<6}{'page':<25}{'median ms':>10}{'min ms':>8}{'sql ms':>8}{'queries':>9}"
        f"{'slowest q ms':>14}{'rows':>9}"
    )
    for r in results:
        if r.error:
            print(f"{r.site:<6}{r.name:<25}{'ERROR':>10}")
            continue
        rows = "" if r.rows is None else f"{r.rows:,}"
        print(
            f"{r.site:<6}{r.name:<25}{r.median_ms:>10.1f}{min(r.times_ms):>8.1f}"
            f"{r.median_sql_ms:>8.1f}{r.queries:>9}"
            f"{r.slowest_ms:>14.1f}{rows:>9}"
        )
    print("ms: whole request (median, fastest); sql ms: its queries' total (median);")
    print("slowest q: the slowest single query over all timed requests;")
    print("rows: the changelist's count (ours stops counting at its paginator's cap)")


def print_ratios(results: list[PageResult]) -> None:
    stock = {r.name: r for r in results if r.site == "stock" and not r.error}
    print()
    for ours in results:
        peer = stock.get(ours.name)
        if ours.site == "ours" and peer and not ours.error:
            print(
                f"{ours.name}: ours {ours.median_ms:.1f} ms vs stock {peer.median_ms:.1f} ms"
                f" = {ours.median_ms / peer.median_ms:.2f}x (SQL {ours.median_sql_ms:.1f} vs"
                f" {peer.median_sql_ms:.1f} ms = {ours.median_sql_ms / peer.median_sql_ms:.2f}x;"
                f" queries {ours.queries} vs {peer.queries})"
            )


def print_slow(results: list[PageResult], slow_ms: float) -> None:
    slow = [r for r in results if not r.error and r.median_ms > slow_ms]
    if slow:
        print(f"\npages over {slow_ms:.0f} ms, with their slowest SQL:")
    for r in slow:
        sql = r.slowest_sql if len(r.slowest_sql) <= 1500 else r.slowest_sql[:1500] + " ..."
        print(f"\n[{r.site}] {r.url}: {r.median_ms:.1f} ms; slowest query {r.slowest_ms:.1f} ms")
        print(f"  {sql}")


def print_errors(results: list[PageResult]) -> None:
    for r in results:
        if r.error:
            print(f"\nERROR [{r.site}] {r.url}:\n{r.error}", file=sys.stderr)


# --- main ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs to plant (100,000)")
    parser.add_argument("--repeat", type=int, default=5, help="timed requests per page (5)")
    parser.add_argument("--fresh", action="store_true", help="delete every django_jobs row first")
    parser.add_argument("--slow-ms", type=float, default=100, help="print SQL of pages slower")
    return parser.parse_args()


def ensure_jobs(total: int, fresh: bool) -> None:
    """Plant unless the database already holds enough jobs, so reruns start timing at once."""
    if fresh:
        wipe()
    present = Job.objects.count()
    if present >= total:
        print(f"{present:,} jobs already planted (>= {total:,}): not planting; --fresh to redo")
        refresh_heartbeats()
        return
    if present:
        raise SystemExit(f"the database holds {present:,} jobs, fewer than {total:,}: use --fresh")
    print(f"planting {total:,} jobs ...", flush=True)
    print(f"planted in {plant(total):.1f} s", flush=True)
    began = time.perf_counter()
    analyze()
    print(f"analyzed in {time.perf_counter() - began:.1f} s")


def main() -> int:
    options = parse_args()
    call_command("migrate", interactive=False, verbosity=0)
    ensure_jobs(options.jobs, options.fresh)
    workflow_id = ensure_workflows(options.jobs)
    failed = (
        Job.objects.filter(status=JobStatus.FAILED, workflow__isnull=True).order_by("-pk").first()
    )
    client = logged_in_client()
    with override_settings(ROOT_URLCONF="bench_urls"):
        results = [PageResult(*page) for page in pages(failed.pk if failed else None, workflow_id)]
        measure(client, results, options.repeat)
    print_header(options.jobs, options.repeat)
    print_table(results)
    print_ratios(results)
    print_slow(results, options.slow_ms)
    print_errors(results)
    if any(r.error for r in results):
        print("\nFAILED: some admin pages did not answer 200 (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
