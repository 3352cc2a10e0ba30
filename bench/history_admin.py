"""bench/history.py's admin phase: what it plants so every page shows something, and the
pages it times.

The same rows go into both databases, above the history's ids on the history side, right
before the pages are timed, and are removed after them (the drains must not meet a stuck
job or a dead process): a supervisor and its live workers, a dead worker still holding a
claim (a stuck job), ``BLOCKED_KEYS`` keys each with a ready holder and blocked jobs behind
it, one rate-limited key with jobs scheduled behind its window, finished and open batches,
one workflow of ``WORKFLOW_JOBS`` jobs, a few failed jobs. Rows are built with
bench/admin_pages.py's helpers, so each status has the execution row it implies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlencode

from django.db import transaction
from django.utils import timezone

from bench import admin_pages as ap
from django_jobs.models import (
    Batch,
    ClaimedExecution,
    Job,
    JobStatus,
    Process,
    RateLimit,
    ScheduledExecution,
    Semaphore,
    Workflow,
)

BLOCKED_KEYS = 5
BLOCKED_PER_KEY = 20
KEY_PREFIX = f"{ap.KEYED_TASK}:history-account-"
RATE_KEY = "shop.tasks.sync_crm:history-tenant-1"
RATE_LIMIT, RATE_PERIOD, RATE_WAITING = 10, 60.0, 15
FINISHED_BATCHES, OPEN_BATCHES, BATCH_ITEMS = 3, 2, 100
WORKFLOW_JOBS = 300  # a root, 298 jobs after it, a join: as wide as a page draws
FAILED_JOBS = 5
DEAD_PROCESS = "history-bench-dead-worker"
ADMIN = "/admin/django_jobs"
METRICS_URL = "/jobs/metrics"
# The job list's sortable columns (JobAdmin.list_display's positions, Django's ?o=).
ORDERINGS = {"job": 1, "queue": 2, "state": 3, "key": 4, "enqueued": 5, "finished": 6}


@dataclass(frozen=True)
class Planted:
    """Ids the page URLs need."""

    failed_job: int
    finished_batch: int
    open_batch: int
    workflow: int
    process: int
    key: str


def plant(seed: int = 37) -> Planted:
    """Plant every row the admin pages show; one transaction."""
    rng = random.Random(seed)
    now = timezone.now()
    with transaction.atomic():
        workers = ap.create_processes(now)
        dead = Process.objects.create(
            kind=Process.Kind.WORKER,
            name=DEAD_PROCESS,
            hostname="bench-host",
            pid=41_000,
            metadata={"queues": ["*"], "threads": 3},
            last_heartbeat_at=now - timedelta(hours=1),
        )
        keys = plant_blocked(now, workers, rng)
        stuck = ap.build_job(JobStatus.RUNNING, None, now - timedelta(hours=1), now, rng)
        ap.insert_jobs([stuck])  # its claim is the dead process's, not a live worker's
        ClaimedExecution.objects.create(
            job_id=stuck.pk, queue_name=stuck.queue_name, process=dead, created_at=stuck.started_at
        )
        plant_rate_limited(now)
        failed = insert(
            [
                ap.build_job(JobStatus.FAILED, None, now - timedelta(minutes=n + 1), now, rng)
                for n in range(FAILED_JOBS)
            ],
            workers,
        )
        finished_batch, open_batch = plant_batches(now, workers, rng)
        workflow = Workflow.objects.create(name="history import", created_at=now)
        jobs = ap.workflow_jobs(workflow, "running", WORKFLOW_JOBS - 2, rng)
        ap.insert_jobs(jobs)
        ap.bulk_insert_mixed(ap.workflow_rows(jobs))
    return Planted(failed[-1].pk, finished_batch, open_batch, workflow.pk, workers[0].pk, keys[0])


def insert(jobs: list[Job], workers: list[Process]) -> list[Job]:
    ap.insert_jobs(jobs)
    ap.bulk_insert_mixed(ap.execution_rows(jobs, workers))
    return jobs


def plant_blocked(now: datetime, workers: list[Process], rng: random.Random) -> list[str]:
    """Keys of limit 1, each held by a ready job, with blocked jobs behind it."""
    keys = [f"{KEY_PREFIX}{n}" for n in range(BLOCKED_KEYS)]
    Semaphore.objects.bulk_create(
        Semaphore(key=key, limit=1, value=0, created_at=now, updated_at=now) for key in keys
    )
    specs = [(JobStatus.READY, key) for key in keys]
    specs += [(JobStatus.BLOCKED, key) for key in keys for _ in range(BLOCKED_PER_KEY)]
    enqueued = now - timedelta(minutes=10)
    insert([ap.build_job(status, key, enqueued, now, rng) for status, key in specs], workers)
    return keys


def plant_rate_limited(now: datetime) -> None:
    """A key whose window is full, and jobs scheduled for its next openings."""
    clock = now.timestamp()
    starts = [clock - RATE_PERIOD / 2 + n for n in range(RATE_LIMIT)]
    RateLimit.objects.create(
        key=RATE_KEY, limit=RATE_LIMIT, period=RATE_PERIOD, starts=starts, updated_at=now
    )
    jobs = []
    for n in range(RATE_WAITING):
        at = now + timedelta(seconds=RATE_PERIOD / 2 + n)
        jobs.append(
            Job(
                task_path="shop.tasks.sync_crm",
                queue_name="default",
                status=JobStatus.SCHEDULED,
                run_after=at,
                rate_key=RATE_KEY,
                rate_limit=RATE_LIMIT,
                rate_period=RATE_PERIOD,
                rate_reserved_at=at,
            )
        )
    ap.insert_jobs(jobs)
    ScheduledExecution.objects.bulk_create(
        ScheduledExecution(job_id=job.pk, queue_name=job.queue_name, scheduled_at=job.run_after)
        for job in jobs
    )


def plant_batches(now: datetime, workers: list[Process], rng: random.Random) -> tuple[int, int]:
    """Finished batches (their items ended) and open ones (half their items ready);
    returns the id of the last of each."""
    ids = {}
    for n in range(FINISHED_BATCHES + OPEN_BATCHES):
        done = n < FINISHED_BATCHES
        created = now - timedelta(hours=FINISHED_BATCHES + OPEN_BATCHES - n)
        statuses = [JobStatus.SUCCEEDED] * BATCH_ITEMS
        if done:
            statuses[-2:] = [JobStatus.FAILED] * 2
        else:
            statuses[BATCH_ITEMS // 2 :] = [JobStatus.READY] * (BATCH_ITEMS - BATCH_ITEMS // 2)
        batch = Batch.objects.create(
            description=f"history export {n}",
            total=BATCH_ITEMS,
            pending=statuses.count(JobStatus.READY),
            succeeded=statuses.count(JobStatus.SUCCEEDED),
            failed=statuses.count(JobStatus.FAILED),
            created_at=created,
            finished_at=created + timedelta(minutes=5) if done else None,
        )
        jobs = [ap.build_job(status, None, created, now, rng) for status in statuses]
        for job in jobs:
            job.batch = batch
        insert(jobs, workers)
        ids[done] = batch.pk
    return ids[True], ids[False]


def unplant(floor: int) -> None:
    """Remove what :func:`plant` added (and any job above ``floor``): the jobs first, then
    the rows they pointed at. Never a TRUNCATE: a cascade would reach the job table."""
    with transaction.atomic():
        Job.objects.filter(pk__gt=floor).delete()
        for model in (Batch, Workflow, Semaphore, RateLimit, Process):
            model.objects.all().delete()


def pages(
    planted: Planted, searches: dict[str, str], customer: int, task_path: str
) -> list[tuple[str, str]]:
    """(name, url) of every page timed, in issue 37's order."""
    terms = {"{job_id}": planted.failed_job, "{customer}": customer, "{task_path}": task_path}
    job = f"{ADMIN}/job/"
    listed = [
        ("dashboard", f"{ADMIN}/dashboard/"),
        ("job list", job),
        ("job list, status failed", f"{job}?status=failed"),
        ("job list, queue emails", f"{job}?queue_name=emails"),
        (f"job list, task {task_path}", f"{job}?{urlencode({'task_path': task_path})}"),
        ("job list, key", f"{job}?{urlencode({'concurrency_key': planted.key})}"),
        ("job list, finished since 24h", f"{job}?finished_since=24h"),
        ("job list, failed in the last hour", f"{job}?status=failed&finished_since=1h"),
        ("job list, batch", f"{job}?batch={planted.open_batch}"),
        ("job list, workflow", f"{job}?workflow={planted.workflow}"),
    ]
    for column, position in ORDERINGS.items():
        listed.append((f"job list, by {column} ascending", f"{job}?o={position}"))
        listed.append((f"job list, by {column} descending", f"{job}?o=-{position}"))
    for name, term in searches.items():
        for placeholder, value in terms.items():
            term = term.replace(placeholder, str(value))
        query = urlencode({"q": term})
        listed.append((f"job list, search {name}", f"{job}?{query}"))
    listed += [
        ("job page (failed)", f"{job}{planted.failed_job}/change/"),
        ("stuck jobs", f"{ADMIN}/stuckjob/"),
        ("blocked keys", f"{ADMIN}/blockedkey/"),
        ("rate-limited keys", f"{ADMIN}/ratelimitedkey/"),
        ("batches", f"{ADMIN}/batch/"),
        ("batch page (finished)", f"{ADMIN}/batch/{planted.finished_batch}/change/"),
        ("batch page (open)", f"{ADMIN}/batch/{planted.open_batch}/change/"),
        ("workflows", f"{ADMIN}/workflow/"),
        (f"workflow page, {WORKFLOW_JOBS} jobs", f"{ADMIN}/workflow/{planted.workflow}/change/"),
        ("processes", f"{ADMIN}/process/"),
        ("process page", f"{ADMIN}/process/{planted.process}/change/"),
        ("recurring tasks", f"{ADMIN}/recurringtask/"),
    ]
    return listed
