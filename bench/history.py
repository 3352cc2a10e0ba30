"""What a big history of finished jobs costs: the same figures on a database holding it and empty.

    python bench/history.py [--jobs-history N] [--phases ...] [--smoke] [--keep]

Run from the repository root (Linux: bench/throughput.py's worker harness reads /proc).
``DATABASE_URL`` names the database (default: PostgreSQL's ``jobs_history`` on 127.0.0.1);
its name must contain "jobs_history": the run empties its django_jobs tables. The empty
side is a sibling database on the same server, the same name plus ``_empty`` (created and
migrated by the run), so that ``--keep`` can keep the history between runs.

The history (issue 37's shape): N finished jobs written by the server in bulk
(``INSERT ... SELECT`` over ``generate_series`` on PostgreSQL, MariaDB's sequence
table, a recursive CTE on SQLite; in chunks of ``CHUNK`` rows), ids in finish order,
finished evenly over the last 14 days, 20 task paths, 5 queues,
``{"customer_id": n}`` keyword arguments over ``CUSTOMERS`` customers; every 10th job
failed with one ``FailedExecution``, the others succeeded, each with the columns the
worker writes (started, attempted and finished times, one attempt, the worker's id).
Then ``VACUUM ANALYZE`` and ``CHECKPOINT`` (PostgreSQL), ``ANALYZE TABLE`` (MariaDB),
a WAL checkpoint (SQLite). The build is timed, and each table's size printed.

Phases, each run on the empty database then on the history, in one run: ``enqueue``
(one by one), ``bulk`` (``bulk_enqueue`` of BULK_SIZE jobs, BULK_CALLS times),
``drain`` (no-op jobs bulk-enqueued, drained by real ``run_jobs`` workers, with the
workers' and the database server's CPU per job), ``keyed`` (the same drain, the jobs
over KEYED_KEYS concurrency keys of limit 2), ``latency`` (enqueue-to-start p50 and
p95 with idle workers), ``admin`` (every admin page issue 37 lists, over planted
batches, a workflow, blocked and rate-limited keys, processes and a stuck job, and
the metrics scrape; bench/history_admin.py) and ``cli`` (``manage.py jobs --json``, a
subprocess). Phase ``prune`` (history only, last: it removes half of it) drains
alone, drains while PRUNE_COMMAND runs, times the prune, then runs the hot paths
again at once, while autovacuum (InnoDB's purge) works on what the prune left,
watching it (bench/history_server.py). The workers run with the dispatcher's own
pruning (``clear_finished_jobs_after``) off, or they would prune the history as they
start. Figures are printed, never asserted; ratios are history / empty.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent

# The prune timed in phase "prune", as cron would run it (manage.py is the test project's).
PRUNE_COMMAND = ("prune_jobs", "--older-than", "7d")
# The job list's searches, timed on both sides: name -> the search box's text, in which
# "{job_id}" becomes a failed job's id, "{customer}" CUSTOMER and "{task_path}" TASK_PATH
# (plain replacement: other braces stay as written).
SEARCHES = {
    "by job id": "{job_id}",
    "customer id in the arguments": "customer_id={customer}",
    "any argument equal to the customer id": "arg:{customer}",
    "task path": "task:{task_path}",
    "free text (a bounded scan)": "text:customer_id",
}
CUSTOMER = 4242
TASK_PATH = "shop.tasks.task_7"  # one of the history's 20 (every 20th job)

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/jobs_history"
SAFE_NAME_PART = "jobs_history"
EMPTY_SUFFIX = "_empty"
PHASES = ("enqueue", "bulk", "drain", "keyed", "latency", "admin", "cli", "prune")
HOT_PATHS = ("enqueue", "bulk", "drain", "keyed", "latency")  # timed again after the prune
# Issue 37's sizes.
DEFAULT_HISTORY = {"postgresql": 30_000_000, "mysql": 10_000_000, "sqlite": 1_000_000}
SMOKE_HISTORY = 20_000
HISTORY_DAYS = 14
TASK_PATHS = 20
QUEUES = ("default", "emails", "reports", "reports-daily", "slow")  # the test project's
CUSTOMERS = 100_000
FAILED_EVERY = 10
KEYED_KEYS = 100
SLOW_MS = 100  # a page slower than this gets its slowest statement printed
CHUNK = {"postgresql": 5_000_000, "mysql": 200_000, "sqlite": 200_000}  # rows per INSERT
METRICS_TOKEN = "history-bench-scrape"
WORKER_ID = "bench-history-worker"
FAILURE_CLASS = "builtins.TimeoutError"
FAILURE_MESSAGE = "the CRM did not answer within 10 seconds"
FAILURE_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/app/shop/tasks.py", line 48, in sync_crm\n'
    "    response = session.post(url, json=payload, timeout=10)\n"
    "TimeoutError: the CRM did not answer within 10 seconds\n"
)
# run_jobs with the dispatcher's pruning off, otherwise as manage.py runs it: the settings
# module is imported and changed before Django reads it (its children are forked from it).
WORKER_BOOT = (
    "import sys; import bench.settings as s; "
    "s.DJANGO_JOBS['clear_finished_jobs_after'] = None; "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[1:]])"
)


@dataclass(frozen=True)
class Sizes:
    enqueue: int  # jobs enqueued one by one
    bulk_calls: int  # bulk_enqueue() calls timed
    bulk_size: int  # jobs per call
    drain: int  # jobs per drain (plain and keyed)
    latency_samples: int
    latency_interval_ms: float
    admin_repeat: int
    cli_repeat: int


FULL = Sizes(2_000, 20, 500, 10_000, 200, 30.0, 5, 3)
SMOKE = Sizes(200, 5, 200, 1_000, 20, 30.0, 2, 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs-history",
        type=int,
        help="finished jobs in the history (30,000,000 PostgreSQL, 10,000,000 MariaDB, "
        f"1,000,000 SQLite; {SMOKE_HISTORY:,} with --smoke)",
    )
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}"
    )
    parser.add_argument("--smoke", action="store_true", help="small sizes, for CI")
    parser.add_argument(
        "--keep", action="store_true", help="reuse the history if it holds --jobs-history jobs"
    )
    parser.add_argument("--processes", type=int, default=2, help="run_jobs --processes (2)")
    parser.add_argument("--threads", type=int, default=8, help="run_jobs --threads (8)")
    parser.add_argument(
        "--prune-rest",
        type=float,
        default=0.0,
        help="prune_jobs --rest for the prune phase (0: flat out, the command's default)",
    )
    parser.add_argument("--drain-jobs", type=int, help="no-op jobs per drain (10,000; smoke 1,000)")
    parser.add_argument("--enqueue", type=int, help="jobs enqueued one by one (2,000; smoke 200)")
    options = parser.parse_args()
    unknown = set(options.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    if options.jobs_history is not None and options.jobs_history < FAILED_EVERY:
        parser.error(f"--jobs-history must be at least {FAILED_EVERY}")
    return options


OPTIONS = parse_args()
os.environ.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
HISTORY_URL = os.environ["DATABASE_URL"]

# bench/throughput.py parses its own options and sets Django up as it is imported: give it
# none of ours, and only the phases that need no extra app.
sys.path.insert(0, str(ROOT))
_argv, sys.argv = sys.argv, [sys.argv[0], "--phases", "drain"]
import bench.throughput as tp  # noqa: E402

sys.argv = _argv
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402

# admin_pages' stock admin and URLconf (bench_urls) come along.
from bench import admin_pages, history_admin, history_server  # noqa: E402
from bench.history_tasks import KEYED_LIMIT, noop_keyed  # noqa: E402
from bench.tables import empty, tables_of  # noqa: E402
from bench.tasks import noop  # noqa: E402
from django_jobs.models import (  # noqa: E402
    FINISHED_STATUSES,
    FailedExecution,
    Job,
    JobStatus,
)
from tests.harness import create_server_database  # noqa: E402

progress = tp.progress


# --- which database ----------------------------------------------------------------------


def sibling_url(url: str) -> str:
    """The same server's database named like ``url``'s plus EMPTY_SUFFIX."""
    # The URL's text, not urlunsplit(): that drops a slash of sqlite:////abs/path.
    before_query, mark, query = url.partition("?")
    head, _, name = before_query.rpartition("/")
    stem, dot, ext = name.partition(".")
    return f"{head}/{stem}{EMPTY_SUFFIX}{dot}{ext}{mark}{query}"


def database_name(url: str) -> str:
    return urlsplit(url).path.rpartition("/")[2]


def check_name(url: str) -> None:
    """Refuse a database that might be someone's: the run empties its tables."""
    name = database_name(url)
    if SAFE_NAME_PART not in name:
        raise SystemExit(
            f"refusing to empty the tables of database {name!r}: its name must contain "
            f"{SAFE_NAME_PART!r} (e.g. jobs_history)"
        )


def use_database(url: str) -> None:
    """Point this process's connection, and the workers it starts, at ``url``."""
    connection.close()
    path = urlsplit(url).path
    name = path[1:] if connection.vendor == "sqlite" else path.rpartition("/")[2]
    connection.settings_dict["NAME"] = name
    settings.DATABASES["default"]["NAME"] = name
    os.environ["DATABASE_URL"] = url
    if connection.vendor != "sqlite":
        create_server_database(name)
    call_command("migrate", interactive=False, verbosity=0)


# --- the history -------------------------------------------------------------------------


def quote(name: str) -> str:
    return connection.ops.quote_name(name)


def concat(*parts: str) -> str:
    if connection.vendor == "mysql":
        return f"CONCAT({', '.join(parts)})"
    return " || ".join(f"({part})" for part in parts)


def timestamp(now: datetime, seconds_before: str) -> str:
    """SQL for ``now`` minus ``seconds_before`` (an SQL number), in the column's form."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    if connection.vendor == "postgresql":
        return f"(TIMESTAMPTZ '{stamp}+00' - make_interval(secs => {seconds_before}))"
    if connection.vendor == "mysql":
        return (
            f"TIMESTAMPADD(MICROSECOND, -CAST(({seconds_before}) * 1000000 AS SIGNED), '{stamp}')"
        )
    return (
        f"strftime('%%Y-%%m-%%d %%H:%%M:%%f', '{stamp}', '-' || ({seconds_before}) || ' seconds')"
    )


def json_sql(expression: str) -> str:
    return f"({expression})::jsonb" if connection.vendor == "postgresql" else expression


def history_expressions(total: int, offset: int, now: datetime) -> dict[str, str]:
    """Column -> SQL of job number ``n + offset`` (1 the oldest) of ``total``.

    The SQL goes through a cursor with parameters: a literal percent sign is doubled."""
    # tp.series' row number: MariaDB's sequence table calls its column "seq".
    number = "seq" if connection.vendor == "mysql" else "n"
    k = f"({number} + {offset})"
    step = HISTORY_DAYS * 86400 / total
    finished = f"({total} - {k}) * {step!r} + 1"
    queue_case = " ".join(f"WHEN {i} THEN '{q}'" for i, q in enumerate(QUEUES))
    failed, succeeded = JobStatus.FAILED.value, JobStatus.SUCCEEDED.value
    return {
        "task_path": concat("'shop.tasks.task_'", f"{k} %% {TASK_PATHS}"),
        "queue_name": f"CASE {k} %% {len(QUEUES)} {queue_case} END",
        "status": f"CASE WHEN {k} %% {FAILED_EVERY} = 0 THEN '{failed}' ELSE '{succeeded}' END",
        "kwargs": json_sql(concat("'{\"customer_id\": '", f"{k} %% {CUSTOMERS}", "'}'")),
        "enqueued_at": timestamp(now, f"{finished} + 2"),
        "started_at": timestamp(now, f"{finished} + 0.05"),
        "last_attempted_at": timestamp(now, f"{finished} + 0.05"),
        "finished_at": timestamp(now, finished),
    }


def history_template() -> Job:
    """The constant columns of a finished job, as the worker leaves them."""
    return Job(
        backend="default",
        task_path="-",
        queue_name="-",
        args=[],
        kwargs={},
        attempts=1,
        max_attempts=1,
        worker_ids=[WORKER_ID],
    )


def insert_failures(low: int, high: int) -> None:
    """One FailedExecution per failed job of ids low..high, failed when it finished."""
    failed_table, job_table = quote(FailedExecution._meta.db_table), quote(Job._meta.db_table)
    columns = "job_id, attempt, worker_id, exception_class_path, message, traceback, failed_at"
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {failed_table} ({columns}) "
            f"SELECT id, 1, %s, %s, %s, %s, finished_at FROM {job_table} "
            "WHERE status = %s AND id BETWEEN %s AND %s",
            [
                WORKER_ID,
                FAILURE_CLASS,
                FAILURE_MESSAGE,
                FAILURE_TRACEBACK,
                JobStatus.FAILED,
                low,
                high,
            ],
        )


def build_history(total: int) -> dict[str, float]:
    """Empty django_jobs' tables and write ``total`` finished jobs; timings in seconds."""
    empty(tables_of("django_jobs"))
    now = timezone.now()
    chunk = CHUNK.get(connection.vendor, 200_000)
    began = time.perf_counter()
    for offset in range(0, total, chunk):
        count = min(chunk, total - offset)
        template = history_template()
        tp.insert_series(Job, count, template, history_expressions(total, offset, now))
        low = Job.objects.order_by("-pk").values_list("pk", flat=True)[:1][0] - count + 1
        insert_failures(low, low + count - 1)
        progress(f"history: {offset + count:,}/{total:,} jobs")
    inserted = time.perf_counter() - began
    began = time.perf_counter()
    settle()
    return {"insert_s": inserted, "vacuum_analyze_checkpoint_s": time.perf_counter() - began}


def settle() -> None:
    """The statistics and clean pages a table in service has, and no dirty pages to write."""
    with connection.cursor() as cursor:
        for table in tables_of("django_jobs"):
            if connection.vendor == "postgresql":
                cursor.execute(f"VACUUM ANALYZE {quote(table)}")
            elif connection.vendor == "mysql":
                cursor.execute(f"ANALYZE TABLE {quote(table)}")
                cursor.fetchall()
        if connection.vendor == "postgresql":
            cursor.execute("CHECKPOINT")
        elif connection.vendor == "sqlite":
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def history_present(total: int) -> bool:
    finished = Job.objects.filter(status__in=FINISHED_STATUSES).count()
    return finished == total and Job.objects.count() == total


# --- ours, beside a history --------------------------------------------------------------


class HistoryOurs(tp.Ours):
    """bench/throughput.py's ``Ours``, counting only the jobs above the history's ids."""

    def __init__(self, processes: int, threads: int, floor: int) -> None:
        super().__init__(processes, threads)
        self.floor = floor  # the history's highest id; 0 on the empty database

    def reset(self) -> None:
        if self.floor == 0:
            empty(tables_of("django_jobs"))
        else:
            history_admin.unplant(self.floor)

    def commands(self) -> list[list[str]]:
        flags = ["--processes", str(self.processes), "--threads", str(self.threads)]
        return [[sys.executable, "-c", WORKER_BOOT, "run_jobs", *flags]]

    def enqueue_keyed(self, count: int) -> None:
        calls = [(noop_keyed, (), {"key": n % KEYED_KEYS}) for n in range(count)]
        self.backend.bulk_enqueue(calls)

    def ours(self) -> Any:
        return Job.objects.filter(pk__gt=self.floor)

    def row_count(self) -> int:
        return self.ours().count()

    def finished_count(self) -> int:
        return self.ours().filter(status__in=FINISHED_STATUSES).count()

    def failed_count(self) -> int:
        return self.ours().exclude(status=JobStatus.SUCCEEDED).count()

    def span(self) -> tuple[datetime, datetime]:
        from django.db.models import Max, Min

        row = self.ours().aggregate(first=Min("started_at"), last=Max("finished_at"))
        return row["first"], row["last"]


# --- figures -----------------------------------------------------------------------------


@dataclass
class Figure:
    name: str
    unit: str
    empty: float | None = None
    history: float | None = None
    note: str = ""


@dataclass
class SlowPage:
    side: str
    name: str
    median_ms: float
    slowest_ms: float
    slowest_sql: str


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    slow_pages: list[SlowPage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def figure(self, name: str, unit: str) -> Figure:
        for figure in self.figures:
            if figure.name == name:
                return figure
        self.figures.append(Figure(name, unit))
        return self.figures[-1]

    def add(self, name: str, unit: str, side: str, value: float, note: str = "") -> None:
        figure = self.figure(name, unit)
        setattr(figure, side, value)
        if note:
            figure.note = f"{figure.note}; {note}" if figure.note else note

    def add_against(self, name: str, unit: str, value: float, reference: str) -> None:
        """A history-side figure with no run of its own on the empty database (measured
        after the prune): its empty column is figure ``reference``'s."""
        self.add(name, unit, "history", value)
        self.figure(name, unit).empty = self.figure(reference, unit).empty


# --- the hot paths -----------------------------------------------------------------------


def enqueue_rate(bench: HistoryOurs, count: int) -> float:
    """``enqueue()`` one by one, each its own transaction: the median of tp.PIECES pieces."""
    bench.reset()
    noop.enqueue()  # warm-up: first statements, first plans

    def enqueue(n: int) -> int:
        for _ in range(n):
            noop.enqueue()
        return n

    rate = tp.timed_in_pieces(count, enqueue).median
    tp.check_rows(bench, count + 1)
    return rate


def bulk_rate(bench: HistoryOurs, calls: int, size: int) -> float:
    """``bulk_enqueue()`` of ``size`` jobs, ``calls`` times after a warm-up: the median
    call's jobs/s."""
    bench.reset()
    bench.enqueue_many(size)
    rates = []
    for _ in range(calls):
        began = time.perf_counter()
        bench.enqueue_many(size)
        rates.append(size / (time.perf_counter() - began))
    tp.check_rows(bench, (calls + 1) * size)
    return statistics.median(rates)


@dataclass
class Measured:
    """A drain, with the CPU the server spent on this database (PostgreSQL: its backends
    and background processes; None elsewhere)."""

    drain: tp.Drain
    database_cpu: dict[str, Any] | None


def measured_drain(
    bench: HistoryOurs, jobs: int, enqueue: Callable[[], None], log_dir: Path, label: str
) -> Measured:
    """bench/throughput.py's drain, reading besides which server processes serve this
    database, before the jobs are committed and once they are all finished."""
    bench.reset()
    with tp.Workers(bench.commands(), log_dir, label, bench.environment()) as workers:
        bench.wait_ready(workers)
        ticks = tp.cpu_snapshot(workers)
        began = time.perf_counter()
        enqueue()
        committed = time.perf_counter()
        server_before = tp.server_snapshot()
        pids = history_server.our_backends()
        tp.wait_finished(bench, workers, jobs)
        wall = time.perf_counter() - committed
        cpu = tp.cpu_used(ticks, tp.cpu_snapshot(workers), jobs)
        server_after = tp.server_snapshot()
        server_cpu = tp.cpu_used(server_before, server_after, jobs)
        database_cpu = None
        if pids is not None:
            pids |= history_server.our_backends() or set()
            database_cpu = tp.cpu_used(
                {pid: t for pid, t in server_before.items() if pid in pids},
                {pid: t for pid, t in server_after.items() if pid in pids},
                jobs,
            )
    failed = bench.failed_count()
    if failed:
        raise RuntimeError(f"{label}: {failed:,} of {jobs:,} jobs did not succeed")
    first, last = bench.span()
    span = (last - first).total_seconds()
    drain = tp.Drain(jobs, jobs / span, span, wall, committed - began, {}, cpu, server_cpu)
    return Measured(drain, database_cpu)


def hot_paths(
    side: str,
    bench: HistoryOurs,
    sizes: Sizes,
    phases: set[str],
    log_dir: Path,
    report: Report,
    after_prune: bool = False,
) -> None:
    """The hot paths in ``phases``: on ``side``, or (``after_prune``) on the history right
    after the prune, each beside the empty database's figure of the same name. The plain
    drain goes first: the prune has just ended."""
    prefix = "after the prune: " if after_prune else ""

    def add(name: str, unit: str, value: float, note: str = "") -> None:
        if after_prune:
            report.add_against(prefix + name, unit, value, name)
        else:
            report.add(name, unit, side, value, note)

    label = f"{side}{'-after-prune' if after_prune else ''}"
    if "drain" in phases:
        progress(f"{label}: drain {sizes.drain:,}")
        measured = measured_drain(
            bench, sizes.drain, lambda: bench.enqueue_many(sizes.drain), log_dir, f"{label}-drain"
        )
        add(f"drain of {sizes.drain:,} no-op jobs", "jobs/s", measured.drain.rate)
        if not after_prune:
            cpu_figures(side, measured, report)
    if "keyed" in phases:
        progress(f"{label}: keyed drain {sizes.drain:,} over {KEYED_KEYS} keys")
        keyed = measured_drain(
            bench, sizes.drain, lambda: bench.enqueue_keyed(sizes.drain), log_dir, f"{label}-keyed"
        )
        name = f"drain, {KEYED_KEYS} keys of limit {KEYED_LIMIT}"
        add(name, "jobs/s", keyed.drain.rate)
    if "enqueue" in phases:
        progress(f"{label}: enqueue one by one, {sizes.enqueue:,}")
        add("enqueue one by one", "jobs/s", enqueue_rate(bench, sizes.enqueue))
    if "bulk" in phases:
        progress(f"{label}: bulk_enqueue {sizes.bulk_calls} x {sizes.bulk_size}")
        rate = bulk_rate(bench, sizes.bulk_calls, sizes.bulk_size)
        add(f"bulk_enqueue of {sizes.bulk_size}", "jobs/s", rate)
    if "latency" in phases:
        progress(f"{label}: latency, {sizes.latency_samples} samples")
        values = tp.latency(bench, sizes.latency_samples, sizes.latency_interval_ms, log_dir)
        cuts = tp.percentiles(values)
        add("enqueue-to-start latency p50", "ms", cuts["p50"])
        add("enqueue-to-start latency p95", "ms", cuts["p95"])


def cpu_figures(side: str, measured: Measured, report: Report) -> None:
    """The plain drain's CPU per job: the workers', and the database server's."""
    drain = measured.drain
    report.add(
        "worker CPU per job (plain drain)",
        "ms",
        side,
        drain.cpu["ms_per_job"],
        f"{side}: {tp.cpu_note(drain.cpu)}",
    )
    if connection.vendor == "sqlite":
        return
    server = measured.database_cpu or drain.server_cpu
    whole = drain.server_cpu
    what = (
        "this database's backends and the server's background processes"
        if measured.database_cpu is not None
        else "the whole mariadbd process (every client's)"
    )
    report.add(
        "server CPU per job (plain drain)",
        "ms",
        side,
        server["ms_per_job"],
        f"{side}: {what}, {server['cpu_s']:.2f} s; every server process: "
        f"{whole['ms_per_job']:.3f} ms/job",
    )


# --- admin, CLI --------------------------------------------------------------------------


def admin_phase(
    side: str, bench: HistoryOurs, repeat: int, report: Report
) -> list[admin_pages.PageResult]:
    """Plant, time every page and the metrics scrape, remove the planted rows."""
    bench.reset()
    planted = history_admin.plant()
    try:
        pages = history_admin.pages(planted, SEARCHES, CUSTOMER % CUSTOMERS, TASK_PATH)
        results = [admin_pages.PageResult("ours", name, url) for name, url in pages]
        with override_settings(ROOT_URLCONF="bench_urls"):
            admin_pages.measure(admin_pages.logged_in_client(), results, repeat)
        scrape = metrics_scrape(repeat)
        if scrape is None:
            report.notes.append("metrics scrape: not timed, prometheus_client is not installed")
        else:
            results.append(scrape)
    finally:
        bench.reset()
    errors = [
        f"{r.name}: {r.error.splitlines()[-1] if r.error else ''}" for r in results if r.error
    ]
    if errors:
        raise RuntimeError("admin pages failed: " + "; ".join(errors))
    for result in results:
        rows = f"{side}: {result.rows:,} rows listed" if result.rows is not None else ""
        report.add(f"admin: {result.name}", "ms", side, result.median_ms, rows)
        if result.median_ms > SLOW_MS:
            report.slow_pages.append(
                SlowPage(side, result.name, result.median_ms, result.slowest_ms, result.slowest_sql)
            )
    return results


def metrics_scrape(repeat: int) -> admin_pages.PageResult | None:
    """The metrics endpoint as Prometheus scrapes it: a GET with a bearer token."""
    if not any(str(p.pattern) == "jobs/metrics" for p in admin_pages.bench_urls.urlpatterns):
        return None
    result = admin_pages.PageResult("ours", "metrics scrape", history_admin.METRICS_URL)
    client = Client(headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    metrics = {"bearer_tokens": [METRICS_TOKEN]}
    with override_settings(ROOT_URLCONF="bench_urls", DJANGO_JOBS_METRICS=metrics):
        admin_pages.measure(client, [result], repeat)
    return result


def cli_phase(repeat: int) -> float:
    """Median seconds of ``manage.py jobs --json``, a fresh process each (its start included)."""
    times = []
    for _ in range(repeat + 1):
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(tp.MANAGE), "jobs", "--json"],
            cwd=ROOT,
            env=tp.worker_environment(),
            capture_output=True,
            text=True,
        )
        times.append(time.perf_counter() - began)
        if done.returncode != 0:
            raise RuntimeError(
                f"manage.py jobs --json exited {done.returncode}: {done.stderr[-2000:]}"
            )
    return statistics.median(times[1:])


# --- the prune ---------------------------------------------------------------------------


def prune_phase(
    bench: HistoryOurs, sizes: Sizes, phases: set[str], log_dir: Path, report: Report
) -> None:
    """Drain alone, drain while PRUNE_COMMAND runs; once it has ended, at once, the hot
    paths again while autovacuum (InnoDB's purge) works on what it deleted."""
    jobs = sizes.drain
    prune_command = (*PRUNE_COMMAND, "--rest", f"{OPTIONS.prune_rest:g}")
    command = " ".join(prune_command)
    before = tp.drain(bench, jobs, lambda: bench.enqueue_many(jobs), log_dir, "before-prune")
    history_before = Job.objects.filter(pk__lte=bench.floor).count()
    prune: dict[str, Any] = {}

    def plant() -> None:
        prune["began"] = time.perf_counter()
        prune["proc"] = subprocess.Popen(
            [sys.executable, str(tp.MANAGE), *prune_command],
            cwd=ROOT,
            env=tp.worker_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(1.0)  # its start (Django's setup) and first batches
        bench.enqueue_many(jobs)

    try:
        during = tp.drain(bench, jobs, plant, log_dir, "during-prune")
        drained_at = time.perf_counter()
    finally:
        proc = prune.get("proc")
        output = proc.communicate()[0] if proc else ""
    took = time.perf_counter() - prune["began"]
    if proc.returncode != 0:
        raise RuntimeError(f"{command} exited {proc.returncode}: {output[-2000:]}")
    deleted = history_before - Job.objects.filter(pk__lte=bench.floor).count()
    overlap = (
        "the drain ended before the prune"
        if drained_at <= prune["began"] + took
        else "the prune ended before the drain: the drain was partly alone"
    )
    watch = history_server.VacuumWatch(Job._meta.db_table).start()
    try:
        hot_paths("history", bench, sizes, phases | {"drain"}, log_dir, report, after_prune=True)
    finally:
        watch.stop()
    after = report.figure(f"after the prune: drain of {jobs:,} no-op jobs", "jobs/s").history
    report.add(f"{command}: jobs removed", "jobs", "history", deleted)
    report.add(f"{command}: wall time", "s", "history", took, "its process's start included")
    report.add(f"{command}: rate", "jobs/s", "history", deleted / took if took else 0.0)
    report.add("drain before the prune", "jobs/s", "history", before.rate)
    report.add("drain during the prune", "jobs/s", "history", during.rate, overlap)
    report.add("drain during / before the prune", "x", "history", during.rate / before.rate)
    report.add("drain after / before the prune", "x", "history", after / before.rate)
    report.notes.append(
        f"after the prune ({', '.join(p for p in HOT_PATHS if p in phases | {'drain'})}, "
        f"started as it ended): {watch.summary()}"
    )


# --- printing ----------------------------------------------------------------------------


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def print_table(report: Report) -> None:
    print("| figure | unit | empty | history | history / empty |")
    print("|---|---|---:|---:|---:|")
    for f in report.figures:
        ratio = f"{f.history / f.empty:.2f}x" if f.history is not None and f.empty else ""
        print(f"| {f.name} | {f.unit} | {number(f.empty)} | {number(f.history)} | {ratio} |")
    print("\nRates: history / empty >= 1 is as fast; times (ms, s): <= 1 is as fast.")
    for f in report.figures:
        if f.note:
            print(f"- {f.name}: {f.note}")
    for note in report.notes:
        print(f"- {note}")


def print_slow_pages(report: Report) -> None:
    if not report.slow_pages:
        return
    print(f"\nPages over {SLOW_MS} ms (median), with their slowest statement:")
    for page in report.slow_pages:
        sql = (
            page.slowest_sql if len(page.slowest_sql) <= 1500 else page.slowest_sql[:1500] + " ..."
        )
        print(
            f"\n[{page.side}] {page.name}: {page.median_ms:,.0f} ms; slowest statement "
            f"{page.slowest_ms:,.0f} ms:\n  {sql}"
        )


def print_sizes(
    built: list[history_server.Size] | None, end: list[history_server.Size] | None, rows: int
) -> None:
    """The relation sizes after the build (per million jobs of the history) and at the end."""
    if built is None:
        print("relation sizes: not available on this database (no dbstat)")
        return
    at_end = {size.table: size.total_mb for size in end or []}
    millions = rows / 1_000_000
    print(f'\nRelation sizes with {rows:,} finished jobs ("at the end": after the phases)')
    print("| table | data MB | indexes MB | total MB | MB per million jobs | total MB at the end |")
    print("|---|---:|---:|---:|---:|---:|")
    for size in built:
        per = size.total_mb / millions if millions else 0.0
        later = at_end.get(size.table)
        print(
            f"| {size.table} | {size.data_mb:,.1f} | {size.index_mb:,.1f} | "
            f"{size.total_mb:,.1f} | {per:,.1f} | {'-' if later is None else f'{later:,.1f}'} |"
        )
    total = sum(size.total_mb for size in built)
    print(f"| all | | | {total:,.1f} | {total / millions if millions else 0.0:,.1f} | |")


# --- main --------------------------------------------------------------------------------


def measure_side(
    side: str, bench: HistoryOurs, sizes: Sizes, phases: set[str], log_dir: Path, report: Report
) -> None:
    hot_paths(side, bench, sizes, phases, log_dir, report)
    if "admin" in phases:
        progress(f"{side}: admin pages")
        admin_phase(side, bench, sizes.admin_repeat, report)
    if "cli" in phases:
        progress(f"{side}: manage.py jobs --json")
        report.add("manage.py jobs --json", "s", side, cli_phase(sizes.cli_repeat))


def main() -> int:
    check_name(HISTORY_URL)
    empty_url = sibling_url(HISTORY_URL)
    check_name(empty_url)
    phases = set(OPTIONS.phases.split(","))
    sizes = SMOKE if OPTIONS.smoke else FULL
    sizes = replace(
        sizes, enqueue=OPTIONS.enqueue or sizes.enqueue, drain=OPTIONS.drain_jobs or sizes.drain
    )
    total = OPTIONS.jobs_history or (
        SMOKE_HISTORY if OPTIONS.smoke else DEFAULT_HISTORY.get(connection.vendor, 1_000_000)
    )
    log_dir = Path(tempfile.mkdtemp(prefix="jobs-history-"))
    report = Report()
    began = time.perf_counter()
    try:
        # The history first: its build is what --keep saves, and it must be there to count.
        use_database(HISTORY_URL)
        if OPTIONS.keep and history_present(total):
            progress(f"history: {total:,} jobs kept")
            build = None
        else:
            progress(f"history: building {total:,} jobs")
            build = build_history(total)
        floor = Job.objects.order_by("-pk").values_list("pk", flat=True)[:1][0]
        history_rows = Job.objects.filter(pk__lte=floor).count()
        failures = FailedExecution.objects.count()
        sizes_built = history_server.relation_sizes()

        use_database(empty_url)
        empty_bench = HistoryOurs(OPTIONS.processes, OPTIONS.threads, 0)
        measure_side("empty", empty_bench, sizes, phases - {"prune"}, log_dir, report)
        empty_bench.reset()

        use_database(HISTORY_URL)
        history_bench = HistoryOurs(OPTIONS.processes, OPTIONS.threads, floor)
        history_bench.reset()  # what an interrupted run may have left above the history
        measure_side("history", history_bench, sizes, phases - {"prune"}, log_dir, report)
        if "prune" in phases:
            progress("history: prune")
            prune_phase(history_bench, sizes, phases & set(HOT_PATHS), log_dir, report)
        history_bench.reset()
        sizes_end = history_server.relation_sizes()
    except (RuntimeError, tp.WorkerCrashed) as exc:
        print(f"FAILED: {exc}\nworker logs kept in {log_dir}", file=sys.stderr)
        return 1
    vacuum = history_server.autovacuum_off(connection, Job._meta.db_table)
    print(
        f"database: {connection.vendor} {tp.server_version()}, {database_name(HISTORY_URL)} "
        f"against {database_name(empty_url)}{f'; {vacuum}' if vacuum else ''}"
    )
    print(
        f"history: {history_rows:,} finished jobs ({failures:,} failures), over {HISTORY_DAYS} "
        f"days, {TASK_PATHS} task paths, {len(QUEUES)} queues"
    )
    if build:
        print(
            f"built in {build['insert_s']:.1f} s + {build['vacuum_analyze_checkpoint_s']:.1f} s "
            f"(analyze/vacuum/checkpoint): {total / build['insert_s']:,.0f} jobs/s"
        )
    else:
        print("history kept from an earlier run (--keep)")
    print(
        f"workers: run_jobs {OPTIONS.processes} processes x {OPTIONS.threads} threads; "
        f"sizes: {sizes}; load {os.getloadavg()[0]:.2f}\n"
    )
    print_table(report)
    print_slow_pages(report)
    print_sizes(sizes_built, sizes_end, history_rows)
    print(f"\nwhole run: {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
