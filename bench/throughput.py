"""Throughput and latency of django-jobs against its peers and the database's limit, in one run.

    python bench/throughput.py [--db postgres|mariadb|sqlite] [--smoke] [--json PATH]

Run from the repository root (Linux: workers are found and measured in /proc).
The database is ``--db``'s, else ``DATABASE_URL``'s, else PostgreSQL's
``jobs_throughput`` on 127.0.0.1; it is created if missing and migrated, and
its name must contain "throughput" or "bench": every phase empties the tables
of both apps first, so that no phase sees another's rows.

Each phase times ours and django-tasks-db (the peer) through the same code, on
the same database, in the same run: enqueue one by one, bulk enqueue, drain N
no-op jobs by real worker processes (``run_jobs`` and ``db_worker`` started as
subprocesses), drain jobs with concurrency keys (ours only), latency from
enqueue to start with idle workers, and claim rate with a big table against
an empty one. Phases "procrastinate" and "oban" (PostgreSQL only) put
Procrastinate and Oban for Python, the other peers, through the same enqueue,
drain and latency. Every drain also reads the CPU time its workers' processes
spent, and the local database server's (/proc), printed per job: on a machine
whose cores are all busy, their sum bounds the drain. Phase "limit"
(PostgreSQL only) drains the same number of jobs with a minimal raw-SQL queue
(bench/limit_queue.py) and the same processes x threads: every drain is also
printed as a share of that ceiling. Phase "concurrent" compares ours with ours
(PostgreSQL only): N concurrent enqueuing processes with LISTEN/NOTIFY on
against off; phase "prefix" times concurrent claims with a ``reports*``
selector against ``*``; phase "workflow" enqueues and drains N no-op jobs as
one workflow, a fan-out then a fan-in, against ``bulk_enqueue()`` and a plain
drain of N (ours against ours, every database); phase "async" (issue 39) drains
``async def`` jobs that await a sleep on the workers' event loops against our
no-op drain, against running them on threads, and (PostgreSQL) against
Procrastinate's and Oban's async workers, and reads the workers' memory and
connections with N of them in flight; phase "fair" (issue 38) puts one tenant's backlog
in a fair queue and in one that is not, with 20 other tenants arriving behind it, and
drains and enqueues with fair keys against the same without. The table prints each figure
of ours with its ratio against each peer's, > 1 meaning ours is better (rates:
ours / peer; times and memory: peer / ours). The machine is noisy: read the
ratios, not absolute figures. Figures are printed, never asserted; a phase
that fails (a worker dies, a job fails, the queue stalls) ends the run
non-zero, with every worker stopped.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import itertools
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import IO, Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
MANAGE = ROOT / "testproject" / "manage.py"
SETTINGS = "bench.settings"
DATABASE_URLS = {
    "postgres": "postgres://postgres@127.0.0.1:5432/jobs_throughput",
    "mariadb": "mysql://root@127.0.0.1:3306/jobs_throughput",
    "sqlite": "sqlite:////tmp/jobs_throughput.sqlite3",
}
SAFE_NAME_PARTS = ("throughput", "bench")
# In the order they run: the limit drain right before ours, so the two meet the same machine.
PHASES = (
    "enqueue",
    "concurrent",
    "bulk",
    "limit",
    "drain",
    "keyed",
    "rated",
    "workflow",
    "procrastinate",
    "oban",
    "async",
    "latency",
    "claims",
    "prefix",
    "fair",
)
SMOKE_SKIPS = {
    "procrastinate": "its enqueue, drain and latency take too long for the smoke run (phase "
    "async drains it once, briefly)"
}
PEER = "peer"  # the TASKS alias of django-tasks-db in bench/settings.py
PEER_QUEUE = "default"  # db_worker's default --queue-name, where peer_noop goes
PROCRASTINATE_FLAG = "JOBS_BENCH_PROCRASTINATE"  # bench/settings.py installs its app with it
PROCRASTINATE_APP = "procrastinate.contrib.django"
OBAN_QUEUE = "default"  # the queue of bench/oban_tasks.py's Noop, the one its workers run
PREFIX_PATTERN = "reports*"
PREFIX_QUEUES = ("reports", "reports-daily")  # declared in testproject/settings.py
# Phase "async": worker processes of each setup (the issue's 2, whatever the CPU count),
# Procrastinate's concurrencies (docs/howto/production/concurrency.md's example,
# ``--concurrency=30``; then ours' async_jobs default, 200 at once per process) and the
# most connections per Procrastinate process (its docs' concurrency + 1 would take 402
# of a server's 100 at 200; "the longer your job time, the smaller your pool may be").
ASYNC_PROCESSES = 2
PROCRASTINATE_ASYNC_CONCURRENCY = (30, 200)
PROCRASTINATE_POOL_CAP = 31
OBAN_ASYNC_LIMIT = 200  # Oban's queue limit in phase async: ours' async_jobs

POLL = 0.25  # seconds between counts of finished jobs while waiting
SETTLE = 1.0  # seconds given to started workers to go idle before jobs arrive
PEER_STARTUP_DELAY = 1.0  # db_worker sleeps up to this long before its first poll
START_TIMEOUT = 60.0
STALL_TIMEOUT = 120.0  # no job finished for this long: the drain failed
STOP_TIMEOUT = 20.0  # run_jobs' shutdown timeout (5 s) plus its children's
LATENCY_WARMUP = 10  # jobs run before the latency samples: first imports, first plans
PIECES = 10  # timed pieces of the in-process rates, whose median is reported
# The limit drains N jobs in well under a second: its figure is the median of this many drains.
LIMIT_DRAINS = 3
DEFAULT_THREADS = 8  # run_jobs --threads; --processes defaults to the CPU count
# Rounds of each enqueue (bulk, workflow), alternated, in phase "workflow"; the median counts.
WORKFLOW_ENQUEUES = 3
WORKFLOW_NAME = "bench fan-out/in"


@dataclass(frozen=True)
class Sizes:
    """How much work each phase does; printed with the figures."""

    enqueue: int  # jobs enqueued one by one
    jobs: int  # jobs bulk-enqueued, then drained
    keys: int  # concurrency keys (limit 1) of the keyed drain
    latency_samples: int
    latency_interval_ms: float
    finished: int  # finished rows present in the big-table claim phase
    ready: int  # ready rows present in the big-table claim phase
    claims: int  # jobs claimed in each claim phase
    claim_batch: int  # jobs per claim of ours
    clients: int  # concurrent enqueuing processes
    client_seconds: float  # each enqueues one by one for this long per round
    client_rounds: int  # rounds of each LISTEN/NOTIFY setting, alternated


FULL = Sizes(2_000, 20_000, 1_000, 200, 30.0, 1_000_000, 100_000, 10_000, 0, 8, 5.0, 2)
SMOKE = Sizes(100, 1_000, 50, 20, 30.0, 20_000, 2_000, 500, 0, 2, 1.0, 1)
FLOAT_SIZES = ("latency_interval_ms", "client_seconds")


@dataclass(frozen=True)
class AsyncSizes:
    """Phase "async"'s sizes (issue 39); printed with its figures."""

    jobs: int  # async jobs of ``sleep_s`` drained (and no-op jobs, for the reference)
    sleep_s: float  # each job's await asyncio.sleep()
    # The same jobs drained the old way (--async-jobs 0; 0: not at all): 16 threads make
    # 80 jobs/s at most, so fewer jobs say as much.
    threaded_jobs: int
    in_flight: int  # async jobs held in flight at once for the memory figure
    in_flight_s: float  # how long each of those sleeps
    load: int  # async jobs in flight while the latency probes run


ASYNC_FULL = AsyncSizes(10_000, 0.2, 2_000, 1_000, 10.0, 300)
ASYNC_SMOKE = AsyncSizes(200, 0.2, 0, 100, 1.0, 50)
ASYNC_FLOAT_SIZES = ("sleep_s", "in_flight_s")


@dataclass(frozen=True)
class FairSizes:
    """Phase "fair"'s own sizes (issue 38); its drains take --jobs over --keys tenants and
    its one-by-one enqueues --enqueue, the other phases' flags."""

    backlog: int  # tenant A's jobs, one bulk enqueue, before the others arrive
    tenants: int  # the other tenants, arriving while A's backlog is being drained
    tenant_jobs: int  # jobs of each of them, in each of the two rounds (bulk, one by one)
    rounds: int  # pairs of drains (fair, non-fair), alternated: F N, N F, ...


FAIR_FULL = FairSizes(50_000, 20, 50, 2)
FAIR_SMOKE = FairSizes(5_000, 5, 20, 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=sorted(DATABASE_URLS), help="default: DATABASE_URL")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures here")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs")
    sizes = parser.add_argument_group("sizes (defaults: full run / --smoke)")
    for name, what in (
        ("enqueue", "jobs enqueued one by one"),
        ("jobs", "jobs bulk-enqueued and drained"),
        ("keys", "concurrency keys of the keyed drain"),
        ("latency-samples", "jobs timed from enqueue to start"),
        ("latency-interval-ms", "ms between two of those enqueues"),
        ("finished", "finished rows in the big-table claim phase"),
        ("ready", "ready rows in the big-table claim phase"),
        ("claims", "jobs claimed per claim phase"),
        ("claim-batch", "jobs per claim of ours (default: --threads)"),
        ("clients", "concurrent enqueuing processes"),
        ("client-seconds", "seconds each of them enqueues per round"),
        ("client-rounds", "rounds of each LISTEN/NOTIFY setting"),
    ):
        attr = name.replace("-", "_")
        kind = float if attr in FLOAT_SIZES else int
        full, smoke = getattr(FULL, attr), getattr(SMOKE, attr)
        sizes.add_argument(f"--{name}", type=kind, help=f"{what} ({full:,} / {smoke:,})")
    for name, what in (
        ("jobs", "async jobs drained (and no-op jobs, the reference)"),
        ("sleep-s", "seconds each of them awaits asyncio.sleep()"),
        ("threaded-jobs", "async jobs drained the old way (--async-jobs 0)"),
        ("in-flight", "async jobs in flight at once for the memory figure"),
        ("in-flight-s", "seconds each of those sleeps"),
        ("load", "async jobs in flight while the latency probes run"),
    ):
        attr = name.replace("-", "_")
        kind = float if attr in ASYNC_FLOAT_SIZES else int
        full, smoke = getattr(ASYNC_FULL, attr), getattr(ASYNC_SMOKE, attr)
        sizes.add_argument(
            f"--async-{name}", type=kind, help=f"phase async: {what} ({full:,} / {smoke:,})"
        )
    for name, what in (
        ("backlog", "tenant A's jobs, one bulk enqueue"),
        ("tenants", "other tenants arriving behind A's backlog"),
        ("tenant-jobs", "jobs of each of them, per round"),
        ("rounds", "pairs of drains, fair and non-fair, alternated"),
    ):
        attr = name.replace("-", "_")
        full, smoke = getattr(FAIR_FULL, attr), getattr(FAIR_SMOKE, attr)
        sizes.add_argument(
            f"--fair-{name}", type=int, help=f"phase fair: {what} ({full:,} / {smoke:,})"
        )
    workers = parser.add_argument_group("workers")
    workers.add_argument("--processes", type=int, help="run_jobs --processes (CPU count)")
    workers.add_argument("--threads", type=int, help=f"run_jobs --threads ({DEFAULT_THREADS})")
    workers.add_argument("--peer-processes", type=int, default=2, help="db_worker processes (2)")
    workers.add_argument(
        "--limit-batch",
        type=int,
        help="jobs per claim of a limit-phase worker process (2 x --threads: ours' crash bound)",
    )
    workers.add_argument(
        "--procrastinate-task",
        choices=("async", "sync"),
        default="async",
        help="Procrastinate's no-op task: async (its recommended form) or sync",
    )
    workers.add_argument(
        "--procrastinate-concurrency",
        default=",".join(str(c) for c in PROCRASTINATE_ASYNC_CONCURRENCY),
        help="phase async: Procrastinate's sub-workers per process, one drain each "
        "(30, its docs' example, and 200, ours' async_jobs; smoke: the first only)",
    )
    workers.add_argument(
        "--procrastinate-pool",
        type=int,
        default=PROCRASTINATE_POOL_CAP,
        help=f"phase async: at most this many connections per Procrastinate process "
        f"(its docs: concurrency + 1; {PROCRASTINATE_POOL_CAP})",
    )
    # One of the concurrent enqueuing processes of phase "concurrent" (started by the run).
    parser.add_argument("--enqueue-client", action="store_true", help=argparse.SUPPRESS)
    # One tenant's enqueuing process of phase "fair" (started by the run).
    parser.add_argument("--tenant-client", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    unknown = set(options.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    return options


OPTIONS = parse_args()

# Settings are read at django.setup(), so the environment must be ready before it.
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
if OPTIONS.db:
    os.environ["DATABASE_URL"] = DATABASE_URLS[OPTIONS.db]
os.environ.setdefault("DATABASE_URL", DATABASE_URLS["postgres"])
# Procrastinate's app (and its migrations) only when its phase runs; bench/settings.py also
# requires PostgreSQL and the package. Workers of ours and of the peer never get it.
_phases = OPTIONS.phases.split(",")
if not (OPTIONS.enqueue_client or OPTIONS.tenant_client) and (
    ("procrastinate" in _phases and not OPTIONS.smoke) or "async" in _phases
):
    # Phase async runs Procrastinate in smoke too: one short drain, its schema ~1 s.
    os.environ[PROCRASTINATE_FLAG] = "true"
else:
    os.environ.pop(PROCRASTINATE_FLAG, None)

import django  # noqa: E402

django.setup()

from django.apps import apps  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, models, transaction  # noqa: E402
from django.db.models import Max, Min  # noqa: E402
from django.tasks import TaskResultStatus, task_backends  # noqa: E402
from django.utils import timezone  # noqa: E402
from django_tasks_db.models import DBTaskResult, get_date_max  # noqa: E402
from django_tasks_db.utils import exclusive_transaction  # noqa: E402

from bench.connections import held_connections  # noqa: E402
from bench.fair_tasks import FAIR_QUEUE, fair_noop, tenant_noop  # noqa: E402
from bench.tables import analyze as analyze_tables  # noqa: E402
from bench.tables import empty, tables_of  # noqa: E402
from bench.tasks import (  # noqa: E402
    noop,
    noop_async,
    noop_keyed,
    noop_rated,
    peer_noop,
    sleep_async,
)
from django_jobs import bulk_enqueue, workflow  # noqa: E402
from django_jobs.backend import JobsBackend  # noqa: E402
from django_jobs.conf import JobsSettings  # noqa: E402
from django_jobs.core.processes import register_process  # noqa: E402
from django_jobs.core.queues import QueueSelector  # noqa: E402
from django_jobs.core.ready import claim_jobs  # noqa: E402
from django_jobs.core.workflows import WorkflowResult  # noqa: E402
from django_jobs.models import FINISHED_STATUSES, Job, JobStatus, Process, ReadyExecution  # noqa: E402
from tests.harness import create_server_database  # noqa: E402

DB = "default"


def progress(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(f"- {message}", file=sys.stderr, flush=True)


# --- the database ----------------------------------------------------------------------


def database_name() -> str:
    name = str(settings.DATABASES[DB]["NAME"])
    return Path(name).name if connection.vendor == "sqlite" else name


def check_database_name() -> None:
    """Refuse a database that might be someone's: every phase empties the tables."""
    name = database_name()
    if not any(part in name for part in SAFE_NAME_PARTS):
        raise SystemExit(
            f"refusing to empty tables of database {name!r}: its name must contain "
            f"{' or '.join(repr(p) for p in SAFE_NAME_PARTS)} (e.g. jobs_throughput)"
        )


def create_database() -> None:
    """Create the server's database if it is missing (SQLite creates its file itself)."""
    create_server_database(database_name())


def app_tables(labels: tuple[str, ...] | None = None) -> list[str]:
    """Every table of these apps; ours and the peer's by default."""
    return tables_of(*(labels or ("django_jobs", DBTaskResult._meta.app_label)))


def reset_tables() -> None:
    """Empty every queue's tables (TRUNCATE where there is one), so phases never share rows."""
    tables = app_tables()
    if apps.is_installed(PROCRASTINATE_APP):
        tables += app_tables(("procrastinate",))  # its models are unmanaged, its tables real
    empty(tables)


def analyze() -> None:
    """Every queue's tables given the statistics of tables in service (``tables.analyze``)."""
    analyze_tables(app_tables())


def series(count: int) -> tuple[str, list[int]]:
    """A FROM clause yielding ``count`` rows, the fastest way each database has."""
    if connection.vendor == "postgresql":
        return "generate_series(1, %s) AS series(n)", [count]
    if connection.vendor == "mysql" and connection.mysql_is_mariadb:
        return f"seq_1_to_{int(count)} AS series", []  # the Sequence engine's virtual table
    if connection.vendor == "sqlite":
        recursive = "WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < %s)"
        return f"({recursive} SELECT n FROM s) AS series", [count]
    raise SystemExit(f"planting rows on {connection.vendor} is not supported")


def random_uuid_sql() -> str:
    """SQL for a fresh UUID per row, in the column type Django gave UUIDField here."""
    if connection.vendor == "postgresql":
        return "gen_random_uuid()"
    if connection.vendor == "mysql":
        native = connection.data_types["UUIDField"] == "uuid"
        return "UUID()" if native else "REPLACE(UUID(), '-', '')"
    return "lower(hex(randomblob(16)))"


def insert_series(
    model: type[models.Model], count: int, template: models.Model, expressions: dict[str, str]
) -> None:
    """INSERT ``count`` copies of ``template`` in one statement, generated by the server.

    Columns in ``expressions`` take that SQL instead (a fresh id per row);
    the auto primary key and NULL columns are left to the database.
    """
    if count <= 0:
        return
    columns, values, params = [], [], []
    for column in model._meta.concrete_fields:
        if column.column in expressions:
            columns.append(column.column)
            values.append(expressions[column.column])
            continue
        value = getattr(template, column.attname)
        if column is model._meta.pk or value is None:
            continue
        columns.append(column.column)
        values.append("%s")
        params.append(column.get_db_prep_save(value, connection))
    source, source_params = series(count)
    quoted = ", ".join(connection.ops.quote_name(c) for c in columns)
    table = connection.ops.quote_name(model._meta.db_table)
    sql = f"INSERT INTO {table} ({quoted}) SELECT {', '.join(values)} FROM {source}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, *source_params])


def server_version() -> str:
    query = "SELECT sqlite_version()" if connection.vendor == "sqlite" else "SELECT version()"
    with connection.cursor() as cursor:
        cursor.execute(query)
        return str(cursor.fetchone()[0]).split(" on ")[0]


# --- worker processes ------------------------------------------------------------------


def worker_environment(**extra: str) -> dict[str, str]:
    """The harness's environment for a worker, without Procrastinate's app unless ``extra``
    asks for it."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop(PROCRASTINATE_FLAG, None)
    return {**env, **extra}


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of a process, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[3])


def session_members(sessions: set[int]) -> list[int]:
    """Live processes of these sessions: a command's children too, whatever group they move to.

    run_jobs' children leave the supervisor's process group (so a Ctrl-C
    reaches only it) but never its session, which is how leftovers are found.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and stat[1] in sessions:
                members.append(int(entry.name))
    return sorted(members)


def rss_mb(pid: int) -> float:
    """Resident memory of a process (VmRSS), in MB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pss_mb(pid: int) -> float:
    """Proportional memory of a process (Pss of /proc/PID/smaps_rollup), in MB; 0 if it is
    gone. Each page it maps counts divided by the number of processes mapping it, so the
    PSS of a group of processes sums to the memory they use together: RSS counts a page
    that forked processes share copy-on-write once in every one of them."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process, in MB."""
    return rss_mb(pid), pss_mb(pid)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # units of /proc/PID/stat's CPU times


def cpu_ticks(pid: int) -> int | None:
    """CPU time of a process in clock ticks, None if it is gone: utime + stime (fields 14
    and 15 of /proc/PID/stat, every thread's) plus cutime + cstime (16, 17: those of its
    children it has waited for). The children's share keeps a worker process that exits
    during a drain (recycled) in the sum once its parent, also a worker, reaps it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3, the state
    return sum(int(value) for value in fields[11:15])


def cpu_snapshot(workers: Workers) -> dict[int, int]:
    """Clock ticks so far of every live process of the workers' sessions, by pid."""
    ticks = {pid: cpu_ticks(pid) for pid in workers.members()}
    return {pid: value for pid, value in ticks.items() if value is not None}


def cpu_used(before: dict[int, int], after: dict[int, int], jobs: int) -> dict[str, Any]:
    """Worker CPU between two snapshots, summed over every process, and per job.

    A process that started in between counts from zero. One that ended in
    between is missing from ``after``: its ticks reached its parent's cutime
    and cstime if a process of the sessions reaped it (how run_jobs recycles
    a worker), and are lost otherwise; the note says how many ended.
    """
    ticks = sum(after.values()) - sum(before.get(pid, 0) for pid in after)
    ended = [pid for pid in before if pid not in after]
    seconds = ticks / CLOCK_TICKS
    return {
        "ms_per_job": seconds * 1000 / jobs,
        "cpu_s": seconds,
        "processes": len(after),
        "started": len([pid for pid in after if pid not in before]),
        "ended": len(ended),
        "clock_ticks_per_s": CLOCK_TICKS,
    }


# Command names (/proc/PID/comm) of a local database server's processes, by vendor.
SERVER_COMMANDS = {"postgresql": ("postgres",), "mysql": ("mariadbd", "mysqld")}


def server_snapshot() -> dict[int, int]:
    """Clock ticks so far of every process of the local database server the bench uses,
    by pid (empty if it runs elsewhere). PostgreSQL's backends keep the command name
    ``postgres`` whatever their title says; MariaDB is one process."""
    names = SERVER_COMMANDS.get(connection.vendor, ())
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if command in names and (value := cpu_ticks(int(entry.name))) is not None:
            ticks[int(entry.name)] = value
    return ticks


def cpu_note(cpu: dict[str, Any]) -> str:
    ended = f", {cpu['ended']} ended during it" if cpu["ended"] else ""
    return f"{cpu['cpu_s']:.2f} s over {cpu['processes']} processes{ended}"


class WorkerCrashed(RuntimeError):
    pass


class Workers:
    """Worker commands run as subprocesses, each the leader of a new session.

    Leaving the block, normally or not, sends SIGTERM to each command (a
    process manager's stop), waits for the sessions to empty, SIGKILLs what
    is left and fails if anything survives that.
    """

    def __init__(
        self,
        commands: list[list[str]],
        log_dir: Path,
        label: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.commands = commands
        self.env = env or worker_environment()
        self.logs = [log_dir / f"{label}-{n}.log" for n in range(len(commands))]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.files: list[IO[bytes]] = []

    def __enter__(self) -> Workers:
        try:
            for command, log in zip(self.commands, self.logs, strict=True):
                self.files.append(log.open("wb"))
                self.procs.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env=self.env,
                        stdin=subprocess.DEVNULL,
                        stdout=self.files[-1],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def sessions(self) -> set[int]:
        return {proc.pid for proc in self.procs}

    def members(self) -> list[int]:
        return session_members(self.sessions)

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=False):
            if proc.poll() is not None:
                raise WorkerCrashed(
                    f"{' '.join(proc.args[2:])} exited with {proc.returncode}; "
                    f"its log ends:\n{tail(log)}"
                )

    def log_text(self) -> list[str]:
        return [log.read_text(errors="replace") for log in self.logs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT
        while self.reap() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.members():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.wait(10)
        for file in self.files:
            file.close()
        deadline = time.monotonic() + 5
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.members():
            raise RuntimeError(f"worker processes left behind: {self.members()}")

    def reap(self) -> list[int]:
        """Collect exited commands; return the sessions' live processes."""
        for proc in self.procs:
            proc.poll()
        return self.members()


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until(condition: Callable[[], bool], workers: Workers, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        workers.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL)


def wait_finished(bench: Bench, workers: Workers, total: int) -> None:
    """Poll until ``total`` jobs are finished; fail if the count stops moving."""
    last, moved = -1, time.monotonic()
    while (done := bench.finished_count()) < total:
        workers.check_alive()
        if done != last:
            last, moved = done, time.monotonic()
        elif time.monotonic() - moved > STALL_TIMEOUT:
            raise RuntimeError(f"{bench.name}: stalled at {done:,}/{total:,} finished jobs")
        time.sleep(POLL)


# --- the two backends, behind one interface --------------------------------------------


@dataclass
class Drain:
    """One drain: rate from the rows' own timestamps, wall time as the harness saw it."""

    jobs: int
    rate: float  # jobs / (last finished_at - first started_at)
    span_s: float
    wall_s: float  # from the enqueue's commit to the poll that saw all finished
    plant_s: float
    rss: dict[str, Any] = field(default_factory=dict)
    # User + system CPU of every process of the workers' sessions, from just before the
    # enqueue's commit to the poll that saw all finished (see cpu_used).
    cpu: dict[str, Any] = field(default_factory=dict)
    # The database server's, from the enqueue's commit to the same poll: what the jobs'
    # claims and finishes cost it (plus the harness's polls of the count, a few a second).
    server_cpu: dict[str, Any] = field(default_factory=dict)


class Bench(Protocol):
    name: str

    def reset(self) -> None: ...
    def environment(self) -> dict[str, str]: ...
    def commands(self) -> list[list[str]]: ...
    def wait_ready(self, workers: Workers) -> None: ...
    def enqueue_one(self) -> str: ...
    def enqueue_many(self, count: int) -> None: ...
    def row_count(self) -> int: ...
    def finished_count(self) -> int: ...
    def failed_count(self) -> int: ...
    def span(self) -> tuple[datetime, datetime]: ...
    def latencies_ms(self, ids: list[str]) -> list[float]: ...
    def rss(self, workers: Workers) -> dict[str, Any]: ...
    def plant(self, finished: int, ready: int) -> None: ...
    def claim(self, limit: int) -> int: ...


class Ours:
    """django-jobs: ``run_jobs``, P processes x T threads, plus its supervisor and dispatcher."""

    name = "ours"

    def __init__(self, processes: int, threads: int) -> None:
        self.processes = processes
        self.threads = threads
        self.backend: JobsBackend = task_backends["default"]
        self.claimer: Process | None = None

    def reset(self) -> None:
        reset_tables()

    def environment(self) -> dict[str, str]:
        return worker_environment()

    def commands(self) -> list[list[str]]:
        flags = ["--processes", str(self.processes), "--threads", str(self.threads)]
        return [[sys.executable, str(MANAGE), "run_jobs", *flags]]

    def wait_ready(self, workers: Workers) -> None:
        def registered() -> bool:
            kinds = list(Process.objects.values_list("kind", flat=True))
            return kinds.count(Process.Kind.WORKER) >= self.processes and (
                Process.Kind.DISPATCHER in kinds
            )

        wait_until(registered, workers, "run_jobs' workers to register", START_TIMEOUT)
        time.sleep(SETTLE)

    def enqueue_one(self) -> str:
        return noop.enqueue().id

    def enqueue_many(self, count: int) -> None:
        self.backend.bulk_enqueue([(noop, (), {})] * count)

    def enqueue_keyed(self, count: int, keys: int) -> None:
        self.backend.bulk_enqueue([(noop_keyed, (), {"key": n % keys}) for n in range(count)])

    def enqueue_rated(self, count: int, keys: int) -> None:
        self.backend.bulk_enqueue([(noop_rated, (), {"key": n % keys}) for n in range(count)])

    def row_count(self) -> int:
        return Job.objects.count()

    def finished_count(self) -> int:
        return Job.objects.filter(status__in=FINISHED_STATUSES).count()

    def failed_count(self) -> int:
        return Job.objects.exclude(status=JobStatus.SUCCEEDED).count()

    def span(self) -> tuple[datetime, datetime]:
        row = Job.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
        return row["first"], row["last"]

    def latencies_ms(self, ids: list[str]) -> list[float]:
        rows = Job.objects.filter(pk__in=[int(pk) for pk in ids])
        return [ms(row.started_at - row.enqueued_at) for row in rows]

    def rss(self, workers: Workers) -> dict[str, Any]:
        """Per role, from the process registry: worker children, supervisor, dispatcher."""
        kinds = dict(Process.objects.values_list("pid", "kind"))
        supervisor = workers.procs[0].pid
        by_role: dict[str, list[tuple[float, float]]] = {
            "worker": [],
            "supervisor": [],
            "other": [],
        }
        for pid in workers.members():
            kind = "supervisor" if pid == supervisor else kinds.get(pid, "other")
            by_role.setdefault(kind, []).append(memory_mb(pid))
        return rss_summary(by_role, ("worker", "supervisor"))

    def plant(self, finished: int, ready: int, queues: tuple[str, ...] = ("default",)) -> None:
        """Finished jobs, then ready ones (newer ids, as in service, shared out over
        ``queues``) with their ready rows."""
        self.claimer = None  # the tables were emptied: its process row is gone
        now = timezone.now()
        done = Job(
            task_path=noop.module_path,
            queue_name="default",
            status=JobStatus.SUCCEEDED,
            enqueued_at=now - timedelta(days=1),
            started_at=now - timedelta(days=1),
            last_attempted_at=now - timedelta(days=1),
            finished_at=now - timedelta(days=1),
            attempts=1,
            worker_ids=["worker-bench"],
        )
        insert_series(Job, finished, done, {})
        for name, count in zip(queues, pieces(ready, len(queues)), strict=False):
            waiting = Job(task_path=noop.module_path, queue_name=name, enqueued_at=now)
            insert_series(Job, count, waiting, {})
        job, ready_row = Job._meta, ReadyExecution._meta
        quote = connection.ops.quote_name
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {quote(ready_row.db_table)} "
                "(job_id, queue_name, priority, created_at) "
                f"SELECT id, queue_name, priority, enqueued_at FROM {quote(job.db_table)} "
                "WHERE status = %s",
                [JobStatus.READY],
            )

    def claim(self, limit: int) -> int:
        """One claim as the worker makes it (its process row is the FK the claims need)."""
        if self.claimer is None:
            self.claimer = register_process(DB, Process.Kind.WORKER)
        return len(claim_jobs(DB, self.claimer.pk, QueueSelector(("*",)), limit=limit))


class Peer:
    """django-tasks-db: ``db_worker`` processes (one job at a time each), defaults otherwise."""

    name = "peer"

    def __init__(self, processes: int) -> None:
        self.processes = processes

    def reset(self) -> None:
        reset_tables()

    def environment(self) -> dict[str, str]:
        return worker_environment()

    def commands(self) -> list[list[str]]:
        flags = ["--backend", PEER, "--queue-name", PEER_QUEUE]
        return [[sys.executable, str(MANAGE), "db_worker", *flags]] * self.processes

    def wait_ready(self, workers: Workers) -> None:
        def started() -> bool:
            return all("Starting worker" in text for text in workers.log_text())

        wait_until(started, workers, "db_worker to start", START_TIMEOUT)
        time.sleep(PEER_STARTUP_DELAY + SETTLE)

    def enqueue_one(self) -> str:
        return peer_noop.enqueue().id

    def enqueue_many(self, count: int) -> None:
        """The best it offers for many jobs: no bulk API, so one transaction around enqueue()."""
        with transaction.atomic():
            for _ in range(count):
                peer_noop.enqueue()

    def row_count(self) -> int:
        return DBTaskResult.objects.count()

    def finished_count(self) -> int:
        finished = (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
        return DBTaskResult.objects.filter(status__in=finished).count()

    def failed_count(self) -> int:
        return DBTaskResult.objects.exclude(status=TaskResultStatus.SUCCESSFUL).count()

    def span(self) -> tuple[datetime, datetime]:
        row = DBTaskResult.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
        return row["first"], row["last"]

    def latencies_ms(self, ids: list[str]) -> list[float]:
        rows = DBTaskResult.objects.filter(pk__in=ids)
        return [ms(row.started_at - row.enqueued_at) for row in rows]

    def rss(self, workers: Workers) -> dict[str, Any]:
        return rss_summary({"worker": [memory_mb(pid) for pid in workers.members()]}, ("worker",))

    def plant(self, finished: int, ready: int) -> None:
        now = timezone.now()
        common = {
            "args_kwargs": {"args": [], "kwargs": {}},
            "task_path": peer_noop.module_path,
            "queue_name": PEER_QUEUE,
            "backend_name": PEER,
            "run_after": get_date_max(),
            "exception_class_path": "",
            "traceback": "",
        }
        done = DBTaskResult(
            **common,
            status=TaskResultStatus.SUCCESSFUL,
            enqueued_at=now - timedelta(days=1),
            started_at=now - timedelta(days=1),
            finished_at=now - timedelta(days=1),
            worker_ids=["worker-bench"],
        )
        fresh_id = {DBTaskResult._meta.pk.column: random_uuid_sql()}
        insert_series(DBTaskResult, finished, done, fresh_id)
        waiting = DBTaskResult(**common, status=TaskResultStatus.READY, enqueued_at=now)
        insert_series(DBTaskResult, ready, waiting, fresh_id)

    def claim(self, limit: int) -> int:
        """What db_worker's loop does to take its next job; it takes one per transaction."""
        tasks = DBTaskResult.objects.ready().filter(backend_name=PEER)
        tasks = tasks.filter(queue_name__in=[PEER_QUEUE])
        with exclusive_transaction(tasks.db):
            task_result = tasks.get_locked()
            if task_result is None:
                return 0
            task_result.claim("worker-bench")
        return 1


def libpq_dsn() -> str:
    """The harness's database as a libpq connection string, for queues that connect
    without Django (the limit queue, Oban)."""
    from psycopg.conninfo import make_conninfo

    params = connection.get_connection_params()
    # psycopg's own connect() arguments are not libpq's (Oban's pool prepares by its own rule).
    python_only = ("autocommit", "prepare_threshold")
    libpq = {k: v for k, v in params.items() if isinstance(v, str | int) and k not in python_only}
    return make_conninfo(**libpq)


class Limit:
    """The limit phase's raw-SQL queue (bench/limit_queue.py): its own table and worker
    processes, the same database, the harness's own psycopg connection. PostgreSQL only."""

    name = "limit"

    def __init__(self, processes: int, threads: int, batch: int) -> None:
        import psycopg

        from bench import limit_queue

        self.queue = limit_queue
        self.processes, self.threads, self.batch = processes, threads, batch
        self.dsn = libpq_dsn()
        self.conn = psycopg.connect(self.dsn, autocommit=True, application_name="bench harness")
        limit_queue.create(self.conn)

    def close(self) -> None:
        """Drop the table: the limit queue leaves nothing behind in the bench database."""
        self.queue.drop(self.conn)
        self.conn.close()

    def reset(self) -> None:
        self.queue.empty(self.conn)

    def environment(self) -> dict[str, str]:
        return worker_environment(**{self.queue.DSN_VARIABLE: self.dsn})

    def commands(self) -> list[list[str]]:
        flags = ["--threads", str(self.threads), "--batch", str(self.batch)]
        command = [sys.executable, "-m", "bench.limit_queue", "worker", *flags]
        return [command] * self.processes

    def wait_ready(self, workers: Workers) -> None:
        def connected() -> bool:
            return all("ready" in text for text in workers.log_text())

        wait_until(connected, workers, "the limit queue's workers to connect", START_TIMEOUT)
        time.sleep(SETTLE)

    def enqueue_one(self) -> str:
        return self.queue.enqueue_one(self.conn)

    def enqueue_many(self, count: int) -> None:
        self.queue.enqueue_many(self.conn, count)

    def row_count(self) -> int:
        return self.queue.count(self.conn)

    def finished_count(self) -> int:
        return self.queue.count(self.conn, self.queue.SUCCEEDED, self.queue.FAILED)

    def failed_count(self) -> int:
        return self.row_count() - self.queue.count(self.conn, self.queue.SUCCEEDED)

    def span(self) -> tuple[datetime, datetime]:
        return self.queue.span(self.conn)

    def latencies_ms(self, ids: list[str]) -> list[float]:
        raise NotImplementedError("the limit queue polls; its latency says nothing")

    def rss(self, workers: Workers) -> dict[str, Any]:
        return rss_summary({"worker": [memory_mb(pid) for pid in workers.members()]}, ("worker",))

    def plant(self, finished: int, ready: int) -> None:
        raise NotImplementedError("the limit queue is not in the claims phase")

    def claim(self, limit: int) -> int:
        raise NotImplementedError("the limit queue is not in the claims phase")


class Procrastinate:
    """Procrastinate through its Django integration: jobs deferred through Django's
    connection, P worker processes of ``concurrency`` async sub-workers each
    (bench/procrastinate_worker.py), LISTEN/NOTIFY on. PostgreSQL only. ``pool``: the
    connections of each worker's pool (default: its docs' ``concurrency + 1``)."""

    name = "procrastinate"

    def __init__(
        self, processes: int, concurrency: int, kind: str, pool: int | None = None
    ) -> None:
        from procrastinate.contrib.django.models import (
            ProcrastinateEvent,
            ProcrastinateJob,
            ProcrastinateWorker,
        )

        from bench import procrastinate_tasks

        self.processes, self.concurrency, self.kind = processes, concurrency, kind
        self.pool = pool or concurrency + 1
        self.task = getattr(procrastinate_tasks, f"noop_{kind}")
        self.sleep = procrastinate_tasks.sleep_async
        self.jobs, self.events = ProcrastinateJob.objects, ProcrastinateEvent.objects
        self.workers = ProcrastinateWorker.objects

    def reset(self) -> None:
        reset_tables()

    def environment(self) -> dict[str, str]:
        return worker_environment(**{PROCRASTINATE_FLAG: "true"})

    def commands(self) -> list[list[str]]:
        script = str(ROOT / "bench" / "procrastinate_worker.py")
        flags = ["--concurrency", str(self.concurrency), "--pool", str(self.pool)]
        return [[sys.executable, script, *flags]] * self.processes

    def enqueue_sleeps(self, count: int, seconds: float) -> None:
        """Phase async's jobs, with its batch API: one statement for all."""
        self.sleep.batch_defer(*({"seconds": seconds} for _ in range(count)))

    def wait_ready(self, workers: Workers) -> None:
        """Each worker registers itself in procrastinate_workers once its pool is open and
        it listens."""

        def registered() -> bool:
            return self.workers.count() >= self.processes

        wait_until(registered, workers, "Procrastinate's workers to register", START_TIMEOUT)
        time.sleep(SETTLE)

    def enqueue_one(self) -> str:
        return str(self.task.defer())

    def enqueue_many(self, count: int) -> None:
        """Its batch API: one statement for all."""
        self.task.batch_defer(*({} for _ in range(count)))

    def row_count(self) -> int:
        return self.jobs.count()

    def finished_count(self) -> int:
        return self.jobs.filter(status__in=("succeeded", "failed", "cancelled", "aborted")).count()

    def failed_count(self) -> int:
        return self.jobs.exclude(status="succeeded").count()

    def span(self) -> tuple[datetime, datetime]:
        """From its event log (the jobs table keeps no timestamps): first start, last end."""
        first = self.events.filter(type="started").aggregate(at=Min("at"))["at"]
        last = self.events.filter(type__in=("succeeded", "failed")).aggregate(at=Max("at"))["at"]
        return first, last

    def latencies_ms(self, ids: list[str]) -> list[float]:
        events = self.events.filter(job_id__in=[int(pk) for pk in ids])
        at: dict[tuple[int, str], datetime] = {
            (job, kind): when
            for job, kind, when in events.filter(type__in=("deferred", "started")).values_list(
                "job_id", "type", "at"
            )
        }
        return [ms(at[int(pk), "started"] - at[int(pk), "deferred"]) for pk in ids]

    def rss(self, workers: Workers) -> dict[str, Any]:
        return rss_summary({"worker": [memory_mb(pid) for pid in workers.members()]}, ("worker",))

    def plant(self, finished: int, ready: int) -> None:
        raise NotImplementedError("Procrastinate is not in the claims phase")

    def claim(self, limit: int) -> int:
        raise NotImplementedError("Procrastinate is not in the claims phase")


class Oban:
    """Oban for Python (the ``oban`` package): P worker processes, each its documented
    runner ``oban start --queues default:T`` (T = ours' threads), LISTEN/NOTIFY on (its
    default notifier), every other option at its default. Jobs are enqueued by the
    harness through an Oban instance in client mode (no queues) on an async psycopg
    pool of its own, on an event loop of the harness: Oban's API is async only. Its
    schema is installed for the phase and dropped after. PostgreSQL only."""

    name = "oban"

    def __init__(self, processes: int, limit: int) -> None:
        import psycopg
        from oban import Oban as Instance
        from oban.schema import install_sql

        try:
            from uvloop import new_event_loop  # its CLI's loop, one of its dependencies
        except ImportError:
            from asyncio import new_event_loop

        from bench import oban_tasks

        self.processes, self.limit = processes, limit
        self.worker = oban_tasks.Noop
        self.dsn = libpq_dsn()
        self.conn = psycopg.connect(self.dsn, autocommit=True, application_name="bench harness")
        self.conn.execute(install_sql())
        self.loop = new_event_loop()
        self.pool = self.loop.run_until_complete(Instance.create_pool(self.dsn))
        self.instance = Instance(pool=self.pool)  # client mode: enqueues, runs nothing

    def close(self) -> None:
        """Drop its tables and type: the phase leaves nothing behind in the bench database."""
        from oban.schema import uninstall_sql

        self.loop.run_until_complete(self.pool.close())
        self.loop.close()
        self.conn.execute(uninstall_sql())
        self.conn.close()

    def reset(self) -> None:
        self.conn.execute("TRUNCATE oban_jobs, oban_leaders, oban_producers RESTART IDENTITY")

    def environment(self) -> dict[str, str]:
        return worker_environment(OBAN_DSN=self.dsn)

    def commands(self) -> list[list[str]]:
        command = [
            sys.executable,
            "-m",
            "oban",
            "start",
            "--queues",
            f"{OBAN_QUEUE}:{self.limit}",
            "--cron-modules",  # imports the worker at start, instead of grepping the tree
            "bench.oban_tasks",
        ]
        return [command] * self.processes

    def wait_ready(self, workers: Workers) -> None:
        """``oban start`` logs this once its notifier listens and its producers run."""

        def started() -> bool:
            return all("Oban started" in text for text in workers.log_text())

        wait_until(started, workers, "Oban's workers to start", START_TIMEOUT)
        time.sleep(SETTLE)

    def enqueue_one(self) -> str:
        """``Worker.enqueue()``: one INSERT (its NOTIFY inside) on a pool connection, then
        the pool's commit."""
        return str(self.loop.run_until_complete(self.worker.enqueue()).id)

    def enqueue_one_in_transaction(self) -> str:
        """Its way to enqueue inside the caller's transaction: ``conn=`` an async psycopg
        connection inside ``conn.transaction()``, which it joins."""

        async def enqueue() -> str:
            async with self.pool.connection() as conn, conn.transaction():
                return str((await self.worker.enqueue(conn=conn)).id)

        return self.loop.run_until_complete(enqueue())

    def enqueue_many(self, count: int) -> None:
        """``enqueue_many()``: one connection, one transaction, one INSERT per job (bulk
        inserts are Oban Pro's)."""
        jobs = [self.worker.new() for _ in range(count)]
        self.loop.run_until_complete(self.instance.enqueue_many(jobs))

    def enqueue_sleeps(self, count: int, seconds: float) -> None:
        """Phase async's jobs, as :meth:`enqueue_many` enqueues its no-ops."""
        from bench.oban_tasks import Sleep

        jobs = [Sleep.new({"seconds": seconds}) for _ in range(count)]
        self.loop.run_until_complete(self.instance.enqueue_many(jobs))

    def scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def row_count(self) -> int:
        return self.scalar("SELECT count(*) FROM oban_jobs")

    def finished_count(self) -> int:
        states = ["completed", "discarded", "cancelled"]
        return self.scalar("SELECT count(*) FROM oban_jobs WHERE state::text = ANY(%s)", (states,))

    def failed_count(self) -> int:
        return self.scalar("SELECT count(*) FROM oban_jobs WHERE state <> 'completed'")

    def span(self) -> tuple[datetime, datetime]:
        """Its own timestamps (UTC, without a zone): first attempted_at, last completed_at."""
        row = self.conn.execute("SELECT min(attempted_at), max(completed_at) FROM oban_jobs")
        first, last = row.fetchone()
        return first, last

    def latencies_ms(self, ids: list[str]) -> list[float]:
        """attempted_at - inserted_at: both set by the database, in the same clock."""
        rows = self.conn.execute(
            "SELECT attempted_at - inserted_at FROM oban_jobs WHERE id = ANY(%s)",
            ([int(pk) for pk in ids],),
        ).fetchall()
        return [ms(delta) for (delta,) in rows]

    def rss(self, workers: Workers) -> dict[str, Any]:
        return rss_summary({"worker": [memory_mb(pid) for pid in workers.members()]}, ("worker",))

    def plant(self, finished: int, ready: int) -> None:
        raise NotImplementedError("Oban is not in the claims phase")

    def claim(self, limit: int) -> int:
        raise NotImplementedError("Oban is not in the claims phase")


def ms(delta: timedelta) -> float:
    return delta.total_seconds() * 1000


def rss_summary(
    by_role: dict[str, list[tuple[float, float]]], counted: tuple[str, ...]
) -> dict[str, Any]:
    """Max and sum of RSS over the roles the brief counts, RSS and PSS summed over every
    process of the sessions; each (RSS, PSS) pair per role, MB."""
    counted_mb = [rss for role in counted for rss, _ in by_role.get(role, [])]
    every = [pair for values in by_role.values() for pair in values]
    return {
        "max_mb": max(counted_mb, default=0.0),
        "sum_mb": sum(counted_mb),
        "all_processes_mb": sum(rss for rss, _ in every),
        "all_processes_pss_mb": sum(pss for _, pss in every),
        "by_role_mb": {role: [round(rss, 1) for rss, _ in v] for role, v in by_role.items() if v},
        "by_role_pss_mb": {
            role: [round(pss, 1) for _, pss in v] for role, v in by_role.items() if v
        },
    }


# --- phases ----------------------------------------------------------------------------


@dataclass
class Rate:
    """A rate timed in pieces: the median piece's (the figure) and the whole run's."""

    median: float
    overall: float


def pieces(total: int, count: int) -> list[int]:
    """``total`` split into at most ``count`` near-equal, non-empty pieces."""
    base, extra = divmod(total, count)
    sizes = [base + (1 if n < extra else 0) for n in range(count)]
    return [size for size in sizes if size]


def timed_in_pieces(total: int, work: Callable[[int], int]) -> Rate:
    """Do ``total`` units of work in PIECES timed pieces; ``work(n)`` does n of them.

    The median piece is the figure: a burst of load from elsewhere on a shared
    machine slows a piece or two, which the median drops and a total keeps.
    """
    return timed_in_turns(total, [work])[0]


def check_rows(bench: Bench, expected: int) -> None:
    found = bench.row_count()
    if found != expected:
        raise RuntimeError(f"{bench.name}: {found:,} rows after enqueuing {expected:,}")


def enqueue_rate(bench: Bench, count: int, atomic: bool = False) -> Rate:
    """:func:`enqueue_rates` of one queue."""
    return enqueue_rates([bench], count, atomic)[0]


def enqueue_rates(benches: list[Bench], count: int, atomic: bool = False) -> list[Rate]:
    """``enqueue()`` one by one, each in its own autocommit transaction, after a warm-up;
    with ``atomic``, each inside ``transaction.atomic()`` of its own, as in a view under
    ``ATOMIC_REQUESTS`` (the enqueue is then a statement of the caller's transaction).
    A queue that cannot join Django's transactions (Oban: async only) has its own
    ``enqueue_one_in_transaction()``, the caller's transaction as it understands it.

    Several queues take turns, piece by piece (who goes first alternating), so that
    a burst of load from elsewhere falls on all of them alike: measured one after the
    other, 10 pieces each, the same code gave 0.91x, 1.34x and 1.07x django-tasks-db in
    three runs on one machine. Each queue's rows go to its own tables, emptied first."""
    for bench in benches:
        bench.reset()
    for bench in benches:
        bench.enqueue_one()

    def enqueuer(bench: Bench) -> Callable[[int], int]:
        own = getattr(bench, "enqueue_one_in_transaction", None)

        def enqueue(n: int) -> int:
            for _ in range(n):
                if atomic and own is not None:
                    own()
                elif atomic:
                    with transaction.atomic():
                        bench.enqueue_one()
                else:
                    bench.enqueue_one()
            return n

        return enqueue

    rates = timed_in_turns(count, [enqueuer(bench) for bench in benches])
    for bench in benches:
        check_rows(bench, count + 1)
    return rates


def timed_in_turns(total: int, works: list[Callable[[int], int]]) -> list[Rate]:
    """:func:`timed_in_pieces` of several ``works`` at once: each piece is done by every
    one of them in turn, the first of each turn the next one along."""
    timings: list[list[tuple[int, float]]] = [[] for _ in works]
    for turn, size in enumerate(pieces(total, PIECES)):
        for offset in range(len(works)):
            index = (turn + offset) % len(works)
            began = time.perf_counter()
            done = works[index](size)
            timings[index].append((done, time.perf_counter() - began))
    return [
        Rate(
            statistics.median(done / took for done, took in pieces_of),
            sum(done for done, _ in pieces_of) / sum(took for _, took in pieces_of),
        )
        for pieces_of in timings
    ]


def bulk_rate(bench: Bench, count: int) -> float:
    """All ``count`` jobs in one call: a single timing, there is nothing to split."""
    bench.reset()
    began = time.perf_counter()
    bench.enqueue_many(count)
    rate = count / (time.perf_counter() - began)
    check_rows(bench, count)
    return rate


def drain(bench: Bench, jobs: int, plant: Callable[[], None], log_dir: Path, label: str) -> Drain:
    """Start the workers, let them go idle, commit ``jobs`` at once, time until all finished.

    Startup is not counted: the rate runs from the first job's start to the
    last one's finish, as the rows record them, and the wall time from the
    commit that made the jobs visible to the poll that saw the last finished.
    Memory is read while the workers still run, after all that work; their
    CPU time over the same span as the wall time (plus the enqueue, which
    they do not take part in), from /proc before and after.
    """
    bench.reset()
    with Workers(bench.commands(), log_dir, label, bench.environment()) as workers:
        bench.wait_ready(workers)
        return drain_on(bench, workers, jobs, plant)


def drain_on(bench: Bench, workers: Workers, jobs: int, plant: Callable[[], None]) -> Drain:
    """:func:`drain`'s measure, with workers that are running and idle already; ``bench``
    counts only this drain's rows (a fresh table, or :class:`OursAsync`'s floor)."""
    ticks = cpu_snapshot(workers)
    began = time.perf_counter()
    plant()
    committed = time.perf_counter()
    server_ticks = server_snapshot()
    wait_finished(bench, workers, jobs)
    wall = time.perf_counter() - committed
    cpu = cpu_used(ticks, cpu_snapshot(workers), jobs)
    server_cpu = cpu_used(server_ticks, server_snapshot(), jobs)
    rss = bench.rss(workers)
    failed = bench.failed_count()
    if failed:
        raise RuntimeError(f"{bench.name}: {failed:,} of {jobs:,} jobs did not succeed")
    first, last = bench.span()
    span = (last - first).total_seconds()
    return Drain(jobs, jobs / span, span, wall, committed - began, rss, cpu, server_cpu)


def latency(bench: Bench, samples: int, interval_ms: float, log_dir: Path) -> list[float]:
    """Enqueue→start in ms of ``samples`` jobs enqueued at a steady pace to idle workers.

    A few jobs run first and are not counted: each worker's first job pays for
    importing the task module, which says nothing about how fast it wakes up.
    """
    bench.reset()
    label = f"{bench.name}-latency"
    with Workers(bench.commands(), log_dir, label, bench.environment()) as workers:
        bench.wait_ready(workers)
        paced(bench.enqueue_one, LATENCY_WARMUP, 50.0)
        wait_finished(bench, workers, LATENCY_WARMUP)
        time.sleep(SETTLE)
        ids = paced(bench.enqueue_one, samples, interval_ms)
        wait_finished(bench, workers, LATENCY_WARMUP + samples)
    return bench.latencies_ms(ids)


def paced(enqueue: Callable[[], str], count: int, interval_ms: float) -> list[str]:
    """Enqueue ``count`` jobs, one every ``interval_ms`` from the first (no drift)."""
    ids, began = [], time.perf_counter()
    for n in range(count):
        delay = began + n * interval_ms / 1000 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        ids.append(enqueue())
    return ids


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "max": max(values)}


def claim_rate(bench: Bench, claims: int, batch: int) -> Rate:
    """Claims/s over ``claims`` jobs taken ``batch`` at a time, after one warm-up claim."""
    if not bench.claim(batch):
        raise RuntimeError(f"{bench.name}: nothing to claim")

    def claim(count: int) -> int:
        taken = 0
        while taken < count:
            got = bench.claim(min(batch, count - taken))
            if not got:
                raise RuntimeError(f"{bench.name}: ran out of ready jobs to claim")
            taken += got
        return taken

    return timed_in_pieces(claims, claim)


def claims_phase(bench: Bench, sizes: Sizes, batch: int) -> dict[str, Any]:
    """Claim rate with only the jobs to claim present, then among many finished and ready."""
    result: dict[str, Any] = {"batch": batch}
    scenarios = {"empty": (0, sizes.claims + batch), "big": (sizes.finished, sizes.ready)}
    for scenario, (finished, ready) in scenarios.items():
        reset_tables()
        began = time.perf_counter()
        bench.plant(finished, ready)
        analyze()
        planted = time.perf_counter() - began
        progress(
            f"{bench.name}: planted {finished:,} finished + {ready:,} ready in {planted:.1f} s"
        )
        result[scenario] = asdict(claim_rate(bench, sizes.claims, batch))
        result[f"{scenario}_plant_s"] = planted
    result["big_over_empty"] = result["big"]["median"] / result["empty"]["median"]
    return result


# --- the report ------------------------------------------------------------------------


@dataclass
class Figure:
    """One line of the table: ours, each peer's, and the ratios (> 1: ours is better)."""

    key: str
    label: str
    unit: str
    ours: float | None
    peer: float | None
    higher_is_better: bool = True
    note: str = ""
    procrastinate: float | None = None
    oban: float | None = None

    def against(self, theirs: float | None) -> float | None:
        if not self.ours or not theirs:
            return None
        return self.ours / theirs if self.higher_is_better else theirs / self.ours

    @property
    def ratio(self) -> float | None:
        return self.against(self.peer)

    @property
    def procrastinate_ratio(self) -> float | None:
        return self.against(self.procrastinate)

    @property
    def oban_ratio(self) -> float | None:
        return self.against(self.oban)

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ratio": self.ratio,
            "procrastinate_ratio": self.procrastinate_ratio,
            "oban_ratio": self.oban_ratio,
            "ratio_is": "ours / peer" if self.higher_is_better else "peer / ours",
        }


@dataclass
class Check:
    """A ratio of ours against ours, with the target it should meet."""

    key: str
    label: str
    value: float
    target: str


@dataclass
class Share:
    """A drain (or enqueue) rate as a share of the limit queue's, from the same run."""

    key: str
    label: str
    rate: float
    limit_key: str  # "drain" or "enqueue"


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    limit: dict[str, float] = field(default_factory=dict)  # the limit queue's rates
    shares: list[Share] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # phases that did not run, and why
    notes: list[str] = field(default_factory=list)  # how a peer's figure was made, printed

    def figure(self, key: str, label: str, unit: str, higher_is_better: bool = True) -> Figure:
        """The line ``key``, added empty if no phase made it yet (peers fill in their
        column of a line ours made, or make it when ours' phase was not run)."""
        for figure in self.figures:
            if figure.key == key:
                return figure
        self.figures.append(Figure(key, label, unit, None, None, higher_is_better))
        return self.figures[-1]

    def paired(self, label: str, ours: Rate, theirs: Rate) -> None:
        """A peer's enqueue measured in turns with ours (:func:`enqueue_rates`): the ratio
        of those two, the same minutes of the machine, beside the table's (whose ours is
        phase enqueue's, minutes earlier)."""
        ratio = ours.median / theirs.median
        self.notes.append(
            f"{label}, in turns with ours: ours {number(ours.median)}/s, theirs "
            f"{number(theirs.median)}/s, ours / theirs {ratio:.2f}x"
        )
        self.details.setdefault("paired_enqueue", {})[label] = {
            "ours": asdict(ours),
            "theirs": asdict(theirs),
            "ratio": ratio,
        }

    def skip(self, phase: str, why: str) -> None:
        progress(f"{phase}: skipped, {why}")
        self.skipped.append(f"{phase}: skipped, {why}")


@dataclass
class Run:
    """What every phase needs, and the report they add to."""

    sizes: Sizes
    ours: Ours
    peer: Peer
    log_dir: Path
    limit_batch: int
    procrastinate_task: str
    report: Report = field(default_factory=Report)
    # Ours' latest unlimited drain: the next limited one's reference.
    plain_drain: Drain | None = None


def phase_enqueue(run: Run) -> None:
    count = run.sizes.enqueue
    progress(f"enqueue one by one: {count:,} jobs each")
    ours, peer = enqueue_rates([run.ours, run.peer], count)
    figure = run.report.figure(*ENQUEUE_FIGURE)
    figure.ours, figure.peer, figure.note = ours.median, peer.median, f"median of {PIECES} pieces"
    run.report.shares += [
        Share("enqueue_ours", "ours, enqueue one by one", ours.median, "enqueue"),
        Share("enqueue_peer", "django-tasks-db, enqueue one by one", peer.median, "enqueue"),
    ]
    run.report.details["enqueue"] = {"ours": asdict(ours), "peer": asdict(peer)}
    ours, peer = enqueue_rates([run.ours, run.peer], count, True)
    figure = run.report.figure(*ENQUEUE_ATOMIC_FIGURE)
    figure.ours, figure.peer, figure.note = ours.median, peer.median, f"median of {PIECES} pieces"
    run.report.details["enqueue_atomic"] = {"ours": asdict(ours), "peer": asdict(peer)}


ENQUEUE_FIGURE = ("enqueue_rate", "enqueue one by one", "jobs/s")
ENQUEUE_ATOMIC_FIGURE = ("enqueue_atomic_rate", "enqueue one by one, in atomic()", "jobs/s")
DRAIN_FIGURES = (("drain_rate", "drain no-op jobs", "jobs/s"),)
DRAIN_WALL_FIGURE = ("drain_wall", "drain wall time", "s", False)
CPU_FIGURE = ("worker_cpu_per_job", "worker CPU per job", "ms", False)
SERVER_CPU_FIGURE = ("server_cpu_per_job", "database server CPU per job", "ms", False)
RSS_FIGURES = (
    ("max_mb", "worker RSS, largest process", "ours: workers + supervisor"),
    ("sum_mb", "worker RSS, sum", "ours: workers + supervisor"),
    ("all_processes_mb", "RSS of every process", "ours: + dispatcher, warm parent"),
    ("all_processes_pss_mb", "PSS of every process", "shared pages split between sharers"),
)


# --- concurrent enqueuers, LISTEN/NOTIFY on against off (ours only, PostgreSQL) ----------

NOTIFY_MODES = ("off", "on", "trigger")
NOTIFY_MIGRATIONS = ("0004_ready_notify_trigger", "0006_ready_notify_from_enqueuers")


def enqueue_client() -> int:
    """One process of phase "concurrent" (``--enqueue-client``), driven over stdin/stdout.

    Warms up (connection, first plans, the notifier's thread), says ``ready``,
    waits for ``go SECONDS``, enqueues one job at a time in autocommit for that
    long, then prints what it did as JSON.
    """
    from django_jobs.db import notify

    noop.enqueue()
    print("ready", flush=True)
    seconds = float(sys.stdin.readline().split()[1])
    count, began = 0, time.perf_counter()
    deadline = began + seconds
    while time.perf_counter() < deadline:
        noop.enqueue()
        count += 1
    elapsed = time.perf_counter() - began
    notifier = notify._notifiers.get(DB)
    notifier_connected = notifier is not None and notifier.flush(5.0)
    sent = notifier.sent if notifier is not None else 0
    result = {"count": count, "elapsed": elapsed, "notified": sent, "flushed": notifier_connected}
    print(json.dumps(result), flush=True)
    return 0


class Clients:
    """``--enqueue-client`` (or ``--tenant-client``) processes, each in a session of its
    own, talked to by line."""

    def __init__(
        self,
        count: int,
        env: dict[str, str],
        log_dir: Path,
        label: str,
        flag: str = "--enqueue-client",
    ) -> None:
        self.count = count
        self.flag = flag
        self.env = env
        self.logs = [log_dir / f"{label}-{n}.log" for n in range(count)]
        self.procs: list[subprocess.Popen[str]] = []
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()

    def __enter__(self) -> Clients:
        try:
            for n, log in enumerate(self.logs):
                with log.open("wb") as stderr:
                    proc = subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), self.flag],
                        cwd=ROOT,
                        env=self.env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        text=True,
                        start_new_session=True,
                    )
                self.procs.append(proc)
                threading.Thread(target=self.read, args=(n, proc), daemon=True).start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read(self, n: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put((n, line.strip()))
        self.lines.put((n, ""))  # end of output

    def collect(self, timeout: float, what: str) -> list[str]:
        """One line from each process, in process order."""
        got: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.count:
            try:
                n, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}") from None
            if not line:
                raise WorkerCrashed(
                    f"an enqueuing client exited early; its log ends:\n{tail(self.logs[n])}"
                )
            got[n] = line
        return [got[n] for n in range(self.count)]

    def tell(self, n: int, line: str) -> None:
        """Send ``line`` to process ``n`` alone."""
        stdin = self.procs[n].stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def send(self, line: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)


class NotificationCounter:
    """A LISTENing connection of the harness's own, counting what it receives: the
    notifications are delivered for real, as to workers, during the rounds that send them."""

    def __init__(self) -> None:
        import psycopg

        from django_jobs.runtime.listener import CHANNEL, connection_params

        params = {**connection_params(DB), "application_name": "django-jobs bench listener"}
        self.connection = psycopg.connect(**params)
        self.connection.execute(f"LISTEN {CHANNEL}")
        self.count = 0
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.halt.is_set():
            for _ in self.connection.notifies(timeout=0.2):
                self.count += 1

    def close(self) -> None:
        self.halt.set()
        self.thread.join(5)
        self.connection.close()


def notify_trigger(install: bool) -> None:
    """Put migration 0004's trigger on the ready table (the way LISTEN/NOTIFY worked
    before migration 0006), or take it off again."""
    name = NOTIFY_MIGRATIONS[1] if not install else NOTIFY_MIGRATIONS[0]
    module = importlib.import_module(f"django_jobs.migrations.{name}")
    with connection.schema_editor() as editor:
        (module.create_trigger if install else module.drop_trigger)(apps, editor)


def concurrent_round(
    ours: Bench, mode: str, sizes: Sizes, log_dir: Path, label: str
) -> dict[str, Any]:
    """``sizes.clients`` processes enqueue one by one at once, for ``client_seconds``."""
    reset_tables()
    env = worker_environment()
    env.pop("JOBS_LISTEN_DATABASE_URL", None)
    # "trigger": the notifier off, the trigger notifying inside each enqueue instead.
    env["JOBS_LISTEN_NOTIFY"] = "true" if mode == "on" else "false"
    counter = NotificationCounter()
    try:
        if mode == "trigger":
            notify_trigger(install=True)
        try:
            with Clients(sizes.clients, env, log_dir, label) as clients:
                clients.collect(START_TIMEOUT, "the enqueuing clients to start")
                before = counter.count
                clients.send(f"go {sizes.client_seconds}")
                lines = clients.collect(sizes.client_seconds + START_TIMEOUT, "their results")
        finally:
            if mode == "trigger":
                notify_trigger(install=False)
        results = [json.loads(line) for line in lines]
        enqueued = sum(r["count"] for r in results)
        time.sleep(0.3)  # the counter's connection reads what is already on its way
        received = counter.count - before
    finally:
        counter.close()
    check_rows(ours, enqueued + sizes.clients)
    return {
        "mode": mode,
        "rate": sum(r["count"] / r["elapsed"] for r in results),
        "enqueued": enqueued,
        "notifications_received": received,
        "notifications_sent": sum(r["notified"] for r in results),
    }


def phase_concurrent(run: Run) -> None:
    sizes = run.sizes
    if connection.vendor != "postgresql":
        run.report.skip("concurrent", f"LISTEN/NOTIFY is PostgreSQL's, not {connection.vendor}'s")
        return
    progress(
        f"concurrent enqueuers: {sizes.clients} processes x {sizes.client_seconds:g} s, "
        f"LISTEN/NOTIFY {' / '.join(NOTIFY_MODES)}, {sizes.client_rounds} round(s) each"
    )
    notify_trigger(install=False)  # a run stopped during a "trigger" round left it behind
    rounds: list[dict[str, Any]] = []
    for n in range(sizes.client_rounds):
        # Alternated (off, on, trigger, trigger, on, off, ...): a drift of the machine's
        # load over the phase weighs on every setting alike.
        order = NOTIFY_MODES if n % 2 == 0 else tuple(reversed(NOTIFY_MODES))
        for mode in order:
            label = f"clients-{mode}-{n}"
            rounds.append(concurrent_round(run.ours, mode, sizes, run.log_dir, label))
            progress(f"  {mode}: {rounds[-1]['rate']:,.0f} jobs/s")
    rate = {
        mode: statistics.mean(r["rate"] for r in rounds if r["mode"] == mode)
        for mode in NOTIFY_MODES
    }
    on_rounds = [r for r in rounds if r["mode"] == "on"]
    sent = sum(r["notifications_sent"] for r in on_rounds)
    enqueued = sum(r["enqueued"] for r in on_rounds)
    clients = f"{sizes.clients} enqueuers"
    run.report.figures += [
        Figure(
            "concurrent_notify_off",
            f"{clients}, listen_notify off",
            "jobs/s",
            rate["off"],
            None,
            note=f"mean of {sizes.client_rounds}; no NOTIFY",
        ),
        Figure(
            "concurrent_notify_on",
            f"{clients}, listen_notify on",
            "jobs/s",
            rate["on"],
            None,
            note=f"notifier after commit: {sent:,} NOTIFY for {enqueued:,} jobs",
        ),
        Figure(
            "concurrent_notify_trigger",
            f"{clients}, trigger (before)",
            "jobs/s",
            rate["trigger"],
            None,
            note="migration 0004's trigger, for reference",
        ),
    ]
    run.report.checks += [
        Check(
            "concurrent_on_over_off",
            f"ours: {clients}, notify on / off",
            rate["on"] / rate["off"],
            ">= 0.80",
        ),
        Check(
            "concurrent_trigger_over_off",
            f"ours: {clients}, trigger / off",
            rate["trigger"] / rate["off"],
            "none (the design it replaced)",
        ),
    ]
    run.report.details["concurrent"] = {"rounds": rounds, "mean_rate": rate}


def phase_bulk(run: Run) -> None:
    count = run.sizes.jobs
    progress(f"bulk enqueue: {count:,} jobs each")
    ours, peer = bulk_rate(run.ours, count), bulk_rate(run.peer, count)
    note = "peer: enqueue() loop in one atomic()"
    run.report.figures.append(Figure("bulk_rate", "bulk enqueue", "jobs/s", ours, peer, note=note))


def phase_drain(run: Run) -> None:
    count = run.sizes.jobs
    progress(f"drain: {count:,} no-op jobs each")
    ours = drain(run.ours, count, lambda: run.ours.enqueue_many(count), run.log_dir, "ours")
    peer = drain(run.peer, count, lambda: run.peer.enqueue_many(count), run.log_dir, "peer")
    run.plain_drain = ours
    rate = run.report.figure(*DRAIN_FIGURES[0])
    rate.ours, rate.peer = ours.rate, peer.rate
    wall = run.report.figure(*DRAIN_WALL_FIGURE)
    wall.ours, wall.peer, wall.note = ours.wall_s, peer.wall_s, "commit→done"
    for key, label, note in RSS_FIGURES:
        figure = run.report.figure(f"rss_{key[:-3]}", label, "MB", False)
        figure.ours, figure.peer, figure.note = ours.rss[key], peer.rss[key], note
    cpu = run.report.figure(*CPU_FIGURE)
    cpu.ours, cpu.peer = ours.cpu["ms_per_job"], peer.cpu["ms_per_job"]
    cpu.note = f"user+system, every worker process; ours: {cpu_note(ours.cpu)}"
    server = run.report.figure(*SERVER_CPU_FIGURE)
    server.ours, server.peer = ours.server_cpu["ms_per_job"], peer.server_cpu["ms_per_job"]
    server.note = f"every server process, commit→done; ours: {cpu_note(ours.server_cpu)}"
    run.report.shares += [
        Share("drain_ours", "ours, drain no-op jobs", ours.rate, "drain"),
        Share("drain_peer", "django-tasks-db, drain no-op jobs", peer.rate, "drain"),
    ]
    run.report.details["drain"] = {"ours": asdict(ours), "peer": asdict(peer)}


def phase_keyed(run: Run) -> None:
    keys = run.sizes.keys
    drain_against_plain(
        run, "keyed", f"drain, {keys:,} keys limit 1", run.ours.enqueue_keyed, ">= 0.6"
    )


def phase_rated(run: Run) -> None:
    """A rate limit's cost: the plain drain's jobs under a limit that never binds
    (10,000/s per key, over --keys keys), so every start takes the locked path of
    django_jobs/core/rate_limits.py and none waits."""
    keys = run.sizes.keys
    label = f"drain, {keys:,} rate keys (never binding)"
    drain_against_plain(run, "rated", label, run.ours.enqueue_rated, ">= 0.6 (issue 24)")


def drain_against_plain(
    run: Run, name: str, label: str, enqueue: Callable[[int, int], None], target: str
) -> None:
    """Ours draining ``--jobs`` jobs spread over ``--keys`` keys by ``enqueue``, printed
    as a figure, as a share of the limit, and against ours unlimited from this run.

    The unlimited reference brackets it: the latest unlimited drain before it (the drain
    phase's, or the one after the previous such phase) and one drained right after it,
    their mean rate. A ratio against one drain measured minutes earlier swung with the
    machine: rated / unlimited 0.53 and 0.65 in two runs of the same code."""
    count, keys = run.sizes.jobs, run.sizes.keys
    progress(f"{name} drain: {count:,} jobs over {keys:,} keys, ours")
    result = drain(run.ours, count, lambda: enqueue(count, keys), run.log_dir, f"ours-{name}")
    before = run.plain_drain
    after = None
    if before is not None:
        progress(f"{name} drain: {count:,} unlimited jobs after it, ours (the reference)")
        plain = lambda: run.ours.enqueue_many(count)  # noqa: E731
        after = drain(run.ours, count, plain, run.log_dir, f"ours-after-{name}")
        run.plain_drain = after
    note = (
        f"CPU ms/job: worker {result.cpu['ms_per_job']:.2f}, "
        f"server {result.server_cpu['ms_per_job']:.2f}"
    )
    if before is not None and after is not None:
        cpu = (before.cpu["ms_per_job"] + after.cpu["ms_per_job"]) / 2
        server = (before.server_cpu["ms_per_job"] + after.server_cpu["ms_per_job"]) / 2
        note += f" (unlimited: {cpu:.2f}, {server:.2f})"
    run.report.figures.append(
        Figure(f"{name}_drain_rate", label, "jobs/s", result.rate, None, note=note)
    )
    run.report.shares.append(Share(f"{name}_drain_ours", f"ours, {label}", result.rate, "drain"))
    run.report.details[f"{name}_drain"] = asdict(result)
    if before is not None and after is not None:
        reference = (before.rate + after.rate) / 2
        run.report.details[f"{name}_drain_reference"] = {
            "before": before.rate,
            "after": after.rate,
            "after_drain": asdict(after),
        }
        check = f"ours: {name} drain / unlimited drain"
        bracket = f"{target} (unlimited {number(before.rate)} before, {number(after.rate)} after)"
        run.report.checks.append(
            Check(f"{name}_over_plain", check, result.rate / reference, bracket)
        )


# --- a workflow: fan-out then fan-in, against bulk enqueue and a plain drain (ours only) --


def enqueue_workflow(count: int) -> tuple[WorkflowResult, float]:
    """``count`` no-op jobs as one workflow: a root, ``count - 2`` nodes after it, a sink
    after all of those. Returns its result and the seconds the block's body took (adding
    the nodes); the rest is the enqueue at the block's end, in one transaction."""
    began = time.perf_counter()
    with workflow(WORKFLOW_NAME) as wf:
        root = wf.add(noop)
        middle = [wf.add(noop, after=[root]) for _ in range(count - 2)]
        wf.add(noop, after=middle)
        added = time.perf_counter() - began
    assert wf.result is not None
    return wf.result, added


def workflow_enqueues(ours: Ours, count: int, rounds: int) -> dict[str, Any]:
    """Seconds to enqueue ``count`` no-op jobs with ``django_jobs.bulk_enqueue()`` and as
    one fan-out/in workflow, in-process, each from empty tables, after a warm-up of 10
    of each; ``rounds`` of each, alternated (bulk first, then workflow first, ...) so
    that a drift of the machine's load weighs on both alike. The medians count."""
    times: dict[str, list[float]] = {"bulk": [], "workflow": [], "adding": []}

    def bulk(n: int) -> float:
        reset_tables()
        began = time.perf_counter()
        bulk_enqueue([(noop, (), {})] * n)
        return time.perf_counter() - began

    def flow(n: int) -> tuple[float, float]:
        reset_tables()
        began = time.perf_counter()
        _, added = enqueue_workflow(n)
        return time.perf_counter() - began, added

    bulk(10)  # the warm-up: first plans, first imports
    flow(10)
    for n in range(rounds):
        for kind in ("bulk", "workflow") if n % 2 == 0 else ("workflow", "bulk"):
            if kind == "bulk":
                times["bulk"].append(bulk(count))
            else:
                took, added = flow(count)
                times["workflow"].append(took)
                times["adding"].append(added)
            check_rows(ours, count)
    reset_tables()
    return {
        **{f"{kind}_s": values for kind, values in times.items()},
        **{f"{kind}_median_s": statistics.median(values) for kind, values in times.items()},
    }


def workflow_stages(result: WorkflowResult) -> dict[str, float]:
    """Where a drained fan-out/in workflow's time went, from its rows: the root's run,
    its end to the first fanned-out start (the root's finish releases them all), the
    fanned-out nodes from first start to last finish, that finish to the sink's start
    (the last of them releases it), the sink's run."""
    ids = [int(r.id) for r in result.results]
    root, sink = ids[0], ids[-1]
    rows = {
        pk: (started, finished)
        for pk, started, finished in Job.objects.filter(pk__in=[root, sink]).values_list(
            "pk", "started_at", "finished_at"
        )
    }
    middle = Job.objects.filter(workflow_id=result.id).exclude(pk__in=[root, sink])
    span = middle.aggregate(first=Min("started_at"), last=Max("finished_at"))
    seconds = lambda a, b: (b - a).total_seconds()  # noqa: E731
    fanned = seconds(span["first"], span["last"])
    return {
        "root_run_s": seconds(*rows[root]),
        "fan_out_s": seconds(rows[root][1], span["first"]),
        "middle_s": fanned,
        "middle_rate": (len(ids) - 2) / fanned if fanned else 0.0,
        "fan_in_s": seconds(span["last"], rows[sink][0]),
        "sink_run_s": seconds(*rows[sink]),
    }


def phase_workflow(run: Run) -> None:
    """Workflows' cost: enqueueing ``--jobs`` no-op jobs as one fan-out/in workflow (a
    root, ``--jobs`` - 2 nodes after it, a sink after all of those) against
    ``bulk_enqueue()`` of as many; draining it with the drain phase's workers against a
    plain drain of as many, from the drain phase of this run (else measured here)."""
    count, ours = run.sizes.jobs, run.ours
    rounds = 1 if OPTIONS.smoke else WORKFLOW_ENQUEUES
    progress(
        f"workflow: 1 root, {count - 2:,} nodes after it, 1 sink after those; enqueue against "
        f"bulk_enqueue() of {count:,} ({rounds} round(s) each), then drained by "
        f"{ours.processes} x {ours.threads} threads"
    )
    enqueues = workflow_enqueues(ours, count, rounds)
    plain, source = run.plain_drain, "drain phase"
    if plain is None:
        progress(f"workflow: no plain drain in this run yet, draining {count:,} no-op jobs")
        plain = drain(ours, count, lambda: ours.enqueue_many(count), run.log_dir, "ours-plain")
        run.plain_drain, source = plain, "measured in this phase"
    enqueued: list[WorkflowResult] = []
    result = drain(
        ours,
        count,
        lambda: enqueued.append(enqueue_workflow(count)[0]),
        run.log_dir,
        "ours-workflow",
    )
    (flow,) = enqueued
    status = flow.status
    if status != "succeeded":
        raise RuntimeError(f"workflow {flow.id} drained but is {status}")
    stages = workflow_stages(flow)
    bulk_s, flow_s = enqueues["bulk_median_s"], enqueues["workflow_median_s"]
    median = f"median of {rounds}" if rounds > 1 else "one round"

    def each(kind: str) -> str:
        return f"{median}: {', '.join(f'{t:.2f}' for t in enqueues[f'{kind}_s'])} s"

    run.report.figures += [
        Figure(
            "workflow_bulk_enqueue",
            f"bulk_enqueue(), {count:,} jobs",
            "s",
            bulk_s,
            None,
            False,
            f"{each('bulk')}; the workflow's reference",
        ),
        Figure(
            "workflow_enqueue",
            f"enqueue {count:,}-node workflow",
            "s",
            flow_s,
            None,
            False,
            f"{each('workflow')}; {enqueues['adding_median_s']:.2f} s of it in wf.add()",
        ),
        Figure(
            "workflow_drain_rate",
            "drain fan-out/in workflow",
            "jobs/s",
            result.rate,
            None,
            note=(
                f"plain drain {number(plain.rate)} jobs/s ({source}); fan-out "
                f"{stages['fan_out_s']:.2f} s, {count - 2:,} at "
                f"{number(stages['middle_rate'])} jobs/s, fan-in {stages['fan_in_s']:.2f} s"
            ),
        ),
        Figure(
            "workflow_drain_wall",
            "workflow drain wall time",
            "s",
            result.wall_s,
            None,
            False,
            f"commit→sink finished; plain drain {plain.wall_s:.1f} s",
        ),
    ]
    run.report.shares.append(
        Share("workflow_drain_ours", "ours, drain fan-out/in workflow", result.rate, "drain")
    )
    run.report.checks += [
        Check(
            "workflow_enqueue_over_bulk",
            "ours: workflow enqueue time / bulk_enqueue",
            flow_s / bulk_s,
            "<= 2.00",
        ),
        Check(
            "workflow_drain_over_plain",
            "ours: workflow drain / plain drain",
            result.rate / plain.rate,
            ">= 0.50",
        ),
    ]
    run.report.details["workflow"] = {
        "enqueue": enqueues,
        "drain": asdict(result),
        "stages": stages,
        "plain_drain": asdict(plain),
        "plain_drain_from": source,
    }


def phase_latency(run: Run) -> None:
    sizes = run.sizes
    progress(f"latency: {sizes.latency_samples:,} jobs each")
    mine, theirs = (
        percentiles(latency(b, sizes.latency_samples, sizes.latency_interval_ms, run.log_dir))
        for b in (run.ours, run.peer)
    )
    for cut in ("p50", "p95", "p99"):
        figure = run.report.figure(*latency_figure(cut))
        figure.ours, figure.peer = mine[cut], theirs[cut]
        figure.note = f"ours: {wakeup(JobsSettings.load())[0]}" if cut == "p50" else ""
    run.report.details.setdefault("latency_ms", {}).update(ours=mine, peer=theirs)


def latency_figure(cut: str) -> tuple[str, str, str, bool]:
    return f"latency_{cut}", f"latency enqueue→start {cut}", "ms", False


# --- the limit queue and Procrastinate (PostgreSQL only) ---------------------------------


def phase_limit(run: Run) -> None:
    """The raw-SQL queue, with ours' processes x threads: enqueue one by one, then drain."""
    if connection.vendor != "postgresql":
        run.report.skip("limit", f"PostgreSQL only (raw SQL over psycopg), not {connection.vendor}")
        return
    sizes, ours = run.sizes, run.ours
    rounds = 1 if OPTIONS.smoke else LIMIT_DRAINS
    progress(
        f"limit: raw-SQL queue, {sizes.enqueue:,} enqueued one by one, {sizes.jobs:,} drained by "
        f"{ours.processes} x {ours.threads} threads, {run.limit_batch} jobs per claim, "
        f"{rounds} time(s)"
    )
    limit = Limit(ours.processes, ours.threads, run.limit_batch)
    try:
        enqueue = enqueue_rate(limit, sizes.enqueue)
        plant = lambda: limit.enqueue_many(sizes.jobs)  # noqa: E731
        drains = [drain(limit, sizes.jobs, plant, run.log_dir, f"limit-{n}") for n in range(rounds)]
    finally:
        limit.close()
    rate = statistics.median(d.rate for d in drains)
    cpu = statistics.median(d.cpu["ms_per_job"] for d in drains)
    server = statistics.median(d.server_cpu["ms_per_job"] for d in drains)
    run.report.limit = {
        "enqueue": enqueue.median,
        "drain": rate,
        "cpu_ms_per_job": cpu,
        "server_cpu_ms_per_job": server,
    }
    run.report.details["limit"] = {
        "processes": ours.processes,
        "threads": ours.threads,
        "batch": run.limit_batch,
        "enqueue": asdict(enqueue),
        "drains": [asdict(d) for d in drains],
        "drain_rate_median": rate,
    }


def procrastinate_unavailable() -> str | None:
    """Why Procrastinate cannot run here, or None if it can."""
    if connection.vendor != "postgresql":
        return f"PostgreSQL only (its schema is PostgreSQL's), not {connection.vendor}"
    if OPTIONS.smoke:
        return SMOKE_SKIPS["procrastinate"]
    if not apps.is_installed(PROCRASTINATE_APP):
        return "procrastinate is not installed (pip install -e '.[bench]')"
    return None


def phase_procrastinate(run: Run) -> None:
    """Procrastinate through the same enqueue, drain and latency as the other two."""
    why = procrastinate_unavailable()
    if why:
        run.report.skip("procrastinate", why)
        return
    sizes, ours = run.sizes, run.ours
    bench = Procrastinate(ours.processes, ours.threads, run.procrastinate_task)
    progress(
        f"procrastinate: {sizes.enqueue:,} enqueued one by one, {sizes.jobs:,} drained by "
        f"{bench.processes} x {bench.concurrency} sub-workers, {sizes.latency_samples:,} latency "
        "samples"
    )
    paired, enqueue = enqueue_rates([ours, bench], sizes.enqueue)
    run.report.figure(*ENQUEUE_FIGURE).procrastinate = enqueue.median
    run.report.paired("procrastinate, enqueue one by one", paired, enqueue)
    result = drain(
        bench, sizes.jobs, lambda: bench.enqueue_many(sizes.jobs), run.log_dir, "procrastinate"
    )
    run.report.figure(*DRAIN_FIGURES[0]).procrastinate = result.rate
    run.report.figure(*DRAIN_WALL_FIGURE).procrastinate = result.wall_s
    for key, label, _ in RSS_FIGURES:
        run.report.figure(f"rss_{key[:-3]}", label, "MB", False).procrastinate = result.rss[key]
    run.report.figure(*CPU_FIGURE).procrastinate = result.cpu["ms_per_job"]
    run.report.figure(*SERVER_CPU_FIGURE).procrastinate = result.server_cpu["ms_per_job"]
    cuts = percentiles(
        latency(bench, sizes.latency_samples, sizes.latency_interval_ms, run.log_dir)
    )
    for cut in ("p50", "p95", "p99"):
        run.report.figure(*latency_figure(cut)).procrastinate = cuts[cut]
    run.report.shares += [
        Share(
            "enqueue_procrastinate", "procrastinate, enqueue one by one", enqueue.median, "enqueue"
        ),
        Share("drain_procrastinate", "procrastinate, drain no-op jobs", result.rate, "drain"),
    ]
    run.report.details["procrastinate"] = {
        "enqueue": asdict(enqueue),
        "drain": asdict(result),
        "latency_ms": cuts,
        "task": run.procrastinate_task,
    }


def oban_unavailable() -> str | None:
    """Why Oban cannot run here, or None if it can."""
    if connection.vendor != "postgresql":
        return f"PostgreSQL only (its schema is PostgreSQL's), not {connection.vendor}"
    if find_spec("oban") is None:
        return "oban is not installed (pip install -e '.[bench]')"
    return None


def phase_oban(run: Run) -> None:
    """Oban for Python through the same enqueue (autocommit and in a transaction), drain
    and latency as the others."""
    why = oban_unavailable()
    if why:
        run.report.skip("oban", why)
        return
    sizes, ours = run.sizes, run.ours
    bench = Oban(ours.processes, ours.threads)
    progress(
        f"oban: {sizes.enqueue:,} enqueued one by one (autocommit, then each in a transaction), "
        f"{sizes.jobs:,} drained by {bench.processes} x oban start --queues "
        f"{OBAN_QUEUE}:{bench.limit}, {sizes.latency_samples:,} latency samples"
    )
    try:
        paired, enqueue = enqueue_rates([ours, bench], sizes.enqueue)
        paired_atomic, atomic = enqueue_rates([ours, bench], sizes.enqueue, True)
        plant = lambda: bench.enqueue_many(sizes.jobs)  # noqa: E731
        result = drain(bench, sizes.jobs, plant, run.log_dir, "oban")
        samples = latency(bench, sizes.latency_samples, sizes.latency_interval_ms, run.log_dir)
    finally:
        bench.close()
    cuts = percentiles(samples)
    report = run.report
    report.figure(*ENQUEUE_FIGURE).oban = enqueue.median
    report.figure(*ENQUEUE_ATOMIC_FIGURE).oban = atomic.median
    report.paired("oban, enqueue one by one", paired, enqueue)
    report.paired("oban, enqueue one by one in a transaction", paired_atomic, atomic)
    report.figure(*DRAIN_FIGURES[0]).oban = result.rate
    report.figure(*DRAIN_WALL_FIGURE).oban = result.wall_s
    for key, label, _ in RSS_FIGURES:
        report.figure(f"rss_{key[:-3]}", label, "MB", False).oban = result.rss[key]
    report.figure(*CPU_FIGURE).oban = result.cpu["ms_per_job"]
    report.figure(*SERVER_CPU_FIGURE).oban = result.server_cpu["ms_per_job"]
    for cut in ("p50", "p95", "p99"):
        report.figure(*latency_figure(cut)).oban = cuts[cut]
    report.notes.append(
        "oban, enqueue in atomic(): Oban's API is async and cannot join Django's atomic(); "
        "each enqueue is Worker.enqueue(conn=c) inside c.transaction() of an async psycopg "
        "connection (its documented transactional insert), one job per transaction"
    )
    report.shares += [
        Share("enqueue_oban", "oban, enqueue one by one", enqueue.median, "enqueue"),
        Share("drain_oban", "oban, drain no-op jobs", result.rate, "drain"),
    ]
    report.details["oban"] = {
        "enqueue": asdict(enqueue),
        "enqueue_in_transaction": asdict(atomic),
        "drain": asdict(result),
        "latency_ms": cuts,
    }


# --- async jobs on the workers' event loops (issue 39) -----------------------------------


class OursAsync(Ours):
    """Ours as phase "async" starts it: ``run_jobs --processes P`` and ``flags``, nothing
    else (an empty ``flags`` is our defaults: the settings' threads, async_jobs).

    One set of workers drains several batches in turn, so its rows are never emptied
    in between (that would remove the workers' own process rows): each count reads
    only the jobs enqueued since :meth:`mark`."""

    def __init__(self, processes: int, flags: tuple[str, ...], label: str) -> None:
        super().__init__(processes, 0)
        self.flags = flags
        self.label = label
        self.floor = 0

    def commands(self) -> list[list[str]]:
        flags = ["--processes", str(self.processes), *self.flags]
        return [[sys.executable, str(MANAGE), "run_jobs", *flags]]

    def reset(self) -> None:
        reset_tables()
        self.floor = 0

    def mark(self) -> None:
        """Count only the jobs enqueued from now on."""
        self.floor = Job.objects.aggregate(top=Max("pk"))["top"] or 0

    def rows(self) -> models.QuerySet[Job]:
        return Job.objects.filter(pk__gt=self.floor)

    def enqueue_one(self) -> str:
        return noop_async.enqueue().id

    def enqueue_noops(self, count: int) -> None:
        self.backend.bulk_enqueue([(noop, (), {})] * count)

    def enqueue_sleeps(self, count: int, seconds: float) -> None:
        self.backend.bulk_enqueue([(sleep_async, (), {"seconds": seconds})] * count)

    def row_count(self) -> int:
        return self.rows().count()

    def finished_count(self) -> int:
        return self.rows().filter(status__in=FINISHED_STATUSES).count()

    def failed_count(self) -> int:
        return self.rows().exclude(status=JobStatus.SUCCEEDED).count()

    def running_count(self, task_path: str | None = None) -> int:
        rows = self.rows().filter(status=JobStatus.RUNNING)
        return (rows.filter(task_path=task_path) if task_path else rows).count()

    def span(self) -> tuple[datetime, datetime]:
        row = self.rows().aggregate(first=Min("started_at"), last=Max("finished_at"))
        return row["first"], row["last"]


def async_sizes(options: argparse.Namespace) -> AsyncSizes:
    base = ASYNC_SMOKE if options.smoke else ASYNC_FULL
    values = {
        name: value if (value := getattr(options, f"async_{name}")) is not None else default
        for name, default in asdict(base).items()
    }
    return AsyncSizes(**values)


def ours_workers(bench: OursAsync, run: Run) -> Workers:
    """A fresh set of ``bench``'s workers over emptied tables (idle once entered and
    :meth:`OursAsync.wait_ready` has returned)."""
    bench.reset()
    return Workers(bench.commands(), run.log_dir, f"async-{bench.label}", bench.environment())


def in_flight_on(bench: OursAsync, workers: Workers, count: int, seconds: float) -> dict[str, Any]:
    """Memory and connections of idle workers, then with ``count`` async jobs of
    ``seconds`` in flight: read a quarter of ``seconds`` (at most 1 s) after every one of
    them has started (status running), so that what a worker opens beside its running
    jobs (its cancel poll's query) is in; ``in_flight`` and ``finished_before`` say how
    many ran and how many had already ended when it was read. Then waits for them all to
    succeed."""
    idle = {
        "memory": bench.rss(workers),
        "connections": held_connections(connection, workers.members()),
    }
    bench.mark()
    began = time.perf_counter()
    bench.enqueue_sleeps(count, seconds)
    deadline = time.perf_counter() + seconds
    while bench.running_count() < count:
        workers.check_alive()
        if bench.finished_count() or time.perf_counter() > deadline:
            break
        time.sleep(0.05)
    reached = time.perf_counter() - began
    time.sleep(min(1.0, seconds / 4))
    loaded = {
        "memory": bench.rss(workers),
        "connections": held_connections(connection, workers.members()),
        "in_flight": bench.running_count(),
        "finished_before": bench.finished_count(),
        "seconds_to_reach": reached,
    }
    wait_finished(bench, workers, count)
    failed = bench.failed_count()
    if failed:
        raise RuntimeError(f"{bench.label}: {failed:,} of {count:,} in-flight jobs did not succeed")
    return {"idle": idle, "loaded": loaded, "processes": len(workers.members())}


def latency_on(
    bench: OursAsync, workers: Workers, sizes: Sizes, load: int
) -> dict[str, dict[str, float] | int]:
    """Enqueue→start of async no-op probes, one every ``latency_interval_ms``: with
    the workers idle, then while ``load`` async sleeps are in flight on them (each
    sleeping through the probes' window and half as long again, at least 1 s: the load
    takes a while to be all in flight on a busy machine). ``load_left`` counts the load's
    jobs still running once the last probe was enqueued: all of them, or the probes did
    not run under the whole load. The workers come from a drain of async jobs: a few
    probes first (the probe task's import), half a second to go idle, then the count."""
    samples, interval = sizes.latency_samples, sizes.latency_interval_ms
    bench.mark()
    paced(bench.enqueue_one, LATENCY_WARMUP, 10.0)
    wait_finished(bench, workers, LATENCY_WARMUP)
    time.sleep(SETTLE / 2)
    bench.mark()
    ids = paced(bench.enqueue_one, samples, interval)
    wait_finished(bench, workers, samples)
    idle = bench.latencies_ms(ids)
    bench.mark()
    window = samples * interval / 1000
    load_s = window + max(1.0, window / 2)
    bench.enqueue_sleeps(load, load_s)
    wait_until(
        lambda: bench.running_count() >= load, workers, f"{load:,} async jobs in flight", load_s
    )
    ids = paced(bench.enqueue_one, samples, interval)
    left = bench.running_count(sleep_async.module_path)
    wait_finished(bench, workers, load + samples)
    failed = bench.failed_count()
    if failed:
        raise RuntimeError(f"{bench.label}: {failed:,} jobs of the latency run did not succeed")
    return {
        "idle": percentiles(idle),
        "loaded": percentiles(bench.latencies_ms(ids)),
        "load": load,
        "load_left": left,
    }


def async_procrastinate_unavailable() -> str | None:
    """Why phase async cannot run Procrastinate here, or None if it can."""
    if connection.vendor != "postgresql":
        return f"PostgreSQL only, not {connection.vendor}"
    if not apps.is_installed(PROCRASTINATE_APP):
        return "procrastinate is not installed (pip install -e '.[bench]')"
    return None


def procrastinate_concurrencies() -> list[int]:
    values = [int(c) for c in OPTIONS.procrastinate_concurrency.split(",") if c.strip()]
    return values[:1] if OPTIONS.smoke else values


def phase_async(run: Run) -> None:
    """Issue 39: ``async def`` jobs on each worker process's event loop, up to
    ``async_jobs`` at once, against Procrastinate's and Oban's async workers, against
    running them on threads (``--async-jobs 0``), and against our own no-op drain, in
    one run. Each peer's drain is bracketed by a drain of our defaults right before and
    right after it, and set against their mean: on a shared machine the load moves
    within the minutes a peer's drain takes (load 2.4 to 11.4 in one run)."""
    sizes, report = async_sizes(OPTIONS), run.report
    began = time.perf_counter()

    def step(message: str) -> None:
        progress(f"  [{time.perf_counter() - began:5.1f} s] {message}")

    processes = OPTIONS.processes or ASYNC_PROCESSES
    threads = OPTIONS.threads or DEFAULT_THREADS
    n, sleep_s = sizes.jobs, sizes.sleep_s
    half = max(1, sizes.in_flight // processes)
    setups = {
        "defaults": OursAsync(processes, (), "defaults"),
        "threads": OursAsync(processes, ("--threads", str(threads)), f"threads-{threads}"),
        "old": OursAsync(processes, ("--async-jobs", "0", "--threads", str(threads)), "old-way"),
        "loop": OursAsync(processes, ("--async-jobs", str(half)), "in-flight-loop"),
        "on_threads": OursAsync(
            processes, ("--async-jobs", "0", "--threads", str(half)), "in-flight-threads"
        ),
    }
    commands = {key: " ".join(b.commands()[0][2:]) for key, b in setups.items()}
    progress(
        f"async: {n:,} jobs awaiting asyncio.sleep({sleep_s:g}) and {n:,} no-op jobs, "
        f"{processes} processes; {sizes.in_flight:,} in flight for memory; latency under "
        f"{sizes.load:,} in flight"
    )
    details: dict[str, Any] = {
        "sizes": asdict(sizes),
        "processes": processes,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }

    def ours_drain(key: str, count: int) -> Drain:
        bench = setups[key]
        with ours_workers(bench, run) as workers:
            bench.wait_ready(workers)
            bench.mark()
            result = drain_on(bench, workers, count, lambda: bench.enqueue_sleeps(count, sleep_s))
        step(f"async drain ({commands[key]}), {count:,} jobs: {result.rate:,.0f} jobs/s")
        return result

    # Our no-op drain, the async drain and the latency with the same workers (--threads T,
    # as every drain of ours in this bench): no-op then async, then (not in smoke) async
    # then no-op, so that a drift of the load weighs on both alike; the means count.
    bench = setups["threads"]
    plants = {
        "no-op": lambda: bench.enqueue_noops(n),
        "async": lambda: bench.enqueue_sleeps(n, sleep_s),
    }
    drains: dict[str, list[Drain]] = {"no-op": [], "async": []}
    orders = [("no-op", "async")] if OPTIONS.smoke else [("no-op", "async"), ("async", "no-op")]
    with ours_workers(bench, run) as workers:
        bench.wait_ready(workers)
        for order in orders:
            for kind in order:
                bench.mark()
                drains[kind].append(drain_on(bench, workers, n, plants[kind]))
                step(f"{kind} drain ({commands['threads']}): {drains[kind][-1].rate:,.0f} jobs/s")
        lat = latency_on(bench, workers, run.sizes, sizes.load)
        step(
            f"latency p50 idle {lat['idle']['p50']:.1f} ms, under {sizes.load:,} in "
            f"flight {lat['loaded']['p50']:.1f} ms"
        )

    # The peers, each between two drains of our defaults (the settings' threads). Smoke
    # leaves those out (a set of workers costs ~4 s to start, settle and stop): the drain
    # above is then the reference.
    defaults: list[Drain] = []
    if OPTIONS.smoke:
        report.skip("async, the defaults' drains", f"smoke: {commands['threads']} stands in")
    else:
        defaults.append(ours_drain("defaults", n))
    peers: list[dict[str, Any]] = []
    for name, settings_of, measure in async_peers(report, processes, n, sleep_s, run.log_dir):
        result = measure()
        step(f"{name} ({settings_of}): {result.rate:,.0f} jobs/s")
        threads_rate = statistics.mean(d.rate for d in drains["async"])
        before = defaults[-1].rate if defaults else threads_rate
        if not OPTIONS.smoke:
            defaults.append(ours_drain("defaults", n))
        after = defaults[-1].rate if defaults else threads_rate
        peers.append(
            {
                "name": name,
                "settings": settings_of,
                "drain": asdict(result),
                "ours_before": before,
                "ours_after": after,
                "ratio": (before + after) / 2 / result.rate,
            }
        )

    # The old way: async bodies on the threads through async_to_sync.
    old_drain = ours_drain("old", sizes.threaded_jobs) if sizes.threaded_jobs else None
    if old_drain is None:
        report.skip("async, the old way", "--async-threaded-jobs 0 (smoke's)")

    # Memory and connections, the same number in flight on the loops, then on threads.
    memory: dict[str, Any] = {}
    for key in ("loop", "on_threads"):
        bench = setups[key]
        with ours_workers(bench, run) as workers:
            bench.wait_ready(workers)
            memory[key] = in_flight_on(bench, workers, sizes.in_flight, sizes.in_flight_s)
        loaded = memory[key]["loaded"]
        step(
            f"{loaded['in_flight']:,} in flight ({commands[key]}): PSS "
            f"{loaded['memory']['all_processes_pss_mb']:.0f} MB, "
            f"{loaded['connections']['held']} connections"
        )

    skipped = {"defaults": not defaults, "old": old_drain is None}
    details.update(
        commands={k: c for k, c in commands.items() if not skipped.get(k)},
        noop_drains=[asdict(d) for d in drains["no-op"]],
        threads_drains=[asdict(d) for d in drains["async"]],
        default_drains=[asdict(d) for d in defaults],
        old_drain=asdict(old_drain) if old_drain else None,
        latency_ms=lat,
        in_flight=memory,
        peers=peers,
        load_average_end=[round(x, 2) for x in os.getloadavg()],
    )
    report.details["async"] = details
    async_figures(report, details, sizes, threads)


def async_peers(
    report: Report, processes: int, count: int, seconds: float, log_dir: Path
) -> list[tuple[str, str, Callable[[], Drain]]]:
    """The peers phase async drains the same jobs with, as (name, settings, measure):
    Procrastinate at each ``--procrastinate-concurrency`` (the first only in smoke), then
    Oban (not in smoke: its own phase runs there). Those that cannot run here are
    skipped with the reason."""
    peers: list[tuple[str, str, Callable[[], Drain]]] = []
    why = async_procrastinate_unavailable()
    if why:
        report.skip("async, procrastinate", why)
    else:
        for concurrency in procrastinate_concurrencies():
            pool = min(concurrency + 1, OPTIONS.procrastinate_pool)
            peer = Procrastinate(processes, concurrency, "async", pool=pool)

            def measure(peer: Procrastinate = peer) -> Drain:
                plant = lambda: peer.enqueue_sleeps(count, seconds)  # noqa: E731
                label = f"async-procrastinate-{peer.concurrency}"
                return drain(peer, count, plant, log_dir, label)

            settings_of = f"{processes} x concurrency {concurrency}, pool {pool}"
            peers.append(("procrastinate", settings_of, measure))
    why = oban_unavailable() or ("its own phase runs it in smoke" if OPTIONS.smoke else None)
    if why:
        report.skip("async, oban", why)
    else:

        def measure_oban() -> Drain:
            peer = Oban(processes, OBAN_ASYNC_LIMIT)
            try:
                plant = lambda: peer.enqueue_sleeps(count, seconds)  # noqa: E731
                return drain(peer, count, plant, log_dir, f"async-oban-{OBAN_ASYNC_LIMIT}")
            finally:
                peer.close()

        settings_of = f"{processes} x --queues {OBAN_QUEUE}:{OBAN_ASYNC_LIMIT}"
        peers.append(("oban", settings_of, measure_oban))
    return peers


def async_figures(report: Report, d: dict[str, Any], sizes: AsyncSizes, threads: int) -> None:
    """Phase async's lines of the table and its checks, from its details. The async drain
    set against the peers and the no-op drain is our defaults' (``run_jobs --processes
    P``; the mean of its drains), or in smoke, which leaves those out, the no-op drain's
    workers' (``--threads T``)."""
    n, sleep = sizes.jobs, f"sleep({sizes.sleep_s:g})"
    commands, peers = d["commands"], d["peers"]
    noops = [drain["rate"] for drain in d["noop_drains"]]
    asyncs = [drain["rate"] for drain in d["threads_drains"]]
    noop_rate, threads_rate = statistics.mean(noops), statistics.mean(asyncs)
    defaults = [drain["rate"] for drain in d["default_drains"]]
    old_rate = d["old_drain"]["rate"] if d["old_drain"] else None
    report.figures.append(
        Figure(
            "async_noop_drain",
            "async phase: no-op drain",
            "jobs/s",
            noop_rate,
            None,
            note=f"{n:,} jobs; {commands['threads']}{rounds(noops)}",
        )
    )
    threads_row = Figure(
        "async_drain_threads",
        f"async {sleep} drain, {threads} thr.",
        "jobs/s",
        threads_rate,
        None,
        note=f"{n:,} jobs; {commands['threads']}{rounds(asyncs)}",
    )
    report.figures.append(threads_row)
    headline, which = threads_row, f"{threads} threads"
    if defaults:
        headline = Figure(
            "async_drain_defaults",
            f"async {sleep} drain, defaults",
            "jobs/s",
            statistics.mean(defaults),
            None,
            note=f"{n:,} jobs; {commands['defaults']}{rounds(defaults)}",
        )
        report.figures.append(headline)
        which = "defaults"
    for peer in peers:
        column = "procrastinate" if peer["name"] == "procrastinate" else "oban"
        if getattr(headline, column) is None:  # the first of each peer: its docs' settings
            setattr(headline, column, peer["drain"]["rate"])
            headline.note += f"; {peer['name']}: {peer['settings']}"
    if old_rate:
        report.figures.append(
            Figure(
                "async_drain_old",
                f"async {sleep} drain, old way",
                "jobs/s",
                old_rate,
                None,
                note=f"{sizes.threaded_jobs:,} jobs; {commands['old']}",
            )
        )
    memory = d["in_flight"]
    for key, label in (("loop", "loop"), ("on_threads", "threads")):
        loaded, idle = memory[key]["loaded"], memory[key]["idle"]
        held = loaded["connections"]
        total = f", {held['database_total']} in the database" if held["database_total"] else ""
        grown = loaded["memory"]["all_processes_pss_mb"] - idle["memory"]["all_processes_pss_mb"]
        per_job = grown * 1024 / loaded["in_flight"] if loaded["in_flight"] else 0.0
        report.figures += [
            Figure(
                f"async_pss_{key}",
                f"PSS, {loaded['in_flight']:,} in flight, {label}",
                "MB",
                loaded["memory"]["all_processes_pss_mb"],
                None,
                False,
                f"idle {idle['memory']['all_processes_pss_mb']:.1f} MB (+{per_job:.0f} KB per "
                f"job in flight); {memory[key]['processes']} processes; {commands[key]}",
            ),
            Figure(
                f"async_connections_{key}",
                f"connections, in flight, {label}",
                "conns",
                held["held"],
                None,
                False,
                f"idle {idle['connections']['held']}{total}; {held['how']}",
            ),
        ]
    lat = d["latency_ms"]
    for cut in ("p50", "p95"):
        report.figures.append(
            Figure(
                f"async_latency_{cut}",
                f"async latency {cut}, under load",
                "ms",
                lat["loaded"][cut],
                None,
                False,
                f"idle {lat['idle'][cut]:.1f} ms; {lat['load']:,} sleeps in flight "
                f"({lat['load_left']:,} left after the last probe); {commands['threads']}",
            )
        )
    for peer in peers:
        target = ">= 1.2" if peer["name"] == "procrastinate" else "none"
        report.checks.append(
            Check(
                f"async_over_{peer['name']}_{peer['settings']}",
                f"async drain: {which} / {peer['name']}, {peer['settings']}",
                peer["ratio"],
                f"{target} ({peer['name']} {number(peer['drain']['rate'])} jobs/s; ours "
                f"{number(peer['ours_before'])} before, {number(peer['ours_after'])} after)",
            )
        )
    rate = headline.ours or 0.0
    report.checks.append(
        Check(
            "async_over_noop",
            f"async drain / no-op drain ({threads} threads, in turns)",
            threads_rate / noop_rate,
            ">= 0.5 (the same workers, drains in turns)",
        )
    )
    if defaults:
        report.checks.append(
            Check(
                "async_defaults_over_noop",
                "async drain: defaults / no-op drain",
                rate / noop_rate,
                "none (other workers, minutes apart)",
            )
        )
    if old_rate:
        report.checks.append(
            Check(
                "async_over_old",
                f"async drain: {which} / old way",
                rate / old_rate,
                f"none (the old way: {threads} threads x {processes_of(commands)} / "
                f"{sizes.sleep_s:g} s at most)",
            )
        )
    pss = {k: memory[k]["loaded"]["memory"]["all_processes_pss_mb"] for k in memory}
    grown = {k: pss[k] - memory[k]["idle"]["memory"]["all_processes_pss_mb"] for k in memory}
    report.checks += [
        Check(
            "async_pss_loop_over_threads",
            "in flight: PSS loop / threads",
            pss["loop"] / pss["on_threads"],
            "<= 0.5",
        ),
        Check(
            "async_pss_growth_loop_over_threads",
            "in flight: PSS growth loop / threads",
            grown["loop"] / grown["on_threads"] if grown["on_threads"] > 0 else 0.0,
            f"none (over idle: {grown['loop']:.1f} / {grown['on_threads']:.1f} MB)",
        ),
    ]
    workers = {
        k: sum(memory[k]["loaded"]["memory"]["by_role_pss_mb"].get("worker", [])) for k in memory
    }
    if workers["on_threads"]:
        report.checks.append(
            Check(
                "async_pss_workers_loop_over_threads",
                "in flight: PSS of the worker processes only",
                workers["loop"] / workers["on_threads"],
                f"none ({workers['loop']:.1f} / {workers['on_threads']:.1f} MB: without the "
                "supervisor, warm parent and dispatcher, alike in both)",
            )
        )


def rounds(rates: list[float]) -> str:
    """How a mean of several drains was made, for a note; nothing for one drain."""
    if len(rates) < 2:
        return ""
    return f"; mean of {len(rates)}: {', '.join(number(rate) for rate in rates)}"


def processes_of(commands: dict[str, str]) -> str:
    """The --processes of phase async's commands (the same in all)."""
    words = commands["defaults"].split()
    return words[words.index("--processes") + 1]


def phase_claims(run: Run) -> None:
    sizes = run.sizes
    progress(f"claims: {sizes.claims:,} each, empty table then big table")
    ours = claims_phase(run.ours, sizes, sizes.claim_batch)
    peer = claims_phase(run.peer, sizes, 1)
    note = f"median of {PIECES} pieces"
    run.report.figures += [
        Figure(
            "claim_rate_empty",
            "claims, empty table",
            "jobs/s",
            ours["empty"]["median"],
            peer["empty"]["median"],
            note=note,
        ),
        Figure(
            "claim_rate_big",
            "claims, big table",
            "jobs/s",
            ours["big"]["median"],
            peer["big"]["median"],
            note=f"{sizes.finished:,} finished + {sizes.ready:,} ready",
        ),
    ]
    run.report.checks += [
        Check(
            "claim_big_over_empty",
            "ours: claims big / empty table",
            ours["big_over_empty"],
            ">= 0.90",
        ),
        Check(
            "peer_claim_big_over_empty",
            "peer: claims big / empty table",
            peer["big_over_empty"],
            "none (for reference)",
        ),
    ]
    run.report.details["claims"] = {"ours": ours, "peer": peer}


# --- claims with a prefix pattern against "*", under concurrency (ours only) ------------


@dataclass
class PrefixRound:
    pattern: str
    bystanders: int  # ready jobs of another queue, older, that the pattern does not take
    claimers: int
    jobs: int
    claims: int
    empty_claims: int  # came back with nothing while ready rows were left (locked by others)
    elapsed_s: float
    rows_locked: int | None  # by one claim of a batch, MariaDB/MySQL only

    @property
    def rate(self) -> float:
        return self.jobs / self.elapsed_s


def rows_locked_by_one_claim(pattern: str, batch: int) -> int | None:
    """InnoDB's count of rows one claim locks (``trx_rows_locked``), the claim rolled back.

    A claim that must sort the matching rows before taking ``batch`` of them
    locks every row it read, and a concurrent claimer then skips them all:
    this is the number that says whether a pattern serialises claims.
    """
    if connection.vendor != "mysql":
        return None
    claimer = register_process(DB, Process.Kind.WORKER)
    query = (
        "SELECT trx_rows_locked FROM information_schema.INNODB_TRX "
        "WHERE trx_mysql_thread_id = CONNECTION_ID()"
    )
    with transaction.atomic():
        claim_jobs(DB, claimer.pk, QueueSelector((pattern,)), limit=batch)
        with connection.cursor() as cursor:
            cursor.execute(query)
            row = cursor.fetchone()
        transaction.set_rollback(True)
    return int(row[0]) if row else None


def prefix_round(run: Run, pattern: str, backlog: bool) -> PrefixRound:
    """``clients`` threads, each a claimer with its own connection and process row, take
    ``claims`` ready jobs (shared out over PREFIX_QUEUES) ``claim_batch`` at a time, all
    at once, until none is left.

    With ``backlog``, as many ready jobs of queue "default", enqueued before
    them, wait meanwhile: a backlog in another queue, which a ``reports*``
    claim has to find its way past and must not lock.
    """
    sizes = run.sizes
    reset_tables()
    bystanders = sizes.claims if backlog else 0
    # plant() shares its jobs out evenly and in order: the bystanders first, then the rest.
    queues = ("default",) * 2 + PREFIX_QUEUES if backlog else PREFIX_QUEUES
    run.ours.plant(0, sizes.claims + bystanders, queues)
    analyze()
    condition = next(QueueSelector((pattern,)).conditions())
    locked = rows_locked_by_one_claim(pattern, sizes.claim_batch)
    start = threading.Barrier(sizes.clients + 1)
    counts: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            process = register_process(DB, Process.Kind.WORKER)
            selector = QueueSelector((pattern,))
            jobs = claims = empty = 0
            start.wait()
            deadline = time.monotonic() + STALL_TIMEOUT
            while time.monotonic() < deadline:
                got = len(claim_jobs(DB, process.pk, selector, limit=sizes.claim_batch))
                claims += 1
                jobs += got
                if not got:
                    if not ReadyExecution.objects.filter(condition).exists():
                        break
                    empty += 1
            else:
                raise RuntimeError(f"claims with {pattern!r} stalled")
            counts.append((jobs, claims, empty))
        except BaseException as exc:
            errors.append(exc)
            start.abort()
        finally:
            connection.close()  # this thread's own

    threads = [threading.Thread(target=claimer) for _ in range(sizes.clients)]
    for thread in threads:
        thread.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"a claimer with {pattern!r} failed: {errors[0]!r}") from errors[0]
    jobs, claims, empty = (sum(c[n] for c in counts) for n in range(3))
    if jobs != sizes.claims:
        raise RuntimeError(f"claims with {pattern!r} took {jobs:,} of {sizes.claims:,} jobs")
    return PrefixRound(pattern, bystanders, sizes.clients, jobs, claims, empty, elapsed, locked)


def prefix_label(r: PrefixRound) -> str:
    return f"claims {r.pattern!r}" + (f" +{r.bystanders:,} other" if r.bystanders else "")


def phase_prefix(run: Run) -> None:
    """Does a prefix pattern serialise claims? The same jobs taken with ``*``, with
    ``reports*``, and with ``reports*`` past a backlog of another queue."""
    sizes = run.sizes
    progress(
        f"prefix: {sizes.claims:,} ready jobs in {', '.join(PREFIX_QUEUES)}, {sizes.clients} "
        f"concurrent claimers, {sizes.claim_batch} per claim: '*', {PREFIX_PATTERN!r}, "
        f"{PREFIX_PATTERN!r} past {sizes.claims:,} older jobs of queue 'default'"
    )
    rounds = [
        prefix_round(run, "*", backlog=False),
        prefix_round(run, PREFIX_PATTERN, backlog=False),
        prefix_round(run, PREFIX_PATTERN, backlog=True),
    ]
    for key, r in zip(("star", "prefix", "prefix_backlog"), rounds, strict=True):
        locked = "" if r.rows_locked is None else f"; one claim locks {r.rows_locked:,} rows"
        note = f"{r.claimers} claimers; {r.empty_claims:,} of {r.claims:,} claims empty{locked}"
        run.report.figures.append(
            Figure(f"claims_{key}", prefix_label(r), "jobs/s", r.rate, None, note=note)
        )
    for key, r in (("prefix", rounds[1]), ("prefix_backlog", rounds[2])):
        run.report.checks.append(
            Check(
                f"{key}_over_star",
                f"ours: {prefix_label(r)} / '*'",
                r.rate / rounds[0].rate,
                "near 1 (issue 13: a prefix must not serialise claims)",
            )
        )
    run.report.details["prefix"] = [{**asdict(r), "rate": r.rate} for r in rounds]


# --- fair queues (issue 38): one tenant's backlog, drains, enqueues; fair against not ---

BACKLOG_TENANT = "A"


def fair_sizes(options: argparse.Namespace) -> FairSizes:
    base = FAIR_SMOKE if options.smoke else FAIR_FULL
    values = {
        name: default
        if getattr(options, f"fair_{name}") is None
        else getattr(options, f"fair_{name}")
        for name, default in asdict(base).items()
    }
    if min(values.values()) < 1:
        raise SystemExit("--fair-backlog, --fair-tenants, --fair-tenant-jobs, --fair-rounds: >= 1")
    return FairSizes(**values)


def tenant_name(n: int) -> str:
    return f"tenant-{n:04d}"


@dataclass
class Starts:
    """The starts made while at least one job of a round waited, whose: A's, everyone
    else's (the round's own; on the non-fair queue the other round's too), and A's fair
    share of them, the sum over them of 1 / (tenants with a job waiting + 1)."""

    a: int
    others: int
    a_fair: float

    @property
    def a_share(self) -> float:
        return self.a / max(1, self.a + self.others)

    @property
    def a_fair_share(self) -> float:
        return self.a_fair / max(1, self.a + self.others)


@dataclass
class Arrival:
    """One round of the other tenants' jobs arriving behind A's backlog, from the job rows
    and the moments the harness saw each enqueue return (committed: visible to claims)."""

    how: str  # "bulk": one bulk_enqueue() per tenant; "one by one": enqueue() calls
    jobs: int
    enqueue_s: float  # from the tenants' release to the last one's return
    wait_ms: dict[str, float]  # enqueued_at → started_at of the round's jobs: p50, p95, ...
    # From the moment each job's enqueue returned (committed) to its start: the wait without
    # the enqueue's own time (its transaction, a lock it waited for: SQLite's write lock).
    committed_wait_ms: dict[str, float]
    # The most tenants that had a job waiting (committed, not started) at the same moment.
    peak_tenants: int
    # A job waiting from its enqueue's commit to its start: what the claims could see, the
    # figure checked. The jobs of a transaction that committed some time after it read the
    # queue's head (their turns count from it) come in behind A's next turns, and take the
    # starts until the head has caught up with them.
    committed_starts: Starts
    # A job waiting from its enqueued_at (the enqueue's call, before its statements) to its
    # start: it counts as waiting while its transaction ran too (on SQLite, while it waited
    # for the write lock).
    starts: Starts
    # A's jobs not started yet when the round's last enqueue returned: A's backlog was
    # still there when the round arrived (0: the scenario did not hold).
    a_waiting: int
    # The starts made while any enqueue call of the round was open, each from its jobs'
    # enqueued_at to its return: each call's window holds at least the starts between its
    # read of the head and its commit, which docs/fairness.md (the stale head) lets its jobs
    # go ahead of A's by. A's starts over the round then fall short of its fair share by no
    # more than this (windows that overlap share their starts, as the tenants released
    # together do; windows one after another add theirs up).
    stale_starts: int


@dataclass
class Backlog:
    """Tenant A's backlog in one queue, the others arriving behind it."""

    queue: str
    fair: bool
    backlog: int
    backlog_enqueue_s: float  # A's bulk_enqueue()
    arrivals: list[Arrival]
    a_span_s: float  # A's first start to its last finish
    drain_rate: float  # every job of the scenario / (first start to last finish)


Interval = list[datetime]  # [from, to], both included


def merged(intervals: list[tuple[datetime, datetime]]) -> list[Interval]:
    """The union of ``intervals``, as disjoint intervals in order."""
    union: list[Interval] = []
    for begin, end in sorted(intervals):
        if union and begin <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([begin, end])
    return union


def peak_overlap(groups: list[list[Interval]]) -> int:
    """The most of ``groups`` (each a union of intervals) covering one moment."""
    # (moment, 0) where an interval begins, (moment, 1) where it ends: at a tie the
    # beginnings count first, the intervals being closed.
    events = sorted((at, end) for union in groups for i in union for end, at in enumerate(i))
    peak = current = 0
    for _, end in events:
        current += -1 if end else 1
        peak = max(peak, current)
    return peak


def covers(union: list[Interval], begins: list[datetime], at: datetime) -> bool:
    """Whether ``at`` falls in ``union`` (``begins``: its intervals' beginnings)."""
    index = bisect.bisect_right(begins, at) - 1
    return index >= 0 and at <= union[index][1]


def starts_while_waiting(
    tenants: list[list[tuple[datetime, datetime]]], a_last: int
) -> tuple[Starts, int]:
    """Whose starts fell while at least one of ``tenants``' jobs waited (each job's
    [from, to] interval), A's fair share of them, and the most tenants waiting at once."""
    unions = [union for union in (merged(spans) for spans in tenants) if union]
    union = merged([span for spans in tenants for span in spans])
    if not union:
        return Starts(0, 0, 0.0), 0
    begins = [interval[0] for interval in union]
    tenant_begins = [[interval[0] for interval in t] for t in unions]
    a = others = 0
    a_fair = 0.0
    window = Job.objects.filter(started_at__gte=union[0][0], started_at__lte=union[-1][1])
    for pk, at in window.values_list("pk", "started_at").iterator(chunk_size=10_000):
        if not covers(union, begins, at):
            continue
        if pk <= a_last:
            a += 1
        else:
            others += 1
        waiting = sum(covers(t, b, at) for t, b in zip(unions, tenant_begins, strict=True))
        a_fair += 1 / (waiting + 1)
    return Starts(a, others, a_fair), peak_overlap(unions)


def arrival(
    how: str,
    ids: dict[str, list[int]],
    visible: dict[int, datetime],
    enqueue_s: float,
    a_last: int,
) -> Arrival:
    """A round's figures. The wait is the rows' ``started_at - enqueued_at`` (the issue's
    figure; ``enqueued_at`` is stamped as the enqueue prepares the job, before its
    statements), and beside it the wait from ``visible``, the moment the enqueue
    returned (committed). Whose starts fell while the round's jobs waited, both ways."""
    every = [pk for tenant_ids in ids.values() for pk in tenant_ids]
    rows = {
        pk: (enqueued, started)
        for pk, enqueued, started in Job.objects.filter(pk__in=every).values_list(
            "pk", "enqueued_at", "started_at"
        )
    }
    waits = [ms(started - enqueued) for enqueued, started in rows.values()]
    committed_waits = [max(0.0, ms(rows[pk][1] - visible[pk])) for pk in every]
    enqueued = [[rows[pk] for pk in tenant_ids] for tenant_ids in ids.values()]
    committed = [
        [(visible[pk], rows[pk][1]) for pk in tenant_ids if visible[pk] <= rows[pk][1]]
        for tenant_ids in ids.values()
    ]
    starts, _ = starts_while_waiting(enqueued, a_last)
    committed_starts, peak = starts_while_waiting(committed, a_last)
    a_waiting = Job.objects.filter(pk__lte=a_last, started_at__gt=max(visible.values())).count()
    if how == "bulk":  # one call per tenant: from its first job's enqueued_at to its return
        calls = [(min(rows[pk][0] for pk in pks), visible[pks[0]]) for pks in ids.values() if pks]
    else:  # a call per job
        calls = [(rows[pk][0], visible[pk]) for pk in every]
    return Arrival(
        how,
        len(every),
        enqueue_s,
        percentiles(waits),
        percentiles(committed_waits),
        peak,
        committed_starts,
        starts,
        a_waiting,
        starts_within(calls),
    )


def starts_within(spans: list[tuple[datetime, datetime]]) -> int:
    """The jobs started within any of ``spans`` (each [from, to], both included)."""
    union = merged(spans)
    if not union:
        return 0
    window = Job.objects.filter(started_at__gte=union[0][0], started_at__lte=union[-1][1])
    began = sorted(window.values_list("started_at", flat=True))
    return sum(
        bisect.bisect_right(began, end) - bisect.bisect_left(began, begin) for begin, end in union
    )


def all_started(ids: dict[str, list[int]]) -> bool:
    every = [pk for tenant_ids in ids.values() for pk in tenant_ids]
    return not Job.objects.filter(pk__in=every, started_at__isnull=True).exists()


def tenant_client() -> int:
    """One tenant of phase "fair"'s rounds (``--tenant-client``), a process of its own as a
    web process is, driven over stdin/stdout.

    Reads its orders (tenant, fair or not, jobs per round) as a JSON line; warms up (its
    connection, and each enqueue path once in a transaction rolled back: the round's first
    call finds the code imported and the caches filled, though a single enqueue in
    autocommit may still build its own statement, which notifies); says ``ready``. Then
    for each line ``bulk`` or ``single``: one ``bulk_enqueue()`` of its jobs, or that
    many ``enqueue()`` calls one after another, each its own transaction; prints the ids
    and the moment each call returned (committed), as seconds since the epoch, as JSON.

    Threads of the harness's own process were the first harness: the 20 tenants' bulk
    transactions then stayed open for hundreds of the workers' starts, waiting for the
    GIL, which no tenant of a real site does.
    """
    orders = json.loads(sys.stdin.readline())
    task = fair_noop if orders["fair"] else tenant_noop
    tenant, per = orders["tenant"], orders["per"]
    backend: JobsBackend = task_backends["default"]
    calls = [(task, (tenant,), {})] * per
    with transaction.atomic():
        backend.bulk_enqueue(calls)
        task.enqueue(tenant)
        transaction.set_rollback(True)
    print("ready", flush=True)
    for line in sys.stdin:
        ids: list[int] = []
        visible: list[float] = []
        if line.strip() == "bulk":
            ids = [int(result.id) for result in backend.bulk_enqueue(calls)]
            visible = [time.time()] * len(ids)
        else:
            for _ in range(per):
                ids.append(int(task.enqueue(tenant).id))
                visible.append(time.time())
        print(json.dumps({"ids": ids, "visible": visible}), flush=True)
    return 0


def ready_tenants(clients: Clients, tenants: list[str], per: int, fair: bool) -> None:
    """Give each client its orders and wait until every one has warmed up."""
    for n, tenant in enumerate(tenants):
        clients.tell(n, json.dumps({"tenant": tenant, "fair": fair, "per": per}))
    lines = clients.collect(START_TIMEOUT, "the tenants' processes to warm up")
    if set(lines) != {"ready"}:
        raise RuntimeError(f"phase fair: a tenant's process said {sorted(set(lines))}")


def tenants_at_once(
    clients: Clients, tenants: list[str], one_by_one: bool
) -> tuple[dict[str, list[int]], dict[int, datetime], float]:
    """Every tenant's process released at once: one ``bulk_enqueue()`` of its jobs, or as
    many ``enqueue()`` calls one after another, each its own transaction. Their ids by
    tenant, the moment each job's enqueue returned (committed), and the time from the
    release to the last return."""
    released = time.time()
    clients.send("single" if one_by_one else "bulk")
    lines = clients.collect(STALL_TIMEOUT, "the tenants' enqueues")
    ids: dict[str, list[int]] = {}
    visible: dict[int, datetime] = {}
    for tenant, line in zip(tenants, lines, strict=True):
        done = json.loads(line)
        ids[tenant] = done["ids"]
        for pk, at in zip(done["ids"], done["visible"], strict=True):
            visible[pk] = datetime.fromtimestamp(at, tz=UTC)
    took = max(visible.values()).timestamp() - released
    return ids, visible, took


def backlog_scenario(run: Run, sizes: FairSizes, fair: bool) -> Backlog:
    """Tenant A bulk-enqueues ``backlog`` jobs; ours' workers start and take them; as soon
    as they do, ``tenants`` other tenants, all at once (a process each), enqueue
    ``tenant_jobs`` jobs each in one ``bulk_enqueue()``; then again, all at once, each its
    jobs one by one (on the fair queue once the first round has all started, so that a
    tenant's second round is not queued behind its first; on the other queue at once:
    both rounds wait for A's backlog whenever they come). Then everything drains."""
    task = fair_noop if fair else tenant_noop
    queue_name = task.queue_name
    kind = "fair" if fair else "non-fair"
    reset_tables()
    progress(f"fair, {kind} queue {queue_name!r}: tenant A's {sizes.backlog:,} jobs, bulk")
    calls = [(task, (BACKLOG_TENANT,), {})] * sizes.backlog
    began = time.perf_counter()
    a_last = max(int(result.id) for result in run.ours.backend.bulk_enqueue(calls))
    backlog_enqueue_s = time.perf_counter() - began
    stored = Job.objects.filter(pk=a_last).values_list("queue_name", "fair_key").get()
    if stored != (queue_name, BACKLOG_TENANT if fair else None):
        raise RuntimeError(f"phase fair: A's job was stored as (queue, fair key) {stored}")
    tenants = [tenant_name(n) for n in range(sizes.tenants)]
    per = sizes.tenant_jobs
    total = sizes.backlog + 2 * per * len(tenants)
    ours = run.ours
    label = f"ours-fair-backlog-{kind}"
    progress(f"fair, {kind}: starting {len(tenants)} tenants' processes")
    with (
        Clients(
            len(tenants), ours.environment(), run.log_dir, f"{label}-tenant", "--tenant-client"
        ) as clients,
    ):
        ready_tenants(clients, tenants, per, fair)
        with Workers(ours.commands(), run.log_dir, label, ours.environment()) as workers:

            def taking_a() -> bool:
                kinds = list(Process.objects.values_list("kind", flat=True))
                return (
                    kinds.count(Process.Kind.WORKER) >= ours.processes
                    and Process.Kind.DISPATCHER in kinds
                    and Job.objects.filter(started_at__isnull=False).exists()
                )

            wait_until(
                taking_a, workers, "run_jobs' workers to start on A's backlog", START_TIMEOUT
            )
            progress(f"fair, {kind}: {len(tenants)} tenants x {per} jobs at once, a bulk each")
            bulk_ids, bulk_visible, bulk_s = tenants_at_once(clients, tenants, False)
            if fair:
                wait_until(
                    lambda: all_started(bulk_ids),
                    workers,
                    "the tenants' bulk-enqueued jobs to start",
                    STALL_TIMEOUT,
                )
            progress(f"fair, {kind}: {len(tenants)} tenants x {per} jobs at once, one by one")
            single_ids, single_visible, single_s = tenants_at_once(clients, tenants, True)
            progress(f"fair, {kind}: draining the rest of A's backlog")
            wait_finished(ours, workers, total)
    failed = ours.failed_count()
    if failed:
        raise RuntimeError(f"phase fair: {failed:,} of {total:,} jobs did not succeed")
    arrivals = [
        arrival("bulk", bulk_ids, bulk_visible, bulk_s, a_last),
        arrival("one by one", single_ids, single_visible, single_s, a_last),
    ]
    a_jobs = Job.objects.filter(pk__lte=a_last)
    a_span = a_jobs.aggregate(first=Min("started_at"), last=Max("finished_at"))
    first, last = ours.span()
    return Backlog(
        queue_name,
        fair,
        sizes.backlog,
        backlog_enqueue_s,
        arrivals,
        (a_span["last"] - a_span["first"]).total_seconds(),
        total / (last - first).total_seconds(),
    )


def fair_drains(run: Run, rounds: int) -> dict[str, Any]:
    """``--jobs`` no-op jobs over ``--keys`` tenants, one bulk enqueue, drained by fresh
    workers of ours: in the fair queue, and the same calls in queue "default" (not fair),
    in pairs, who goes first alternating (F N, N F, ...). The ratio is fair / non-fair of
    the mean rates; each pair's own ratio beside it."""
    count, keys = run.sizes.jobs, run.sizes.keys
    calls = {
        kind: [(task, (tenant_name(n % keys),), {}) for n in range(count)]
        for kind, task in (("fair", fair_noop), ("plain", tenant_noop))
    }
    drains: dict[str, list[Drain]] = {"fair": [], "plain": []}
    for pair in range(rounds):
        order = ("fair", "plain") if pair % 2 == 0 else ("plain", "fair")
        for kind in order:
            progress(
                f"fair drain {pair + 1}/{rounds}, {kind}: {count:,} jobs over {keys:,} tenants"
            )
            plant = lambda k=kind: run.ours.backend.bulk_enqueue(calls[k])  # noqa: E731
            drains[kind].append(
                drain(run.ours, count, plant, run.log_dir, f"ours-fair-{kind}-{pair}")
            )
    fair_mean = statistics.mean(d.rate for d in drains["fair"])
    plain_mean = statistics.mean(d.rate for d in drains["plain"])
    return {
        "jobs": count,
        "keys": keys,
        "fair": [asdict(d) for d in drains["fair"]],
        "plain": [asdict(d) for d in drains["plain"]],
        "fair_rate": fair_mean,
        "plain_rate": plain_mean,
        "ratio": fair_mean / plain_mean,
        "pair_ratios": [
            f.rate / p.rate for f, p in zip(drains["fair"], drains["plain"], strict=True)
        ],
        "fair_cpu_ms": statistics.mean(d.cpu["ms_per_job"] for d in drains["fair"]),
        "plain_cpu_ms": statistics.mean(d.cpu["ms_per_job"] for d in drains["plain"]),
        "fair_server_cpu_ms": statistics.mean(d.server_cpu["ms_per_job"] for d in drains["fair"]),
        "plain_server_cpu_ms": statistics.mean(d.server_cpu["ms_per_job"] for d in drains["plain"]),
        "fair_plant_s": statistics.mean(d.plant_s for d in drains["fair"]),
        "plain_plant_s": statistics.mean(d.plant_s for d in drains["plain"]),
    }


def statements_of(enqueue: Callable[[], object]) -> dict[str, Any]:
    """The statements one enqueue sends on the harness's connection, each timed here
    (Django's own record rounds to the millisecond, more than most of them take)."""
    statements: list[dict[str, Any]] = []

    def timed(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            took = (time.perf_counter() - began) * 1000
            statements.append({"ms": round(took, 3), "sql": " ".join(str(sql).split())[:300]})

    with connection.execute_wrapper(timed):
        began = time.perf_counter()
        enqueue()
        took = time.perf_counter() - began
    return {
        "count": len(statements),
        "wall_ms": took * 1000,
        "sql_ms": sum(s["ms"] for s in statements),
        "statements": statements,
    }


STATEMENT_SAMPLES = 40  # single enqueues of each kind, alternated, read statement by statement


def enqueue_statements(tenants: list[str]) -> dict[str, dict[str, Any]]:
    """Where one enqueue's time goes, plain and fair: :func:`statements_of` of
    STATEMENT_SAMPLES enqueues of each, alternated, over the tenants; the median wall and
    SQL time, and each statement of the last one with its median time."""
    samples: dict[str, list[dict[str, Any]]] = {"plain": [], "fair": []}
    for n in range(STATEMENT_SAMPLES):
        for kind, task in (("plain", tenant_noop), ("fair", fair_noop))[:: 1 if n % 2 else -1]:
            tenant = tenants[n % len(tenants)]
            samples[kind].append(statements_of(lambda t=task, k=tenant: t.enqueue(k)))
    result = {}
    for kind, runs in samples.items():
        last = runs[-1]
        same = [r for r in runs if r["count"] == last["count"]]
        result[kind] = {
            "count": last["count"],
            "wall_ms": statistics.median(r["wall_ms"] for r in runs),
            "sql_ms": statistics.median(r["sql_ms"] for r in runs),
            "samples": len(runs),
            "statements": [
                {**statement, "ms": statistics.median(r["statements"][i]["ms"] for r in same)}
                for i, statement in enumerate(last["statements"])
            ],
        }
    return result


def fair_enqueues(run: Run) -> dict[str, Any]:
    """``enqueue()`` one by one in autocommit, ``--enqueue`` jobs each: the fair task over
    ``--keys`` tenants (round robin) against the same calls of its non-fair twin, in turns
    piece by piece (who goes first alternating: :func:`timed_in_turns`). Every tenant has
    one job of each kind first (one bulk enqueue each, not timed): the fair groups' stamps
    exist, as in service, where a tenant's first job is the exception."""
    count, keys = run.sizes.enqueue, run.sizes.keys
    reset_tables()
    tenants = [tenant_name(n) for n in range(keys)]
    backend = run.ours.backend
    for task in (tenant_noop, fair_noop):
        backend.bulk_enqueue([(task, (tenant,), {}) for tenant in tenants])
        task.enqueue(tenants[0])  # warm-up of the one-by-one path

    def enqueuer(task: Any) -> Callable[[int], int]:
        position = itertools.count()

        def enqueue(n: int) -> int:
            for _ in range(n):
                task.enqueue(tenants[next(position) % keys])
            return n

        return enqueue

    plain, fair = timed_in_turns(count, [enqueuer(tenant_noop), enqueuer(fair_noop)])
    expected = 2 * (keys + 1 + count)
    if Job.objects.count() != expected:
        raise RuntimeError(f"phase fair: {Job.objects.count():,} rows, {expected:,} expected")
    statements = enqueue_statements(tenants)
    return {
        "jobs": count,
        "keys": keys,
        "plain": asdict(plain),
        "fair": asdict(fair),
        "ratio": fair.median / plain.median,
        "statements": statements,
    }


def share_note(starts: Starts) -> str:
    total = starts.a + starts.others
    return (
        f"{starts.a:,} of {total:,} ({100 * starts.a_share:.1f}%, fair share "
        f"{100 * starts.a_fair_share:.1f}%)"
    )


def wait_note(a: Arrival) -> str:
    w, c = a.wait_ms, a.committed_wait_ms
    return (
        f"p50 {number(w['p50'])}, max {number(w['max'])} ms; from the commit p50 "
        f"{number(c['p50'])}, p95 {number(c['p95'])} ms"
    )


def phase_fair(run: Run) -> None:
    """Issue 38's figures, ours against ours, same run: the other tenants' wait behind one
    tenant's backlog in a fair queue and in one that is not, the drain over many fair keys
    and the one-by-one enqueue with a fair key, each against the same in a non-fair queue."""
    sizes = fair_sizes(OPTIONS)
    report = run.report
    groups = sizes.tenants + 1
    backlogs = [backlog_scenario(run, sizes, fair=True), backlog_scenario(run, sizes, fair=False)]
    drains = fair_drains(run, sizes.rounds)
    progress(f"fair enqueue: {run.sizes.enqueue:,} one by one each, in turns")
    enqueues = fair_enqueues(run)
    total = sizes.backlog + 2 * sizes.tenants * sizes.tenant_jobs
    for b in backlogs:
        name = "fair" if b.fair else "non-fair"
        key = "fair" if b.fair else "plain"
        for a in b.arrivals:
            how = "bulk" if a.how == "bulk" else "1by1"
            label = f"{name}: wait p95, {a.how}"
            held = "" if a.a_waiting else "; A's backlog was gone before they all arrived"
            held = f"; at most {a.peak_tenants} tenants waiting at once{held}"
            report.figures.append(
                Figure(
                    f"{key}_wait_p95_{how}",
                    label,
                    "ms",
                    a.wait_ms["p95"],
                    None,
                    higher_is_better=False,
                    note=f"{wait_note(a)}; {a.jobs:,} jobs{held}",
                )
            )
        bulk, single = b.arrivals
        report.figures.append(
            Figure(
                f"{key}_a_share",
                f"{name}: A's share of starts",
                "%",
                100 * bulk.committed_starts.a_share,
                None,
                note=f"{share_note(bulk.committed_starts)} while a tenant's bulk job waited "
                f"(committed, not started); from its enqueued_at: {share_note(bulk.starts)}; "
                f"one by one: {share_note(single.committed_starts)}, from the enqueued_at "
                f"{share_note(single.starts)}",
            )
        )
        report.figures.append(
            Figure(
                f"{key}_a_span",
                f"{name}: A's backlog drained in",
                "s",
                b.a_span_s,
                None,
                higher_is_better=False,
                note=f"its first start to its last finish; all {total:,} jobs at "
                f"{number(b.drain_rate)}/s; A's bulk enqueue {b.backlog_enqueue_s:.1f} s",
            )
        )
    keys = drains["keys"]
    for kind, label in (
        ("fair", f"drain, {keys:,} fair keys"),
        ("plain", "drain, same, non-fair queue"),
    ):
        rates = ", ".join(number(d["rate"]) for d in drains[kind])
        report.figures.append(
            Figure(
                f"{kind}_keys_drain_rate",
                label,
                "jobs/s",
                drains[f"{kind}_rate"],
                None,
                note=f"mean of {rates}; CPU ms/job: worker {drains[f'{kind}_cpu_ms']:.2f}, "
                f"server {drains[f'{kind}_server_cpu_ms']:.2f}; "
                f"bulk enqueue {drains[f'{kind}_plant_s']:.1f} s",
            )
        )
    statements = enqueues["statements"]
    for kind, label in (
        ("fair", "enqueue one by one, fair key"),
        ("plain", "enqueue 1 by 1, non-fair queue"),
    ):
        s = statements[kind]
        report.figures.append(
            Figure(
                f"{kind}_enqueue_rate",
                label,
                "jobs/s",
                enqueues[kind]["median"],
                None,
                note=f"median of {PIECES} pieces, in turns; one enqueue: {s['count']} statements "
                f"(the commit aside), {s['sql_ms']:.2f} ms of SQL in {s['wall_ms']:.2f} ms "
                f"(medians of {s['samples']})",
            )
        )
    fair_b, plain_b = backlogs
    for a, today in zip(fair_b.arrivals, plain_b.arrivals, strict=True):
        report.checks.append(
            Check(
                f"fair_wait_p95_{'bulk' if a.how == 'bulk' else '1by1'}",
                f"ours: fair, tenants' wait p95 (s), {a.how}",
                a.wait_ms["p95"] / 1000,
                f"<= 1 (issue 38; non-fair queue: {today.wait_ms['p95'] / 1000:.1f} s)",
            )
        )
    bulk, today = fair_b.arrivals[0].committed_starts, plain_b.arrivals[0].committed_starts
    report.checks.append(
        Check(
            "fair_a_share",
            "ours: fair, A's share of starts (%), bulk",
            100 * bulk.a_share,
            f">= {100 * bulk.a_fair_share:.2f}, its fair share over those starts (1/{groups} = "
            f"{100 / groups:.2f} with all {sizes.tenants} waiting; non-fair queue: "
            f"{100 * today.a_share:.1f} of {100 * today.a_fair_share:.1f})",
        )
    )
    stale = fair_b.arrivals[0].stale_starts
    report.checks.append(
        Check(
            "fair_a_shortfall",
            "ours: fair, A's starts short of its share, bulk",
            bulk.a_fair - bulk.a,
            f"<= {stale}, the starts made while any tenant's bulk enqueue call was open "
            "(docs/fairness.md: a transaction's jobs go ahead by at most the starts between its "
            "read of the head and its commit)",
        )
    )
    pairs = ", ".join(f"{r:.2f}" for r in drains["pair_ratios"])
    report.checks.append(
        Check(
            "fair_drain_over_plain",
            f"ours: drain {keys:,} fair keys / non-fair",
            drains["ratio"],
            f">= 0.9 (issue 38; pairs: {pairs})",
        )
    )
    report.checks.append(
        Check(
            "fair_enqueue_over_plain",
            "ours: enqueue fair key / non-fair",
            enqueues["ratio"],
            ">= 0.9 (issue 38)",
        )
    )
    report.details["fair"] = {
        "sizes": asdict(sizes),
        "backlog": [
            {
                **asdict(b),
                "arrivals": [
                    {
                        **asdict(a),
                        "a_share": a.starts.a_share,
                        "a_fair_share": a.starts.a_fair_share,
                        "committed_a_share": a.committed_starts.a_share,
                        "committed_a_fair_share": a.committed_starts.a_fair_share,
                    }
                    for a in b.arrivals
                ],
            }
            for b in backlogs
        ],
        "drains": drains,
        "enqueues": enqueues,
    }


PHASE_RUNNERS: dict[str, Callable[[Run], None]] = {
    "enqueue": phase_enqueue,
    "concurrent": phase_concurrent,
    "bulk": phase_bulk,
    "drain": phase_drain,
    "keyed": phase_keyed,
    "rated": phase_rated,
    "workflow": phase_workflow,
    "latency": phase_latency,
    "claims": phase_claims,
    "limit": phase_limit,
    "procrastinate": phase_procrastinate,
    "oban": phase_oban,
    "async": phase_async,
    "prefix": phase_prefix,
    "fair": phase_fair,
}


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"


def times(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio else "-"


# Peers beside django-tasks-db: (Figure attribute, column heading, name).
PEER_COLUMNS = (("procrastinate", "procrast.", "Procrastinate"), ("oban", "oban", "Oban"))


def print_table(report: Report) -> None:
    """The figures, ours against each peer; then each rate against the limit; the checks."""
    # The other peers' columns, each only when one of its phases ran.
    extra = [
        (attr, heading, name)
        for attr, heading, name in PEER_COLUMNS
        if any(getattr(f, attr) is not None for f in report.figures)
    ]
    headings = "".join(f"{heading:>11}{'ratio':>8}" for _, heading, _ in extra)
    print()
    print(f"{'figure':<32}{'unit':>7}{'ours':>10}{'tasks-db':>10}{'ratio':>8}{headings}  note")
    for f in report.figures:
        columns = "".join(
            f"{number(getattr(f, attr)):>11}{times(f.against(getattr(f, attr))):>8}"
            for attr, _, _ in extra
        )
        note = f"{'' if f.higher_is_better else 'lower is better; '}{f.note}".strip("; ")
        print(
            f"{f.label:<32}{f.unit:>7}{number(f.ours):>10}{number(f.peer):>10}"
            f"{times(f.ratio):>8}{columns}  {note}"
        )
    peers = "; ".join(
        ["tasks-db: django-tasks-db", *(f"{heading}: {name}" for _, heading, name in extra)]
    )
    print(f"{peers}. ratio > 1: ours is better (rates: ours / peer; times, memory: peer / ours)")
    for line in report.notes:
        print(line)
    if report.limit:
        print()
        drains = len(report.details["limit"]["drains"])
        print(
            f"against the limit (raw-SQL queue, same database, same run): drain "
            f"{number(report.limit['drain'])} jobs/s (median of {drains}; CPU ms/job: worker "
            f"{report.limit['cpu_ms_per_job']:.2f}, server "
            f"{report.limit['server_cpu_ms_per_job']:.2f}), "
            f"enqueue one by one {number(report.limit['enqueue'])} jobs/s"
        )
        for share in report.shares:
            limit = report.limit[share.limit_key]
            print(f"  {share.label:<44}{number(share.rate):>8} jobs/s{share.rate / limit:>8.1%}")
    if report.checks:
        print()
    width = max((len(c.label) for c in report.checks), default=0) + 2
    for c in report.checks:
        print(f"{c.label:<{width}}{c.value:>6.2f}  target {c.target}")
    if report.skipped:
        print()
    for line in report.skipped:
        print(line)


def limit_checks(report: Report) -> None:
    """The share target, once both drains are in: issue 24's 20% (issue 13 had asked 40%)."""
    drains = {share.key: share.rate for share in report.shares}
    if report.limit and "drain_ours" in drains:
        value = drains["drain_ours"] / report.limit["drain"]
        label = "ours: drain / limit drain"
        report.checks.append(Check("drain_over_limit", label, value, ">= 0.20 (issue 24)"))


# --- the run's circumstances -----------------------------------------------------------


def git_commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit} + uncommitted changes" if dirty else commit


def wakeup(conf: JobsSettings) -> tuple[str, str]:
    """How idle workers of ours learn of a new job in this tree: (short, long).

    The latency figure drops when LISTEN/NOTIFY is active, so the report says
    which of the two it measured.
    """
    polling = f"polling every {conf.polling_interval:g} s"
    if connection.vendor != "postgresql" and conf.ready_check_interval is not None:
        return "ready check", (
            f"the supervisor's ready check every {conf.ready_check_interval:g} s "
            f"(docs/running.md), each worker polling every {conf.fallback_polling_interval:g} s "
            f"as fallback ({polling} without the check)"
        )
    if connection.vendor != "postgresql" or conf.listen_notify is False:
        return "polling", f"{polling}; no LISTEN/NOTIFY on this database or with these settings"
    return "LISTEN/NOTIFY", f"LISTEN/NOTIFY (notified at or after commit), {polling} as fallback"


def circumstances(run: Run) -> dict[str, Any]:
    conf = JobsSettings.load()
    return {
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "django": django.get_version(),
        "django_tasks_db": version("django-tasks-db"),
        "database": f"{connection.vendor} {server_version()} ({database_name()})",
        "git": git_commit(),
        "debug": settings.DEBUG,
        "ours": {
            "command": run.ours.commands()[0][2:],
            "processes": run.ours.processes,
            "threads": run.ours.threads,
            "wakeup": wakeup(conf)[1],
            "batch_size": conf.batch_size,
        },
        "peer": {
            "command": run.peer.commands()[0][2:],
            "processes": run.peer.processes,
            "defaults": "--interval 1, random startup delay up to 1 s, no --reload (DEBUG off)",
        },
        "limit": {
            "processes": run.ours.processes,
            "threads": run.ours.threads,
            "batch": run.limit_batch,
        },
        "procrastinate": {
            "version": version("procrastinate") if find_spec("procrastinate") else None,
            "processes": run.ours.processes,
            "concurrency": run.ours.threads,
            "pool": run.ours.threads + 1,
            "task": run.procrastinate_task,
        },
        "oban": {
            "version": version("oban") if find_spec("oban") else None,
            "licence": oban_licence(),
            "processes": run.ours.processes,
            "queue_limit": run.ours.threads,
            "command": f"oban start --queues {OBAN_QUEUE}:{run.ours.threads} "
            "--cron-modules bench.oban_tasks",
        },
        "worker_cpu": "utime+stime+cutime+cstime of /proc/PID/stat, every process of the "
        "workers' sessions, from before the drain's enqueue to the poll that saw all finished",
        "server_cpu": "the same, of every process of the local database server (by command "
        "name), from the drain's enqueue's commit to the poll that saw all finished",
    }


def oban_licence() -> str | None:
    """The licence its package declares (License-Expression, else License)."""
    if find_spec("oban") is None:
        return None
    from importlib.metadata import metadata

    meta = metadata("oban")
    return meta.get("License-Expression") or meta.get("License")


def print_header(info: dict[str, Any], sizes: Sizes) -> None:
    ours, peer = info["ours"], info["peer"]
    print(f"machine: {info['cores']} cores, load {info['load_average']}, Python {info['python']}")
    print(f"django {info['django']}, django-tasks-db {info['django_tasks_db']}, git {info['git']}")
    prepare = connection.settings_dict["OPTIONS"].get("prepare_threshold")
    prepared = f", prepare_threshold={prepare}" if prepare is not None else ""
    print(
        f"database: {info['database']}, CONN_MAX_AGE=600 for both{prepared}, DEBUG={info['debug']}"
    )
    print(
        f"ours: {' '.join(ours['command'])} (+ supervisor, dispatcher); wakes by {ours['wakeup']}"
    )
    print(
        f"peer: {peer['processes']} x {' '.join(peer['command'])}; its defaults otherwise "
        f"({peer['defaults']}); one job at a time per process"
    )
    print(
        f"sizes: {sizes.enqueue:,} enqueued one by one; {sizes.jobs:,} bulk-enqueued, then "
        f"drained (and over {sizes.keys:,} keys, limit 1); {sizes.latency_samples:,} latency "
        f"samples, one every {sizes.latency_interval_ms:g} ms; {sizes.claims:,} claims "
        f"({sizes.claim_batch} per claim of ours, 1 per peer's) among {sizes.finished:,} "
        f"finished + {sizes.ready:,} ready rows vs none; {sizes.clients} concurrent "
        f"enqueuing processes x {sizes.client_seconds:g} s x {sizes.client_rounds} round(s) "
        f"per LISTEN/NOTIFY setting"
    )
    print("bulk enqueue of the peer: it has no bulk API; enqueue() in a loop in one atomic()")
    if "workflow" in info["phases"]:
        print(
            f"workflow: noop as 1 root, {sizes.jobs - 2:,} nodes after it, 1 sink after all of "
            f"those; workflow() against django_jobs.bulk_enqueue() of {sizes.jobs:,}, "
            "in-process, alternated; drained by ours' workers as above"
        )
    limit, procrastinate = info["limit"], info["procrastinate"]
    if "limit" in info["phases"] and connection.vendor == "postgresql":
        print(
            f"limit: bench/limit_queue.py, {limit['processes']} processes x {limit['threads']} "
            f"threads; each process claims {limit['batch']} jobs at a time (FOR UPDATE SKIP "
            "LOCKED) on its one psycopg connection, runs them on its threads, marks them done "
            "in one statement"
        )
    if "procrastinate" in info["phases"] and procrastinate_unavailable() is None:
        print(
            f"procrastinate {procrastinate['version']}: Django integration, "
            f"{procrastinate['processes']} x bench/procrastinate_worker.py --concurrency "
            f"{procrastinate['concurrency']} (pool of {procrastinate['pool']} connections, "
            f"LISTEN/NOTIFY on, its defaults otherwise), {procrastinate['task']} no-op task, "
            "defer() one by one, batch_defer() for the drain"
        )
    oban = info["oban"]
    if "oban" in info["phases"] and oban_unavailable() is None:
        print(
            f"oban {oban['version']} ({oban['licence']}): {oban['processes']} x "
            f"python -m {oban['command']} (uvloop, LISTEN/NOTIFY, pool of 1-10 connections, "
            "its defaults otherwise), async no-op worker; Worker.enqueue() one by one from "
            "an async psycopg pool, enqueue_many() for the drain (one INSERT per job, one "
            "transaction)"
        )
    if "async" in info["phases"]:
        print_async_header(info, async_sizes(OPTIONS))
    if "fair" in info["phases"]:
        print_fair_header(sizes, fair_sizes(OPTIONS))
    print(f"load average at the end: {info['load_average_end']}")


def print_async_header(info: dict[str, Any], sizes: AsyncSizes) -> None:
    """Phase async's setups, as its details recorded them (or would have)."""
    phase = info.get("async") or {}
    processes = OPTIONS.processes or ASYNC_PROCESSES
    old_way = f"; the old way drains {sizes.threaded_jobs:,}" if sizes.threaded_jobs else ""
    print(
        f"async: {sizes.jobs:,} jobs awaiting asyncio.sleep({sizes.sleep_s:g}) (bench/tasks.py "
        f"sleep_async) drained by {processes} worker processes, against {sizes.jobs:,} no-op "
        f"jobs{old_way}; memory and connections with "
        f"{sizes.in_flight:,} sleeping {sizes.in_flight_s:g} s in flight; latency of async "
        f"no-op probes idle, then under {sizes.load:,} in flight"
    )
    if phase:
        print(
            f"  load average during the phase: {phase['load_average_start']} at its start, "
            f"{phase['load_average_end']} at its end"
        )
    for key, command in phase.get("commands", {}).items():
        print(f"  {key}: {command}")
    if async_procrastinate_unavailable() is None:
        version = info["procrastinate"]["version"]
        print(
            f"  procrastinate {version}: {processes} x bench/procrastinate_worker.py "
            f"--concurrency C --pool min(C + 1, {OPTIONS.procrastinate_pool}) for C in "
            f"{', '.join(map(str, procrastinate_concurrencies()))} (30: its docs' example; "
            "200: ours' async_jobs), the same async task, batch_defer() for the drain"
        )


def print_fair_header(sizes: Sizes, fair: FairSizes) -> None:
    """Phase fair's scenario, in the words of the report."""
    print(
        f"fair: queue {FAIR_QUEUE!r} in DJANGO_JOBS['fair_queues'], fair_key = the tenant "
        "(bench/fair_tasks.py fair_noop), against the same no-op in queue 'default', not fair "
        "(tenant_noop); ours' workers as above. Backlog: tenant A's "
        f"{fair.backlog:,} jobs in one bulk_enqueue(), the workers started, and once they "
        f"take A's jobs {fair.tenants} other tenants x {fair.tenant_jobs} jobs, all at once "
        "(a process each, warmed up before the workers start), one bulk_enqueue() per "
        "tenant; then (fair queue: "
        "once those all started; the other: at once) again, each tenant's jobs one by one, "
        "each its own transaction; wait = the rows' "
        f"started_at - enqueued_at. Drains: {sizes.jobs:,} jobs over {sizes.keys:,} tenants, "
        f"{fair.rounds} pair(s), alternated. Enqueue: {sizes.enqueue:,} one by one each, "
        f"round robin over {sizes.keys:,} tenants, in turns"
    )


# --- main ------------------------------------------------------------------------------


def resolve_sizes(options: argparse.Namespace, threads: int) -> Sizes:
    base = SMOKE if options.smoke else FULL
    values = {
        name: getattr(options, name) if getattr(options, name) is not None else default
        for name, default in asdict(base).items()
    }
    values["claim_batch"] = values["claim_batch"] or threads
    sizes = Sizes(**values)
    if sizes.ready < sizes.claims + sizes.claim_batch:
        raise SystemExit("--ready must hold at least --claims + --claim-batch jobs")
    if sizes.latency_samples < 2:
        raise SystemExit("--latency-samples must be at least 2")
    if sizes.jobs < 3:
        raise SystemExit("--jobs must be at least 3 (the workflow: root, fan-out, sink)")
    return sizes


def write_json(path: Path, info: dict[str, Any], run: Run, elapsed: float) -> None:
    document = {
        "circumstances": info,
        "sizes": asdict(run.sizes),
        "figures": [f.as_json() for f in run.report.figures],
        "checks": [asdict(c) for c in run.report.checks],
        "limit": run.report.limit,
        "shares_of_limit": [
            {**asdict(share), "share": share.rate / run.report.limit[share.limit_key]}
            for share in run.report.shares
            if run.report.limit
        ],
        "skipped": run.report.skipped,
        "details": run.report.details,
        "elapsed_s": elapsed,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


def main() -> int:
    if OPTIONS.enqueue_client:
        return enqueue_client()
    if OPTIONS.tenant_client:
        return tenant_client()
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the workers
    check_database_name()
    create_database()
    call_command("migrate", interactive=False, verbosity=0)
    cores = os.cpu_count() or 1
    ours = Ours(OPTIONS.processes or cores, OPTIONS.threads or DEFAULT_THREADS)
    sizes = resolve_sizes(OPTIONS, ours.threads)
    run = Run(
        sizes,
        ours,
        Peer(OPTIONS.peer_processes),
        Path(tempfile.mkdtemp(prefix="jobs-")),
        # At most this many unrecorded jobs per process: ours' bound (docs/running.md).
        limit_batch=OPTIONS.limit_batch or 2 * ours.threads,
        procrastinate_task=OPTIONS.procrastinate_task,
    )
    info = circumstances(run)
    selected = set(OPTIONS.phases.split(","))
    info["phases"] = [phase for phase in PHASES if phase in selected]
    try:
        for phase in info["phases"]:
            phase_began = time.perf_counter()
            PHASE_RUNNERS[phase](run)
            took = time.perf_counter() - phase_began
            run.report.details.setdefault("phase_seconds", {})[phase] = round(took, 1)
            progress(f"{phase}: {took:.1f} s")
    except RuntimeError as exc:  # a worker died, a job failed, the queue stalled
        print(f"FAILED: {exc}\nworker logs kept in {run.log_dir}", file=sys.stderr)
        return 1
    except BaseException:
        print(f"worker logs kept in {run.log_dir}", file=sys.stderr)
        raise
    finally:
        reset_tables()
    if OPTIONS.keep_logs:
        progress(f"worker logs in {run.log_dir}")
    else:
        shutil.rmtree(run.log_dir, ignore_errors=True)
    elapsed = time.perf_counter() - began
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if "async" in run.report.details:
        info["async"] = {
            key: run.report.details["async"][key]
            for key in ("commands", "load_average_start", "load_average_end")
        }
    limit_checks(run.report)
    print_header(info, sizes)
    print_table(run.report)
    print(f"\nwhole run: {elapsed:.1f} s")
    if OPTIONS.json:
        write_json(OPTIONS.json, info, run, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
