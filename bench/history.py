"""What a big history of finished jobs costs: the same figures on a database holding it and empty.

    python bench/history.py [--jobs-history N] [--phases ...] [--smoke] [--keep]

Run from the repository root (Linux: bench/throughput.py's worker harness reads /proc).
``DATABASE_URL`` names the database (default: PostgreSQL's ``jobs_history`` on 127.0.0.1);
its name must contain "jobs_history": the run empties its django_jobs tables. The empty
side is a sibling database on the same server, the same name plus ``_empty`` (created and
migrated by the run), so that ``--keep`` can keep the history between runs.

The history (issue 37's shape): N finished jobs written by the server in bulk
(``INSERT ... SELECT`` over ``generate_series`` on PostgreSQL, MariaDB's sequence
table, a recursive CTE on SQLite; chunks of ``CHUNK`` rows on the last two), ids
in finish order, finished evenly over the last 14 days, 20 task paths, 5 queues,
``{"customer_id": n}`` keyword arguments over ``CUSTOMERS`` customers; every 10th job
failed with one ``FailedExecution``, the others succeeded, each with the columns the
worker writes (started, attempted and finished times, one attempt, the worker's id).
Then ``VACUUM ANALYZE`` and ``CHECKPOINT`` (PostgreSQL), ``ANALYZE TABLE`` (MariaDB),
a WAL checkpoint (SQLite). The build is timed.

Phases, each run on the empty database then on the history, in one run:
``enqueue`` (one by one), ``drain`` (N no-op jobs bulk-enqueued, drained by real
``run_jobs`` workers), ``latency`` (enqueue-to-start with idle workers), ``admin``
(dashboard, job list, a customer-id search, the failed filter, a failed job's page,
through Django's test client as bench/admin_pages.py does) and ``cli`` (``manage.py
jobs --json``, a subprocess). Phase ``prune`` (history only, last: it removes half
of it) drains alone, drains while ``prune_jobs --older-than 7d`` runs, and drains
after it, and times the prune. The workers run with the dispatcher's own pruning
(``clear_finished_jobs_after``) off, or they would prune the history as they start.
Figures are printed, never asserted; ratios are history / empty.
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/jobs_history"
SAFE_NAME_PART = "jobs_history"
EMPTY_SUFFIX = "_empty"
PHASES = ("enqueue", "drain", "latency", "admin", "cli", "prune")
DEFAULT_HISTORY = {"postgresql": 1_000_000, "mysql": 300_000, "sqlite": 200_000}
SMOKE_HISTORY = 20_000
HISTORY_DAYS = 14
PRUNE_AGE = "7d"
TASK_PATHS = 20
QUEUES = ("default", "emails", "reports", "reports-daily", "slow")  # the test project's
CUSTOMERS = 100_000
FAILED_EVERY = 10
SLOW_MS = 100  # an admin page's slowest statement is printed past this
CHUNK = 200_000  # rows per INSERT on MariaDB and SQLite
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
    enqueue: int
    drain: int
    latency_samples: int
    latency_interval_ms: float
    admin_repeat: int
    cli_repeat: int


FULL = Sizes(2_000, 10_000, 200, 30.0, 5, 3)
SMOKE = Sizes(200, 1_000, 20, 30.0, 2, 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs-history",
        type=int,
        help="finished jobs in the history (1,000,000 PostgreSQL, 300,000 MariaDB, "
        f"200,000 SQLite; {SMOKE_HISTORY:,} with --smoke)",
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
from django.test import override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import admin_pages  # noqa: E402  (its stock admin and URLconf come along)
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
    parts = urlsplit(url)
    head, _, name = parts.path.rpartition("/")
    stem, dot, ext = name.partition(".")
    return urlunsplit(parts._replace(path=f"{head}/{stem}{EMPTY_SUFFIX}{dot}{ext}"))


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
    chunk = total if connection.vendor == "postgresql" else CHUNK
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
            Job.objects.filter(pk__gt=self.floor).delete()

    def commands(self) -> list[list[str]]:
        flags = ["--processes", str(self.processes), "--threads", str(self.threads)]
        return [[sys.executable, "-c", WORKER_BOOT, "run_jobs", *flags]]

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
class Report:
    figures: list[Figure] = field(default_factory=list)

    def add(self, name: str, unit: str, side: str, value: float, note: str = "") -> None:
        for figure in self.figures:
            if figure.name == name:
                break
        else:
            figure = Figure(name, unit)
            self.figures.append(figure)
        setattr(figure, side, value)
        if note:
            figure.note = note


def enqueue_phase(bench: HistoryOurs, count: int) -> float:
    bench.reset()
    noop.enqueue()  # warm-up: first statements, first plans

    def enqueue(n: int) -> int:
        for _ in range(n):
            noop.enqueue()
        return n

    rate = tp.timed_in_pieces(count, enqueue).median
    tp.check_rows(bench, count + 1)
    return rate


def drain_once(
    bench: HistoryOurs,
    jobs: int,
    log_dir: Path,
    label: str,
    plant: Callable[[], None] | None = None,
) -> tp.Drain:
    return tp.drain(bench, jobs, plant or (lambda: bench.enqueue_many(jobs)), log_dir, label)


def failed_job_id() -> int | None:
    return (
        Job.objects.filter(status=JobStatus.FAILED)
        .order_by("-pk")
        .values_list("pk", flat=True)
        .first()
    )


def admin_phase(repeat: int, customer: int) -> list[admin_pages.PageResult]:
    base = "/admin/django_jobs"
    failed = failed_job_id()
    pages = [
        ("dashboard", f"{base}/dashboard/"),
        ("job list", f"{base}/job/"),
        (f"job list, ?q=customer {customer}", f"{base}/job/?q=%22customer_id%22%3A+{customer}%7D"),
        ("job list, failed", f"{base}/job/?status=failed"),
    ]
    if failed is not None:
        pages.append(("failed job page", f"{base}/job/{failed}/change/"))
    results = [admin_pages.PageResult("ours", name, url) for name, url in pages]
    client = admin_pages.logged_in_client()
    with override_settings(ROOT_URLCONF="bench_urls"):
        admin_pages.measure(client, results, repeat)
    errors = [
        f"{r.name}: {r.error.splitlines()[-1] if r.error else ''}" for r in results if r.error
    ]
    if errors:
        raise RuntimeError("admin pages failed: " + "; ".join(errors))
    return results


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


def prune_phase(bench: HistoryOurs, jobs: int, log_dir: Path, report: Report) -> None:
    """Drain alone, drain while prune_jobs runs, drain after; time the prune."""
    before = tp.drain(bench, jobs, lambda: bench.enqueue_many(jobs), log_dir, "before-prune")
    history_before = Job.objects.filter(pk__lte=bench.floor).count()
    prune: dict[str, Any] = {}

    def plant() -> None:
        prune["began"] = time.perf_counter()
        prune["proc"] = subprocess.Popen(
            [sys.executable, str(tp.MANAGE), "prune_jobs", "--older-than", PRUNE_AGE],
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
        raise RuntimeError(f"prune_jobs exited {proc.returncode}: {output[-2000:]}")
    deleted = history_before - Job.objects.filter(pk__lte=bench.floor).count()
    overlap = (
        "the drain ended before the prune"
        if drained_at <= prune["began"] + took
        else ("the prune ended before the drain: the drain was partly alone")
    )
    after = tp.drain(bench, jobs, lambda: bench.enqueue_many(jobs), log_dir, "after-prune")
    report.add("drain before the prune", "jobs/s", "history", before.rate)
    report.add("drain during the prune", "jobs/s", "history", during.rate, overlap)
    report.add("drain after the prune", "jobs/s", "history", after.rate)
    report.add(f"prune_jobs --older-than {PRUNE_AGE}: jobs removed", "jobs", "history", deleted)
    report.add("prune_jobs: wall time", "s", "history", took)
    report.add("prune_jobs: rate", "jobs/s", "history", deleted / took if took else 0.0)
    report.add("drain during / before the prune", "x", "history", during.rate / before.rate)
    report.add("drain after / before the prune", "x", "history", after.rate / before.rate)


def measure_side(
    side: str,
    bench: HistoryOurs,
    sizes: Sizes,
    phases: set[str],
    log_dir: Path,
    report: Report,
    customer: int,
) -> None:
    if "enqueue" in phases:
        progress(f"{side}: enqueue one by one, {sizes.enqueue:,}")
        report.add("enqueue one by one", "jobs/s", side, enqueue_phase(bench, sizes.enqueue))
    if "drain" in phases:
        progress(f"{side}: drain {sizes.drain:,}")
        result = drain_once(bench, sizes.drain, log_dir, f"{side}-drain")
        report.add(f"drain of {sizes.drain:,} no-op jobs", "jobs/s", side, result.rate)
    if "latency" in phases:
        progress(f"{side}: latency, {sizes.latency_samples} samples")
        values = tp.latency(bench, sizes.latency_samples, sizes.latency_interval_ms, log_dir)
        report.add("enqueue-to-start latency p50", "ms", side, statistics.median(values))
    if "admin" in phases:
        progress(f"{side}: admin pages")
        bench.reset()
        for result in admin_phase(sizes.admin_repeat, customer):
            note = f"{side}: {result.rows} rows listed" if result.rows is not None else ""
            if result.slowest_ms > SLOW_MS:
                note += f"; slowest SQL {result.slowest_ms:.0f} ms: {result.slowest_sql[:300]}"
            report.add(f"admin: {result.name}", "ms", side, result.median_ms, note)
    if "cli" in phases:
        progress(f"{side}: manage.py jobs --json")
        report.add("manage.py jobs --json", "s", side, cli_phase(sizes.cli_repeat))


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
    notes = [(f.name, f.note) for f in report.figures if f.note]
    for name, note in notes:
        print(f"- {name}: {note}")


def main() -> int:
    check_name(HISTORY_URL)
    empty_url = sibling_url(HISTORY_URL)
    check_name(empty_url)
    phases = set(OPTIONS.phases.split(","))
    sizes = SMOKE if OPTIONS.smoke else FULL
    sizes = Sizes(
        OPTIONS.enqueue or sizes.enqueue,
        OPTIONS.drain_jobs or sizes.drain,
        sizes.latency_samples,
        sizes.latency_interval_ms,
        sizes.admin_repeat,
        sizes.cli_repeat,
    )
    total = OPTIONS.jobs_history or (
        SMOKE_HISTORY if OPTIONS.smoke else DEFAULT_HISTORY.get(connection.vendor, 200_000)
    )
    log_dir = Path(tempfile.mkdtemp(prefix="jobs-history-"))
    report = Report()
    customer = 4242 % CUSTOMERS
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
        table_size = relation_sizes()

        use_database(empty_url)
        empty_bench = HistoryOurs(OPTIONS.processes, OPTIONS.threads, 0)
        measure_side("empty", empty_bench, sizes, phases - {"prune"}, log_dir, report, customer)
        empty_bench.reset()

        use_database(HISTORY_URL)
        history_bench = HistoryOurs(OPTIONS.processes, OPTIONS.threads, floor)
        measure_side("history", history_bench, sizes, phases - {"prune"}, log_dir, report, customer)
        if "prune" in phases:
            progress("history: prune")
            prune_phase(history_bench, sizes.drain, log_dir, report)
        history_bench.reset()
    except (RuntimeError, tp.WorkerCrashed) as exc:
        print(f"FAILED: {exc}\nworker logs kept in {log_dir}", file=sys.stderr)
        return 1
    print(
        f"database: {connection.vendor} {tp.server_version()}, {database_name(HISTORY_URL)} "
        f"against {database_name(empty_url)}"
    )
    print(
        f"history: {history_rows:,} finished jobs ({failures:,} failures), over {HISTORY_DAYS} "
        f"days, {TASK_PATHS} task paths, {len(QUEUES)} queues; {table_size}"
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
    print(f"\nwhole run: {time.perf_counter() - began:.1f} s")
    return 0


def relation_sizes() -> str:
    """The job table's size with its indexes, where the server tells it."""
    table = Job._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_size_pretty(pg_total_relation_size(%s))", [table])
            return f"{table} {cursor.fetchone()[0]} with indexes"
        if connection.vendor == "mysql":
            cursor.execute(
                "SELECT ROUND((data_length + index_length) / 1048576) "
                "FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = %s",
                [table],
            )
            return f"{table} about {cursor.fetchone()[0]} MB with indexes"
    return f"{table} size not read on {connection.vendor}"


if __name__ == "__main__":
    sys.exit(main())
