"""A chaos soak: a mixed workload under random faults, audited from the jobs' own records.

    python bench/soak.py --db postgres|mariadb|sqlite --duration SECONDS
                         [--processes P] [--threads T] [--seed N] [--rate R]
                         [--json PATH] [--keep-logs] [--restart-db] [--unfair]

Run from the repository root (Linux: worker processes are found in /proc). The
database is ``--db``'s (``jobs_soak`` on 127.0.0.1, or /tmp/jobs_soak.sqlite3),
else ``DATABASE_URL``'s; it is created if missing and migrated, and its name
must contain "soak": the run empties django_jobs' tables first.

For ``--duration`` seconds the driver enqueues a mix (bench/soak_tasks.py):
plain jobs, keyed jobs (limits 1-3), rate-limited jobs, unique jobs, batches
with an on_finish callback, jobs it cancels (waiting and running), jobs that
time out, jobs that snooze, and hostile jobs (a NUL in a return value or an
error message, a return value nested 40 deep or of 2 MB, an exception whose
``__str__`` raises), each followed by a canary job, and the jobs of five
tenants in a fair queue (docs/fairness.md): a heavy one's bulk backlogs, a
weighted one's bursts, light ones' few jobs, some sent into each backlog; a
recurring task ticks every second. Meanwhile it injects faults, in shuffled
rounds: SIGKILL a worker process, SIGKILL a supervisor (and start a new
``run_jobs``), terminate every connection of the soak's database but the
driver's own (PostgreSQL, MariaDB) and, only with ``--restart-db``, restart the
database server (never in CI: the servers are shared).

Then it stops the workers gracefully, lets a clean ``run_jobs`` drain what is
left and recovery settle dead processes' claims, and audits from the records
each job body wrote (job id, attempt, start and end times) joined with the
job rows. It prints one line per figure with its bound and exits 1 if any
figure is over it (2 if the run itself failed).

The fair queue's share audit (``share_excesses``): over each fair job's wait,
from its enqueue's commit to its first claim, no other tenant may have been
claimed more than its share, ``w_i * (S_g + 1) / w_g + 1`` claims (the rule's
bound, ``S_g`` the claims of the job's own tenant ahead of it), plus a
tolerance of 2 x processes x threads claims. The run and its workers declare
the fair queue in settings of their own (``soak_settings``,
``worker_settings``). ``--unfair`` runs the audit's twin: the same queue, left
out of ``fair_queues``, its jobs given no key, so in FIFO order; the audit must
then count violations (and the run exit 1).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

# Seconds a SIGKILL may take to land after the time is read and it is sent: a body that
# starts within them in the victim ended with it.
KILL_LANDS_WITHIN = 0.5
ROOT = Path(__file__).resolve().parent.parent
DATABASE_URLS = {
    "postgres": "postgres://postgres@127.0.0.1:5432/jobs_soak",
    "mariadb": "mysql://root@127.0.0.1:3306/jobs_soak",
    "sqlite": "sqlite:////tmp/jobs_soak.sqlite3",
}
SAFE_NAME_PART = "soak"
RECURRING_KEY = "soak-tick"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=sorted(DATABASE_URLS), help="default: DATABASE_URL")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (300)")
    parser.add_argument("--processes", type=int, default=2, help="run_jobs --processes (2)")
    parser.add_argument("--threads", type=int, default=4, help="run_jobs --threads (4)")
    parser.add_argument("--seed", type=int, help="random seed (default: from the clock)")
    parser.add_argument("--rate", type=float, default=12.0, help="workload actions per second")
    parser.add_argument(
        "--fault-every",
        type=float,
        nargs=2,
        default=(3.0, 8.0),
        metavar=("MIN", "MAX"),
        help="seconds between two faults, drawn uniformly (3 8)",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=180.0, help="seconds the final drain may take"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs and records")
    parser.add_argument(
        "--restart-db",
        action="store_true",
        help="also restart the database server as a fault (PostgreSQL, MariaDB); only when "
        "nothing else uses the server",
    )
    parser.add_argument(
        "--unfair",
        action="store_true",
        help="the share audit's twin: the fair kind's queue is not fair and its jobs have no "
        "key (FIFO order); the audit must report violations",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    OPTIONS = parse_args()
    # Settings are read at django.setup(): the environment must be ready before it.
    sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ.setdefault("DEBUG", "false")  # no connection.queries piling up for minutes
    if OPTIONS.db:
        os.environ["DATABASE_URL"] = DATABASE_URLS[OPTIONS.db]
    os.environ.setdefault("DATABASE_URL", DATABASE_URLS["postgres"])
    os.environ.pop("TEST_DATABASE_NAME", None)
    import django

    django.setup()

from django.conf import settings  # noqa: E402
from django.db import DatabaseError, connection  # noqa: E402
from django.test import override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402

import django_jobs  # noqa: E402
from bench import soak_tasks as tasks  # noqa: E402
from django_jobs import bulk_enqueue, enqueue_batch  # noqa: E402
from django_jobs.exceptions import JobAlreadyFinished  # noqa: E402
from django_jobs.models import (  # noqa: E402
    FINISHED_STATUSES,
    Batch,
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
    ReadyExecution,
    RecurringExecution,
    ScheduledExecution,
    Semaphore,
)
from django_jobs.runtime.worker import unrecorded_bound  # noqa: E402
from tests.harness import (  # noqa: E402
    RunJobs,
    descendant_pids,
    max_overlap,
    most_in_any_period,
    pid_alive,
    prepare_soak_database,
    wait_until,
)

PROCESS_DIED = "django_jobs.exceptions.ProcessDied"
JOB_CANCELLED = "django_jobs.exceptions.JobCancelled"
JOB_TIMEOUT = "django_jobs.exceptions.JobTimeout"
WORKER_SHUTDOWN = "django_jobs.exceptions.WorkerShutdown"
RESULT_NOT_STORED = "django_jobs.exceptions.ResultNotStored"

# The workers' clocks: heartbeats every 0.5 s, dead after 5 s without one, so recovery
# of a dead process's claims happens within the run; polls and the dispatcher fast
# enough that snoozes, retries and rate-limited jobs come back within a second.
WORKER_ENV = {
    "DEBUG": "false",
    "JOBS_POLLING_INTERVAL": "0.1",
    "JOBS_DISPATCHER_INTERVAL": "0.2",
    "JOBS_HEARTBEAT_INTERVAL": "0.5",
    "JOBS_ALIVE_THRESHOLD": "5",
    "JOBS_SHUTDOWN_TIMEOUT": "3",
    "JOBS_INTERRUPT_GRACE": "2",
    "JOBS_CANCEL_POLL_INTERVAL": "0.5",
    "JOBS_LOG_LEVEL": "INFO",
}
RECURRING = {RECURRING_KEY: {"task": "bench.soak_tasks.tick", "schedule": "every 1 second"}}
ALIVE_THRESHOLD = float(WORKER_ENV["JOBS_ALIVE_THRESHOLD"])
# A graceful stop: shutdown timeout + interrupt grace + the writing of outcomes, with room.
STOP_TIMEOUT = 30.0

# Weights of the workload's actions (an action enqueues one job, or a burst, a batch...).
MIX = {
    "plain": 30,
    "keyed": 25,
    "rated": 5,
    "unique": 8,
    "batch": 3,
    "cancel_running": 2,
    "cancel_waiting": 2,
    "timeout": 2,
    "snooze": 3,
    "hostile": 2,
    "fair": 6,
}
KEYS = {f"k{i}": 1 + i % 3 for i in range(6)}  # concurrency key -> limit (1-3)
ACCOUNTS = ("acct-a", "acct-b")  # rate keys
UNIQUE_SLOTS = 3
MUST_SUCCEED = {
    "plain",
    "keyed",
    "rated",
    "unique",
    "item",
    "callback",
    "tick",
    "snooze",
    "canary",
    "fair",
}

# The fair kind: tenants of the fair queue and their weights. "bulk" enqueues backlogs of
# hundreds, "vip" (three turns for bulk's one) bursts of tens, the light ones a few jobs at a
# time, some of them sent into each bulk backlog (FAIR_FOLLOW_UPS, within FAIR_FOLLOW_UP_DELAY
# seconds) so that every run has light jobs waiting beside a backlog.
FAIR_QUEUE = tasks.FAIR_QUEUE
TENANTS = {"bulk": 1.0, "vip": 3.0, "light-a": 1.0, "light-b": 2.0, "light-c": 0.5}
HEAVY_TENANTS = ("bulk", "vip")
LIGHT_TENANTS = tuple(t for t in TENANTS if t not in HEAVY_TENANTS)
# What successive fair actions enqueue, in turn.
FAIR_CYCLE = ("bulk", "light", "vip", "light", "light", "light")
BULK_SIZE, VIP_SIZE, LIGHT_SIZE = (150, 300), (20, 60), (1, 3)
FAIR_FOLLOW_UPS, FAIR_FOLLOW_UP_DELAY = (4, 8), (0.0, 0.8)
# Seconds after a fault during which it may still re-ready a claimed job at its group's tail
# (a new turn, at a time no record gives). A job claimed before a kill, a termination or a
# restart, then recovered or handed back, has the fault itself within its wait; but a killed
# supervisor's workers go on claiming until they notice it is gone (within a second), and
# hand back what they claimed but had not started as they stop. A fair job's wait that holds
# a fault or its reach, or the final stop, is left out of the share audit.
FAULT_REACH = {"kill_supervisor": 3.0}
OTHER_FAULTS_REACH = 0.5
# The settings module of the soak's run_jobs processes (written into its work directory): the
# test project's, with the fair queue in QUEUES and (but for --unfair) in fair_queues.
WORKER_SETTINGS = "jobs_soak_settings"


KIND_OF_PATH = {
    tasks.plain.module_path: "plain",
    tasks.keyed.module_path: "keyed",
    tasks.rated.module_path: "rated",
    tasks.unique.module_path: "unique",
    tasks.item.module_path: "item",
    tasks.batch_done.module_path: "callback",
    tasks.tick.module_path: "tick",
    tasks.snoozer.module_path: "snooze",
    tasks.canary.module_path: "canary",
    tasks.fair_work.module_path: "fair",
    tasks.fifo_work.module_path: "fair",
    tasks.cancellable.module_path: "cancel",
    tasks.overrun.module_path: "timeout",
    **{t.module_path: f"hostile:{name}" for name, t in tasks.HOSTILE.items()},
}


@dataclass
class Config:
    duration: float = 300.0
    processes: int = 2
    threads: int = 4
    seed: int = 0
    rate: float = 12.0  # workload actions per second
    fault_every: tuple[float, float] = (3.0, 8.0)
    drain_timeout: float = 180.0
    restart_db: bool = False
    # The fair kind's queue is fair (False: the share audit's twin, in FIFO order).
    fair: bool = True
    # Where run_jobs' logs and the jobs' records go.
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="jobs-soak-")))
    # DATABASE_URL for the run_jobs processes: the database the driver is connected to.
    database_url: str = ""


@dataclass
class Figure:
    name: str
    value: int
    bound: int
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.value <= self.bound


@dataclass
class Report:
    vendor: str
    config: dict[str, Any]
    figures: list[Figure]
    info: dict[str, Any]

    def over(self) -> list[Figure]:
        return [f for f in self.figures if not f.ok]

    def table(self) -> str:
        info = self.info
        lines = [
            f"soak on {self.vendor} ({info['server']}): {self.config['duration']:g}s of load, "
            f"{self.config['processes']} processes x {self.config['threads']} threads, "
            f"seed {self.config['seed']}, {info['elapsed']:.0f}s in all "
            f"(final drain {info['drain_seconds']:.1f}s)",
            "jobs: "
            + ", ".join(f"{k} {v}" for k, v in sorted(info["jobs_by_kind"].items()))
            + f"; {info['jobs_total']} in all, {info['body_starts']} body starts",
            "faults: " + ", ".join(f"{k} {v}" for k, v in sorted(info["faults"].items())),
        ]
        lines += [f"{k}: {info[k]}" for k in ("hostile_outcomes", "notes") if info.get(k)]
        if info.get("fair_shares"):
            fair = info["fair_shares"]
            lines.append(
                f"fair shares ({'fair queue' if fair['queue_is_fair'] else 'FIFO twin'}): "
                f"{fair['waits_audited']} waits audited, {fair['contested']} contested, "
                f"{fair['light_waits']} of light tenants, {fair['light_beside_backlogs']} of "
                "them beside a backlog longer than its share and the tolerance; left out "
                f"{fair['left_out_faults']} (a fault within) + {fair['left_out_unseen']} "
                f"(first start unseen); worst {fair['worst_excess']}"
            )
        if info.get("enqueue_errors"):
            errors = info["enqueue_errors"]
            lines.append(f"enqueue errors (the driver's): {len(errors)}, first: {errors[0]}")
        width = max(len(f.name) for f in self.figures)
        lines.append("")
        lines.append(f"{'figure':<{width}}  {'value':>6}  {'bound':>6}")
        for f in self.figures:
            mark = "ok" if f.ok else "OVER"
            detail = f"  {f.detail}" if f.detail and (not f.ok or f.value) else ""
            lines.append(f"{f.name:<{width}}  {f.value:>6}  {f.bound:>6}  {mark}{detail}")
        verdict = (
            "every figure within its bound"
            if not self.over()
            else f"{len(self.over())} figure(s) over their bound"
        )
        lines.append(verdict)
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "vendor": self.vendor,
            "config": self.config,
            "figures": [{**asdict(f), "ok": f.ok} for f in self.figures],
            "info": self.info,
            "ok": not self.over(),
        }


def progress(message: str) -> None:
    print(f"- {message}", file=sys.stderr, flush=True)


# --- the run -------------------------------------------------------------------------------


class Soak:
    def __init__(self, config: Config) -> None:
        self.config = config
        # One generator per thread, so that a seed replays the same actions and the same
        # order of fault kinds (not the same timing, nor the same victims' pids).
        self.rng = random.Random(config.seed)
        self.fault_rng = random.Random(config.seed + 1)
        self.vendor = connection.vendor
        self.server = "mariadb" if getattr(connection, "mysql_is_mariadb", False) else self.vendor
        self.audit_dir = config.work_dir / "records"
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.logs: list[RunJobs] = []
        self.supervisors: list[RunJobs] = []  # live ones we may kill or stop
        # Children of supervisors we killed, which stop by themselves: pid -> start time
        # (pids are reused, 32768 of them on this kind of machine).
        self.orphans: dict[int, int | None] = {}
        self.killed: dict[int, float] = {}  # pid -> time.time() just before its SIGKILL
        self.worker_kills = 0
        self.faults: list[dict[str, Any]] = []
        self.tracked: dict[int, str] = {}  # job id -> what the driver enqueued it as
        self.hostile: list[tuple[str, int, int]] = []  # (name, hostile job, canary job)
        self.cancels: dict[int, str] = {}  # job id -> what cancel() said
        self.enqueue_errors: list[str] = []
        self.unique_duplicates = 0
        self.protected: set[int] = set()  # the driver's own connection, never terminated
        self.stop_faults = threading.Event()
        self.fault_error: BaseException | None = None
        self.follow_ups: list[tuple[float, Any]] = []
        self.keyed_tasks = {key: tasks.keyed.using(concurrency_limit=n) for key, n in KEYS.items()}
        self.fair_enqueued: dict[int, float] = {}  # fair job id -> time.time() after its commit
        self.fair_actions = 0
        self.fair_tasks: dict[str, Any] = {}
        self.stop_began = math.inf  # time.time() when the workers were told to stop
        self.settings_dir = config.work_dir / "settings"
        self.settings_dir.mkdir(parents=True, exist_ok=True)
        (self.settings_dir / f"{WORKER_SETTINGS}.py").write_text(worker_settings(config.fair))
        self.drain_seconds = 0.0
        self.unstopped: list[int] = []  # processes still running STOP_TIMEOUT after SIGTERM
        self.unexpected_exits: list[str] = []  # supervisors that exited without our SIGKILL
        self.began = time.monotonic()

    # --- processes

    def start_run_jobs(self, *, recurring: bool = True) -> RunJobs:
        env = {
            **WORKER_ENV,
            tasks.AUDIT_DIR_ENV: str(self.audit_dir),
            "JOBS_RECURRING": json.dumps(RECURRING if recurring else {}),
            "DJANGO_SETTINGS_MODULE": WORKER_SETTINGS,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(self.settings_dir), os.environ.get("PYTHONPATH")) if p
            ),
        }
        proc = RunJobs(
            ["--processes", str(self.config.processes), "--threads", str(self.config.threads)],
            database_url=self.config.database_url,
            log_path=self.config.work_dir / f"run_jobs-{len(self.logs)}.log",
            extra_env=env,
        )
        proc.start()
        self.logs.append(proc)
        return proc

    def live_workers(self) -> list[int]:
        """Worker processes of our live supervisors, by their registry rows and /proc."""
        children = {
            pid
            for sup in self.supervisors
            if sup.proc.poll() is None
            for pid in descendant_pids(sup.pid)  # forks of its warm parent
        }
        pids = Process.objects.filter(kind=Process.Kind.WORKER).values_list("pid", flat=True)
        return sorted(set(pids) & children)

    def all_pids(self) -> set[int]:
        """Every process of ours still running: live supervisors and their trees (a
        supervisor that exited waited for its children first), and the children of the
        supervisors we killed, recognised by their start time."""
        pids = {pid for pid, began in self.orphans.items() if same_process(pid, began)}
        for sup in self.logs:
            if sup.proc is not None and sup.proc.poll() is None:
                pids.add(sup.pid)
                pids.update(sup.tree())
        return pids

    # --- faults

    def fault_kinds(self) -> list[str]:
        kinds = ["kill_worker", "kill_worker", "kill_supervisor"]
        if self.vendor in ("postgresql", "mysql"):
            kinds.append("terminate_connections")
            if self.config.restart_db:
                kinds.append("restart_db")
        return kinds

    def fault_loop(self) -> None:
        try:
            pending: list[str] = []
            low, high = self.config.fault_every
            while not self.stop_faults.wait(self.fault_rng.uniform(low, high)):
                if not pending:
                    pending = self.fault_kinds()
                    self.fault_rng.shuffle(pending)
                self.replace_exited_supervisors()
                kind = pending.pop()
                began = time.time()
                try:
                    detail = getattr(self, kind)()
                except DatabaseError as exc:  # the server may be restarting
                    detail = f"skipped: {type(exc).__name__}: {exc}".strip()[:200]
                    connection.close()
                self.faults.append(
                    {
                        "t": round(time.monotonic() - self.began, 2),
                        "kind": kind,
                        "detail": detail,
                        # Wall-clock times (the records'), for the share audit.
                        "began": began,
                        "ended": time.time(),
                    }
                )
                progress(f"fault at {self.faults[-1]['t']:.1f}s: {kind}: {detail}")
        except BaseException as exc:  # reported by the main thread
            self.fault_error = exc
        finally:
            connection.close()

    def replace_exited_supervisors(self, *, replace: bool = True) -> None:
        """A supervisor we did not kill has exited: say so, and start another."""
        for sup in list(self.supervisors):
            code = sup.proc.poll()
            if code is not None:
                self.unexpected_exits.append(f"supervisor pid {sup.pid} exited with {code}")
                self.supervisors.remove(sup)
                if replace:
                    self.supervisors.append(self.start_run_jobs())

    def kill_worker(self) -> str:
        workers = self.live_workers()
        if not workers:
            return "skipped: no live worker registered"
        pid = self.fault_rng.choice(workers)
        self.killed[pid] = time.time()
        os.kill(pid, signal.SIGKILL)
        self.worker_kills += 1
        return f"SIGKILL worker pid {pid}"

    def kill_supervisor(self) -> str:
        live = [sup for sup in self.supervisors if sup.proc.poll() is None]
        if not live:
            return "skipped: no live supervisor"
        sup = self.fault_rng.choice(live)
        children = sup.tree()
        self.killed[sup.pid] = time.time()
        sup.send(signal.SIGKILL)
        sup.proc.wait(10)
        self.supervisors.remove(sup)
        self.orphans.update({pid: process_start(pid) for pid in children})
        self.supervisors.append(self.start_run_jobs())
        return f"SIGKILL supervisor pid {sup.pid} ({len(children)} children left to stop)"

    def terminate_connections(self) -> str:
        protected = sorted(self.protected)
        with connection.cursor() as cursor:
            if self.vendor == "postgresql":
                cursor.execute(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND NOT (pid = ANY(%s))",
                    [protected],
                )
                ended = sum(1 for _, done in cursor.fetchall() if done)
            else:
                cursor.execute(
                    "SELECT ID FROM information_schema.PROCESSLIST "
                    "WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
                )
                ended = 0
                for (conn_id,) in cursor.fetchall():
                    if conn_id in self.protected:
                        continue
                    try:
                        cursor.execute(f"KILL CONNECTION {int(conn_id)}")
                        ended += 1
                    except DatabaseError:  # it ended meanwhile
                        pass
        return f"terminated {ended} connection(s)"

    def restart_db(self) -> str:
        connection.close()
        if self.vendor == "postgresql":
            cluster = sorted(os.listdir("/etc/postgresql"))[-1]
            subprocess.run(
                ["pg_ctlcluster", "--skip-systemctl-redirect", cluster, "main", "restart"],
                check=True,
                capture_output=True,
            )
        else:
            subprocess.run(
                ["mysqladmin", "-uroot", "-h127.0.0.1", "shutdown"], check=True, capture_output=True
            )
            # mysqladmin returns before the server has exited; started meanwhile,
            # start-stop-daemon --oknodo would find it running and start nothing.
            wait_until(
                lambda: (
                    subprocess.run(["pgrep", "-x", "mariadbd"], capture_output=True).returncode == 1
                ),
                60,
                interval=0.2,
                what="MariaDB to exit",
            )
            subprocess.run(
                [
                    "start-stop-daemon",
                    "--start",
                    "--oknodo",
                    "--background",
                    "--exec",
                    "/usr/sbin/mariadbd",
                ],
                check=True,
                capture_output=True,
            )
            wait_until(
                lambda: (
                    subprocess.run(
                        ["mysqladmin", "-uroot", "-h127.0.0.1", "ping"], capture_output=True
                    ).returncode
                    == 0
                ),
                60,
                interval=0.5,
                what="MariaDB to answer ping",
            )

        def answers() -> bool:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
                return True
            except DatabaseError:
                connection.close()
                return False

        wait_until(answers, 60, interval=0.5, what="the database to accept connections")
        return "server restarted"

    def protect_driver_connection(self) -> None:
        """Remember the driver's own connection, which no termination may hit: an
        enqueue whose commit is lost cannot tell whether its job exists."""
        if self.vendor not in ("postgresql", "mysql"):
            return
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_backend_pid()"
                if self.vendor == "postgresql"
                else "SELECT CONNECTION_ID()"
            )
            self.protected.add(int(cursor.fetchone()[0]))

    # --- the workload

    def track(self, result: Any, kind: str) -> int:
        job_id = int(result.id)
        self.tracked[job_id] = kind
        return job_id

    def later(self, delay: float, action: Any) -> None:
        self.follow_ups.append((time.monotonic() + delay, action))

    def run_follow_ups(self, everything: bool = False) -> None:
        now = time.monotonic()
        due = [f for f in self.follow_ups if everything or f[0] <= now]
        self.follow_ups = [f for f in self.follow_ups if f not in due]
        for _, action in sorted(due, key=lambda f: f[0]):
            action()

    def cancel(self, job_id: int) -> None:
        try:
            self.cancels[job_id] = django_jobs.cancel(job_id)
        except JobAlreadyFinished:
            self.cancels[job_id] = "already finished"

    def act(self, kind: str) -> None:
        rng = self.rng
        if kind == "plain":
            for _ in range(rng.randint(1, 3)):
                ms = rng.choice([0, 0, 5, 20, 50])
                self.track(tasks.plain.enqueue(ms, rng.random() < 0.1), "plain")
        elif kind == "keyed":
            key = rng.choice(sorted(KEYS))
            for _ in range(rng.randint(1, 4)):
                ms = rng.choice([5, 20, 50, 100, 150])
                result = self.keyed_tasks[key].enqueue(key, KEYS[key], ms, rng.random() < 0.1)
                self.track(result, "keyed")
        elif kind == "rated":
            account = rng.choice(ACCOUNTS)
            for _ in range(rng.randint(1, 6)):  # bursts over the limit: some must wait
                self.track(tasks.rated.enqueue(account, rng.choice([0, 10, 30])), "rated")
        elif kind == "unique":
            slot = rng.randrange(UNIQUE_SLOTS)
            result = tasks.unique.enqueue(slot, rng.choice([50, 150, 300]))
            if int(result.id) in self.tracked:
                self.unique_duplicates += 1
            self.track(result, "unique")
        elif kind == "batch":
            calls = [
                (tasks.item, [], {"ms": rng.choice([0, 10, 40]), "fail": rng.random() < 0.2})
                for _ in range(rng.randint(2, 8))
            ]
            batch = enqueue_batch(
                calls, on_finish=tasks.batch_done, concurrency_limit=rng.choice([None, 2])
            )
            for result in batch.results:
                self.track(result, "item")
        elif kind == "cancel_running":
            job_id = self.track(tasks.cancellable.enqueue(30), "cancel")
            self.later(rng.uniform(0.3, 2.0), lambda: self.cancel(job_id))
        elif kind == "cancel_waiting":
            waiting = tasks.cancellable.using(run_after=timezone.now() + timedelta(seconds=60))
            job_id = self.track(waiting.enqueue(30), "cancel")
            self.later(rng.uniform(0.0, 1.0), lambda: self.cancel(job_id))
        elif kind == "timeout":
            self.track(tasks.overrun.enqueue(), "timeout")
        elif kind == "snooze":
            self.track(tasks.snoozer.enqueue(rng.randint(1, 2)), "snooze")
        elif kind == "fair":
            what = FAIR_CYCLE[self.fair_actions % len(FAIR_CYCLE)]
            self.fair_actions += 1
            if what == "bulk":
                self.enqueue_fair("bulk", rng.randint(*BULK_SIZE), [5, 10, 20])
                # Light jobs sent into the backlog just made, while it lasts.
                for _ in range(rng.randint(*FAIR_FOLLOW_UPS)):
                    self.later(rng.uniform(*FAIR_FOLLOW_UP_DELAY), self.enqueue_light)
            elif what == "vip":
                self.enqueue_fair("vip", rng.randint(*VIP_SIZE), [5, 10, 20])
            else:
                self.enqueue_light()
        elif kind == "hostile":
            # Round-robin, so that a short run sees every kind.
            names = sorted(tasks.HOSTILE)
            name = names[len(self.hostile) % len(names)]
            hostile_id = self.track(tasks.HOSTILE[name].enqueue(), f"hostile:{name}")
            canary_id = self.track(tasks.canary.enqueue(hostile_id), "canary")
            self.hostile.append((name, hostile_id, canary_id))
        else:
            raise ValueError(kind)

    def fair_task(self, tenant: str) -> Any:
        """The fair kind's task for ``tenant``: in the fair queue with the tenant's weight,
        or (the twin) in the same queue, not fair then, without a key or weight."""
        if tenant not in self.fair_tasks:
            if self.config.fair:
                made = tasks.fair_work.using(queue_name=FAIR_QUEUE, fair_weight=TENANTS[tenant])
            else:
                made = tasks.fifo_work.using(queue_name=FAIR_QUEUE)
            self.fair_tasks[tenant] = made
        return self.fair_tasks[tenant]

    def enqueue_fair(self, tenant: str, count: int, ms: list[int]) -> None:
        """``count`` jobs of ``tenant``: one ``enqueue()``, or a ``bulk_enqueue()`` of them
        all (one transaction); the time after the commit is their wait's start."""
        task = self.fair_task(tenant)
        calls = [
            (task, [], {"tenant": tenant, "weight": TENANTS[tenant], "ms": self.rng.choice(ms)})
            for _ in range(count)
        ]
        results = [task.enqueue(**calls[0][2])] if count == 1 else bulk_enqueue(calls)
        committed = time.time()
        for result in results:
            self.fair_enqueued[self.track(result, "fair")] = committed

    def enqueue_light(self) -> None:
        tenant = self.rng.choice(LIGHT_TENANTS)
        self.enqueue_fair(tenant, self.rng.randint(*LIGHT_SIZE), [0, 5, 10])

    def load(self) -> None:
        kinds = sorted(MIX)
        weights = [MIX[k] for k in kinds]
        # Every kind once first, in a random order, and a hostile job of each hostile
        # task (one each, taken in turn): the audit expects every one of them, and a
        # short run's random picks could leave one out (seed 543978 did, at 45 s).
        first = list(kinds) + ["hostile"] * (len(tasks.HOSTILE) - 1)
        self.rng.shuffle(first)
        deadline = time.monotonic() + self.config.duration
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            if self.fault_error is not None:
                raise RuntimeError("the fault thread failed") from self.fault_error
            now = time.monotonic()
            if now < next_at:
                time.sleep(min(next_at - now, 0.05))
                self.outliving_restarts("follow-ups", self.run_follow_ups)
                continue
            # Poisson arrivals; a slow action delays the next ones rather than bunching them.
            next_at = max(next_at, now - 1.0) + self.rng.expovariate(self.config.rate)
            kind = first.pop() if first else self.rng.choices(kinds, weights)[0]
            self.outliving_restarts(kind, lambda kind=kind: (self.act(kind), self.run_follow_ups()))
        self.outliving_restarts("follow-ups", lambda: self.run_follow_ups(everything=True))

    def outliving_restarts(self, what: str, step: Any) -> None:
        """Run one step of the driver's; a server restart (the only fault that reaches the
        driver's own connection) costs that step, noted, and a fresh connection."""
        try:
            step()
        except DatabaseError as exc:
            self.enqueue_errors.append(f"{what}: {type(exc).__name__}: {exc}"[:200])
            connection.close()
            time.sleep(0.2)
            try:
                self.protect_driver_connection()
            except DatabaseError:
                connection.close()

    # --- stopping, draining

    def stop_all(self) -> None:
        """SIGTERM every live supervisor; wait for them and for the killed supervisors'
        children (which stop by themselves) to exit. What does not is killed, and said."""
        self.replace_exited_supervisors(replace=False)
        for sup in self.supervisors:
            if sup.proc.poll() is None:
                sup.send(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for sup in self.supervisors:
            try:
                sup.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.unstopped.append(sup.pid)
        self.supervisors = []
        try:
            wait_until(
                lambda: not self.all_pids(),
                max(1.0, deadline - time.monotonic()),
                interval=0.1,
                what="every run_jobs process to exit",
            )
        except AssertionError:
            for pid in self.all_pids():
                self.unstopped.append(pid)
                self.killed[pid] = time.time()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def drain(self) -> RunJobs:
        """A clean run_jobs (no recurring task, no faults) runs what is left until every
        job has ended and no process but its own is registered: the dead ones' claims
        settled by recovery (alive_threshold)."""
        final = self.start_run_jobs(recurring=False)
        began = time.monotonic()

        def settled() -> bool:
            if Job.objects.exclude(status__in=FINISHED_STATUSES).exists():
                return False
            if ClaimedExecution.objects.exists():
                return False
            ours = {final.pid, *final.tree()}
            return not Process.objects.exclude(pid__in=ours).exists()

        try:
            wait_until(
                settled, self.config.drain_timeout, interval=0.25, what="the final drain to settle"
            )
        except AssertionError:
            progress(f"the final drain did not settle within {self.config.drain_timeout:g}s")
        self.drain_seconds = time.monotonic() - began
        return final

    def run(self) -> Report:
        progress(f"soak on {self.vendor}: records and logs in {self.config.work_dir}")
        self.protect_driver_connection()
        fault_thread = threading.Thread(target=self.fault_loop, name="soak-faults", daemon=True)
        try:
            self.supervisors.append(self.start_run_jobs())
            wait_until(
                lambda: len(self.live_workers()) >= self.config.processes,
                60,
                interval=0.1,
                what="the first workers to register",
            )
            fault_thread.start()
            progress(f"load for {self.config.duration:g}s")
            self.load()
            self.stop_faults.set()
            fault_thread.join(120)
            if self.fault_error is not None:
                raise RuntimeError("the fault thread failed") from self.fault_error
            progress("stopping the workers")
            self.stop_began = time.time()
            self.stop_all()
            progress("final drain")
            final = self.drain()
            stranded = self.stranded()
            final.send(signal.SIGTERM)
            try:
                final.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.unstopped.append(final.pid)
            progress("audit")
            return self.audit(stranded)
        finally:
            self.stop_faults.set()
            if fault_thread.is_alive():  # a failed run: no fault may start processes after this
                fault_thread.join(60)
            for pid in self.all_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for sup in self.logs:
                if sup.proc is not None and sup.proc.poll() is None:
                    sup.proc.wait(10)
                if hasattr(sup, "log"):
                    sup.log.close()

    # --- the audit

    def share_audit(
        self, starts: dict[tuple[int, int], list[dict]], jobs: dict[int, dict], kind_of: dict
    ) -> dict[str, Any]:
        """The fair kind's share audit (``share_excesses``) over the waits the records show
        whole: from the commit of an enqueue the driver saw return to the job's first claim
        (its first attempt's start, as the claim recorded it), holding no fault, nor its
        reach, nor the final stop, any of which may have re-readied the job at its group's
        tail at a time no record gives.

        Tolerance: 2 x processes x threads claims. A claim takes at most ``threads`` jobs
        (no more than its process's idle threads, ``batch_size`` a cap above that), and a
        process makes one claim at a time. A claim's time is read before its statement runs,
        so one timed after the commit of the job's enqueue sees the job: none is out of turn
        at the wait's start. At its end, every other process's claim in flight beside the
        job's own may find the job's row locked and take later turns: (processes - 1) x
        threads. That much again for the workers of a killed supervisor, which go on claiming
        beside their replacements until they notice (their waits are mostly left out: the
        fault's reach), and for the order of a claim's jobs, which is not kept (they share
        its time): the job's own group's jobs in its claim count as ahead of it."""
        fair_rows = [row for pk, row in jobs.items() if kind_of[pk] == "fair"]
        group_of = {row["pk"]: row["kwargs"]["tenant"] for row in fair_rows}
        weights = {row["kwargs"]["tenant"]: float(row["kwargs"]["weight"]) for row in fair_rows}
        claims: list[tuple[float, int, str]] = []
        first: dict[int, float] = {}
        for (job_id, attempt), records in starts.items():
            if job_id in group_of:
                record = records[0]
                at = record["recorded"] if record.get("recorded") is not None else record["t"]
                claims.append((at, job_id, group_of[job_id]))
                if attempt == 1:
                    first[job_id] = at
        reaches = [
            (f["began"], f["ended"] + FAULT_REACH.get(f["kind"], OTHER_FAULTS_REACH))
            for f in self.faults
        ]
        reaches.append((self.stop_began, math.inf))
        waits: dict[int, tuple[str, float, float]] = {}
        unseen = faulted = 0
        for job_id, committed in self.fair_enqueued.items():
            if job_id not in first or job_id not in group_of:
                unseen += 1  # its first attempt's start unrecorded (killed before it)
                continue
            claimed = first[job_id]
            if any(began <= claimed and committed <= ended for began, ended in reaches):
                faulted += 1
                continue
            waits[job_id] = (group_of[job_id], committed, claimed)
        tolerance = 2 * self.config.processes * self.config.threads
        shares = share_excesses(waits, claims, weights)
        over = sorted(
            (job_id, waits[job_id][0], share.other, share.claims, round(share.bound, 1))
            for job_id, share in shares.items()
            if share.claims > share.bound + tolerance
        )
        contested = {job_id for job_id, share in shares.items() if share.contested}
        light = {job_id: wait for job_id, wait in waits.items() if wait[0] in LIGHT_TENANTS}
        enqueued = {
            job_id: (group_of[job_id], at)
            for job_id, at in self.fair_enqueued.items()
            if job_id in group_of
        }
        protected = beside_backlogs(light, enqueued, first, weights, tolerance)
        worst = max(shares.items(), key=lambda item: item[1].excess, default=None)
        return {
            "queue_is_fair": self.config.fair,
            "tolerance": tolerance,
            "waits_audited": len(waits),
            "contested": len(contested),
            "light_waits": len(light),
            "light_beside_backlogs": len(protected),
            "left_out_faults": faulted,
            "left_out_unseen": unseen,
            "worst_excess": (
                None
                if worst is None
                else {
                    "job": worst[0],
                    "tenant": waits[worst[0]][0],
                    "other": worst[1].other,
                    "claims": worst[1].claims,
                    "share": round(worst[1].bound, 2),
                    "excess": round(worst[1].excess, 2),
                }
            ),
            "over": over,
        }

    def stranded(self) -> list[int]:
        """Jobs waiting behind nothing at the end of the drain, its workers idle: ready,
        blocked while their key has a free slot, or scheduled and overdue."""
        free = {s.key for s in Semaphore.objects.all() if s.value > 0}  # a slot nobody holds
        overdue = timezone.now() - timedelta(seconds=5)
        ids = set(ReadyExecution.objects.values_list("job_id", flat=True))
        ids |= set(
            BlockedExecution.objects.filter(concurrency_key__in=free).values_list(
                "job_id", flat=True
            )
        )
        ids |= set(
            ScheduledExecution.objects.filter(scheduled_at__lt=overdue).values_list(
                "job_id", flat=True
            )
        )
        return sorted(ids)

    def read_records(self) -> tuple[dict[tuple[int, int], list[dict]], dict, int]:
        starts: dict[tuple[int, int], list[dict]] = defaultdict(list)
        ends: dict[tuple[int, int], list[dict]] = defaultdict(list)
        cut = 0
        for path in sorted(self.audit_dir.glob("audit-*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    cut += 1  # the last line of a process killed while writing it
                    continue
                target = starts if record["e"] == "start" else ends
                target[record["job"], record["attempt"]].append(record)
        return starts, ends, cut

    def audit(self, stranded: list[int]) -> Report:
        starts, ends, cut = self.read_records()
        jobs = {
            row["pk"]: row
            for row in Job.objects.values(
                "pk",
                "task_path",
                "status",
                "attempts",
                "kwargs",
                "args",
                "concurrency_key",
                "concurrency_limit",
                "batch_id",
                "return_value",
            )
        }
        failures: dict[int, list[tuple[int, str, str, float]]] = defaultdict(list)
        for job_id, attempt, path, message, at in FailedExecution.objects.order_by(
            "attempt", "pk"
        ).values_list("job_id", "attempt", "exception_class_path", "message", "failed_at"):
            failures[job_id].append((attempt, path, message, at.timestamp()))
        finished_at = dict(
            Job.objects.filter(finished_at__isnull=False).values_list("pk", "finished_at")
        )
        audit_time = time.time()
        kind_of = {
            pk: KIND_OF_PATH.get(row["task_path"], row["task_path"]) for pk, row in jobs.items()
        }
        unfinished = {pk for pk, row in jobs.items() if row["status"] not in FINISHED_STATUSES}
        waiting = (
            set(ReadyExecution.objects.values_list("job_id", flat=True))
            | set(ScheduledExecution.objects.values_list("job_id", flat=True))
            | set(BlockedExecution.objects.values_list("job_id", flat=True))
            | set(ClaimedExecution.objects.values_list("job_id", flat=True))
        )

        def interval(key: tuple[int, int]) -> tuple[float, float]:
            """The body's run: its own start and end; without an end (killed, or
            interrupted in the middle of writing it), the kill's time, else the time
            the attempt's outcome was recorded, which is after the body ended."""
            start = starts[key][0]
            if ends.get(key):
                return start["t"], ends[key][0]["t"]
            killed_at = self.killed.get(start["pid"])
            # Read just before the SIGKILL, which lands a moment later: a body that started
            # in between is the victim's (ended at its start); much later, a reused pid.
            if killed_at is not None and start["t"] <= killed_at + KILL_LANDS_WITHIN:
                return start["t"], max(killed_at, start["t"])
            job_id, attempt = key
            for failed_attempt, _, _, at in failures.get(job_id, []):
                if failed_attempt == attempt:
                    return start["t"], at
            if job_id in finished_at:
                return start["t"], finished_at[job_id].timestamp()
            return start["t"], audit_time

        figures: list[Figure] = []

        # Lost: enqueued, yet neither ended nor visibly waiting.
        missing = sorted(set(self.tracked) - set(jobs))
        hidden = sorted(unfinished - waiting)
        figures.append(
            Figure(
                "lost jobs",
                len(missing) + len(hidden),
                0,
                f"missing rows {missing[:10]}, unfinished with no execution row {hidden[:10]}",
            )
        )
        figures.append(
            Figure(
                "unfinished after the drain",
                len(unfinished),
                0,
                f"{sorted(unfinished)[:10]}",
            )
        )
        figures.append(Figure("stranded behind a free slot", len(stranded), 0, f"{stranded[:10]}"))

        # Over-admitted: most bodies of a key running at once, from their own records.
        by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
        limit_of: dict[str, int] = {}
        for key in starts:
            row = jobs.get(key[0])
            if row is not None and row["concurrency_key"]:
                by_key[row["concurrency_key"]].append(interval(key))
                limit_of[row["concurrency_key"]] = row["concurrency_limit"]
        over_keys = {
            k: (max_overlap(v), limit_of[k])
            for k, v in by_key.items()
            if max_overlap(v) > limit_of[k]
        }
        figures.append(
            Figure(
                "keys over their concurrency limit",
                len(over_keys),
                0,
                f"(most at once, limit): {dict(sorted(over_keys.items())[:10])}; "
                f"{len(by_key)} keys audited",
            )
        )

        # Rate limits: recorded starts (checked under the key's lock) in any period.
        rated: dict[str, list[float]] = defaultdict(list)
        for (job_id, _), records in starts.items():
            if kind_of.get(job_id) == "rated" and records[0].get("recorded") is not None:
                rated[records[0]["key"]].append(records[0]["recorded"])
        windows_over = {
            key: windows_over_limit(times, tasks.RATE_LIMIT, tasks.RATE_PERIOD)
            for key, times in rated.items()
        }
        figures.append(
            Figure(
                "rate windows over their limit",
                sum(windows_over.values()),
                0,
                f"per key {windows_over}, most starts in one {tasks.RATE_PERIOD:g}s: "
                f"{ {k: most_in_any_period(v, tasks.RATE_PERIOD) for k, v in rated.items()} }",
            )
        )

        # Unique: two jobs of one unique key never run at once (unique_until="finish").
        unique_runs: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
        for key, records in starts.items():
            if kind_of.get(key[0]) == "unique":
                unique_runs[records[0]["key"]].append((*interval(key), key[0]))
        unique_overlaps = sum(overlapping_pairs(runs) for runs in unique_runs.values())
        figures.append(Figure("unique jobs run at once", unique_overlaps, 0))

        # A job's attempts: each started once, never two bodies of one job at once.
        twice = [key for key, records in starts.items() if len(records) > 1]
        per_job: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
        for key in starts:
            per_job[key[0]].append((*interval(key), key[1]))
        self_overlap = [j for j, runs in per_job.items() if overlapping_pairs(runs, same=True)]
        figures.append(
            Figure(
                "attempts run twice (or a job twice at once)",
                len(twice) + len(self_overlap),
                0,
                f"{twice[:5]} {self_overlap[:5]}",
            )
        )

        # Fair shares: over each fair job's wait, no other tenant claimed beyond its share.
        shares = self.share_audit(starts, jobs, kind_of)
        figures.append(
            Figure(
                "fair waits over their share",
                len(shares["over"]),
                0,
                f"tolerance {shares['tolerance']} claims; (job, its tenant, other tenant, "
                f"other's claims during the wait, its share): {shares['over'][:5]}",
            )
        )

        # Recurring: one job per tick, from the ticks' own records.
        tick_jobs = {key[0] for key in starts if kind_of.get(key[0]) == "tick"}
        tick_jobs |= {pk for pk, kind in kind_of.items() if kind == "tick"}
        executions = list(
            RecurringExecution.objects.filter(task_key=RECURRING_KEY).values_list(
                "run_at", "job_id"
            )
        )
        jobs_of_tick: dict[Any, set[int]] = defaultdict(set)
        for run_at, job_id in executions:
            jobs_of_tick[run_at].add(job_id)
        ticked = {job_id for _, job_id in executions}
        duplicated = sum(len(ids) - 1 for ids in jobs_of_tick.values() if len(ids) > 1)
        orphan_ticks = sorted(tick_jobs - ticked)
        figures.append(
            Figure(
                "recurring ticks duplicated",
                duplicated + len(orphan_ticks),
                0,
                f"tick jobs without their tick row: {orphan_ticks[:10]}",
            )
        )
        tick_times = sorted(jobs_of_tick)
        missed = (
            int((tick_times[-1] - tick_times[0]).total_seconds()) + 1 - len(tick_times)
            if tick_times
            else 0
        )

        # Batches: one on_finish callback each, run, told the items' real outcomes.
        callback_records: dict[int, set[int]] = defaultdict(set)
        told: dict[int, tuple[int, int]] = {}
        for (job_id, _), records in starts.items():
            if kind_of.get(job_id) == "callback":
                callback_records[records[0]["batch"]].add(job_id)
                told[job_id] = (records[0]["succeeded"], records[0]["failed"])
        callback_jobs: dict[int, list[int]] = defaultdict(list)
        for pk, row in jobs.items():
            if kind_of[pk] == "callback":
                callback_jobs[row["kwargs"].get("batch_id")].append(pk)
        outcomes: dict[int, Counter] = defaultdict(Counter)
        for row in jobs.values():
            if row["batch_id"] is not None:
                outcomes[row["batch_id"]][row["status"]] += 1
        bad_batches = []
        for batch in Batch.objects.values("pk", "total", "finished_at", "callback_jobs"):
            pk = batch["pk"]
            mine = callback_jobs.get(pk, [])
            real = (outcomes[pk][JobStatus.SUCCEEDED], outcomes[pk][JobStatus.FAILED])
            if (
                batch["finished_at"] is None
                or len(mine) != 1
                or batch["callback_jobs"].get("on_finish") != mine[0]
                or jobs[mine[0]]["status"] != JobStatus.SUCCEEDED
                or callback_records.get(pk) != {mine[0]}
                or told.get(mine[0]) != real
                or sum(real) != batch["total"]
            ):
                bad_batches.append(pk)
        n_batches = Batch.objects.count()
        figures.append(
            Figure(
                "batch callbacks not exactly once",
                len(bad_batches),
                0,
                f"batches {bad_batches[:10]} of {n_batches}",
            )
        )

        # Hostile jobs: a defined end (failed with a clear error, or the value stored as
        # returned), and the job enqueued right after each succeeded.
        hostile_outcomes: dict[str, Counter] = defaultdict(Counter)
        undefined, sick_canaries = [], []
        for name, hostile_id, canary_id in self.hostile:
            row = jobs.get(hostile_id)
            verdict = hostile_verdict(name, row, failures.get(hostile_id, []))
            last = failures.get(hostile_id, [(0, "", "", 0)])[-1][1].rsplit(".", 1)[-1]
            status = row["status"] if row else "missing"
            hostile_outcomes[name][f"{status} {last}".strip()] += 1
            if not verdict:
                undefined.append(hostile_id)
            if jobs.get(canary_id, {}).get("status") != JobStatus.SUCCEEDED:
                sick_canaries.append(canary_id)
        figures.append(
            Figure(
                "hostile jobs not in a defined end state", len(undefined), 0, f"{undefined[:10]}"
            )
        )
        figures.append(
            Figure(
                "jobs after a hostile one not succeeded",
                len(sick_canaries),
                0,
                f"{sick_canaries[:10]}",
            )
        )

        # Cancelled, timed out, snoozed: each ends as documented.
        not_cancelled = [
            pk
            for pk, said in self.cancels.items()
            if said in ("cancelled", "requested")
            and not (
                jobs.get(pk, {}).get("status") == JobStatus.FAILED
                and failures[pk]
                and failures[pk][-1][1] == JOB_CANCELLED
            )
        ]
        figures.append(
            Figure(
                "cancelled jobs not ended cancelled",
                len(not_cancelled),
                0,
                f"{not_cancelled[:10]}; cancel() said {dict(Counter(self.cancels.values()))}",
            )
        )
        timeouts = [pk for pk, kind in kind_of.items() if kind == "timeout"]
        bad_timeouts = [
            pk
            for pk in timeouts
            if jobs[pk]["status"] != JobStatus.FAILED
            or not failures[pk]
            or any(f[1] not in (JOB_TIMEOUT, PROCESS_DIED, WORKER_SHUTDOWN) for f in failures[pk])
            or any(
                e["ok"] for a in range(1, jobs[pk]["attempts"] + 1) for e in ends.get((pk, a), [])
            )
        ]
        figures.append(
            Figure(
                "timed-out jobs not ended timed out",
                len(bad_timeouts),
                0,
                f"{bad_timeouts[:10]} of {len(timeouts)}",
            )
        )
        snoozed = [pk for pk, kind in kind_of.items() if kind == "snooze"]
        bad_snoozes = [pk for pk in snoozed if jobs[pk]["status"] != JobStatus.SUCCEEDED]
        figures.append(
            Figure(
                "snoozed jobs not succeeded",
                len(bad_snoozes),
                0,
                f"{bad_snoozes[:10]} of {len(snoozed)}",
            )
        )

        # Everything else must succeed (retries absorb planned failures and kills); batch
        # items planned to fail must fail.
        wrong = []
        for pk, row in jobs.items():
            kind = kind_of[pk]
            if kind == "item" and row["kwargs"].get("fail"):
                expected = JobStatus.FAILED
            elif kind in MUST_SUCCEED:
                expected = JobStatus.SUCCEEDED
            else:
                continue
            if row["status"] in FINISHED_STATUSES and row["status"] != expected:
                wrong.append(pk)
        examples = {pk: [f[1].rsplit(".", 1)[-1] for f in failures[pk]] for pk in wrong[:5]}
        figures.append(Figure("jobs ended otherwise than planned", len(wrong), 0, f"{examples}"))

        leaked = [(s.key, s.value, s.limit) for s in Semaphore.objects.all() if s.value != s.limit]
        figures.append(Figure("concurrency slots not returned", len(leaked), 0, f"{leaked[:10]}"))

        # The crash window: bodies that returned, whose attempt recovery then failed.
        returned = {key for key, records in ends.items() if any(r["ok"] for r in records)}
        died = {
            (job_id, f[0])
            for job_id, rows in failures.items()
            for f in rows
            if f[1] == PROCESS_DIED
        }
        completed_but_failed = sorted(returned & died)
        bound = unrecorded_bound(self.config.threads) * self.worker_kills
        figures.append(
            Figure(
                "completed-but-failed (ProcessDied)",
                len(completed_but_failed),
                bound,
                f"bound 2 x {self.config.threads} threads x {self.worker_kills} worker kills; "
                f"{completed_but_failed[:10]}",
            )
        )

        figures.append(
            Figure(
                "processes not stopped by SIGTERM",
                len(set(self.unstopped)),
                0,
                f"pids {sorted(set(self.unstopped))} still ran {STOP_TIMEOUT:g}s after it",
            )
        )

        figures.append(
            Figure(
                "supervisors exited without our SIGKILL",
                len(self.unexpected_exits),
                0,
                "; ".join(self.unexpected_exits[:5]),
            )
        )

        notes = log_notes(self.logs)
        faults = Counter(f["kind"] for f in self.faults if not f["detail"].startswith("skipped"))
        faults["skipped"] = sum(1 for f in self.faults if f["detail"].startswith("skipped"))
        terminated = sum(
            int(f["detail"].split()[1])
            for f in self.faults
            if f["kind"] == "terminate_connections" and f["detail"].startswith("terminated")
        )
        info = {
            "server": server_version(),
            "elapsed": time.monotonic() - self.began,
            "drain_seconds": self.drain_seconds,
            "jobs_total": len(jobs),
            "jobs_by_kind": dict(Counter(k.split(":")[0] for k in kind_of.values())),
            "statuses": dict(Counter(row["status"] for row in jobs.values())),
            "body_starts": sum(len(r) for r in starts.values()),
            "faults": {**faults, "connections terminated": terminated},
            "fault_log": self.faults,
            "batches": n_batches,
            "ticks": len(tick_times),
            "ticks_missed": missed,
            "unique_enqueues_deduplicated": self.unique_duplicates,
            "enqueue_errors": self.enqueue_errors,
            "cut_record_lines": cut,
            "hostile_outcomes": {k: dict(v) for k, v in sorted(hostile_outcomes.items())},
            "fair_shares": {k: v for k, v in shares.items() if k != "over"},
            "process_died_attempts": len(died),
            "notes": notes,
            "work_dir": str(self.config.work_dir),
        }
        config = {k: v for k, v in asdict(self.config).items() if k != "database_url"}
        config["work_dir"] = str(config["work_dir"])
        return Report(self.server, config, figures, info)


# --- arithmetic of the audit -----------------------------------------------------------------


@dataclass
class Share:
    """The other group that most exceeded its share over one job's wait."""

    other: str  # that group
    claims: int  # its claims during the wait
    bound: float  # its share: the most the rule lets it have, without tolerance
    contested: bool  # another group was claimed at all during the wait

    @property
    def excess(self) -> float:
        return self.claims - self.bound


def share_excesses(
    waits: dict[int, tuple[str, float, float]],
    claims: list[tuple[float, int, str]],
    weights: dict[str, float],
) -> dict[int, Share]:
    """For each job of ``waits`` (job id -> its group, the start of its wait, its first
    claim), given every claim of every group (time, job id, group: each attempt's), the
    other group that most exceeded its share over the wait.

    The rule (start-time fair queuing, docs/fairness.md): for two groups that both have jobs
    ready throughout a run of consecutive claims, ``|S_i/w_i - S_j/w_j| <= 1/w_i + 1/w_j``.
    Over a job's wait its own group ``g`` has it ready throughout, and a group ``i`` that
    had nothing ready for a while only starts at the head: so ``i``'s claims strictly within
    the wait are at most ``w_i * (S_g + 1) / w_g + 1``, ``S_g`` the claims of ``g``'s older
    jobs (ahead of it) within the wait, its own claim's included. In FIFO order a job
    enqueued behind another group's backlog waits for all of it.
    """
    times: dict[str, list[float]] = defaultdict(list)
    own: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for at, job_id, group in sorted(claims):
        times[group].append(at)
        own[group].append((at, job_id))
    found: dict[int, Share] = {}
    for job_id, (group, began, claimed) in waits.items():
        mine = own[group]
        low = bisect.bisect_right(mine, (began, math.inf))
        high = bisect.bisect_right(mine, (claimed, math.inf))
        ahead = sum(1 for _, other in mine[low:high] if other < job_id)
        worst: Share | None = None
        contested = False
        for other, at in times.items():
            if other == group:
                continue
            count = bisect.bisect_left(at, claimed) - bisect.bisect_right(at, began)
            contested |= count > 0
            bound = weights[other] * (ahead + 1) / weights[group] + 1
            if worst is None or count - bound > worst.excess:
                worst = Share(other, max(count, 0), bound, False)
        if worst is not None:
            worst.contested = contested
            found[job_id] = worst
    return found


def beside_backlogs(
    waits: dict[int, tuple[str, float, float]],
    enqueued: dict[int, tuple[str, float]],
    first: dict[int, float],
    weights: dict[str, float],
    tolerance: int,
) -> set[int]:
    """The jobs of ``waits`` whose wait began beside another group's backlog, longer than
    that group's share over the wait plus ``tolerance``: each would be over its share in
    FIFO order, which runs that whole backlog first. The material of the share audit:
    ``enqueued`` gives every job's group and the start of its wait, ``first`` its first
    claim. Its own group's jobs ahead of it count as in ``share_excesses`` (all claimed
    before it in either order)."""
    committed: dict[str, list[float]] = defaultdict(list)
    claimed: dict[str, list[float]] = defaultdict(list)
    members: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for job_id, (group, at) in enqueued.items():
        committed[group].append(at)
        claimed[group].append(first.get(job_id, math.inf))
        members[group].append((job_id, at, first.get(job_id, math.inf)))
    for times in (*committed.values(), *claimed.values()):
        times.sort()
    found = set()
    for job_id, (group, began, _) in waits.items():
        # Its place among its group's jobs waiting as its wait began: itself and those ahead.
        place = sum(
            1 for other, at, claim in members[group] if other <= job_id and at <= began < claim
        )
        for other in committed:
            if other == group:
                continue
            waiting = bisect.bisect_left(committed[other], began) - bisect.bisect_right(
                claimed[other], began
            )
            share = weights[other] * max(place, 1) / weights[group] + 1
            if waiting > share + tolerance:
                found.add(job_id)
    return found


WORKER_SETTINGS_TEXT = """\
\"\"\"Written by bench/soak.py for its run_jobs: the test project's, its fair queue added.\"\"\"

from testproject.settings import *  # noqa: F403
from testproject.settings import DJANGO_JOBS, TASKS

_queues = TASKS["default"].get("QUEUES", ["default"])  # [] takes every queue: left so
DJANGO_JOBS = {{**DJANGO_JOBS, "fair_queues": {fair_queues!r}}}
TASKS = {{
    **TASKS,
    "default": {{**TASKS["default"], "QUEUES": [*_queues, {queue!r}] if _queues else []}},
}}
"""


def worker_settings(fair: bool) -> str:
    """The settings module of the soak's run_jobs processes: the test project's, with the
    fair queue declared, and fair unless ``fair`` is False (the twin)."""
    return WORKER_SETTINGS_TEXT.format(fair_queues=[FAIR_QUEUE] if fair else [], queue=FAIR_QUEUE)


def soak_settings(fair: bool) -> dict[str, Any]:
    """The driver's own: its settings with the fair queue declared (and fair unless
    ``fair`` is False), as ``worker_settings`` gives the workers."""
    default = settings.TASKS["default"]
    queues = [q for q in default.get("QUEUES", ["default"]) if q != FAIR_QUEUE]
    return {
        "TASKS": {
            **settings.TASKS,
            "default": {**default, "QUEUES": [*queues, FAIR_QUEUE] if queues else []},
        },
        "DJANGO_JOBS": {**settings.DJANGO_JOBS, "fair_queues": [FAIR_QUEUE] if fair else []},
    }


def process_start(pid: int) -> int | None:
    """The start time of a process (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def same_process(pid: int, began: int | None) -> bool:
    """``pid`` is still the process that started at ``began``, and not a zombie."""
    return began is not None and process_start(pid) == began and pid_alive(pid)


def overlapping_pairs(runs: list[tuple[float, float, int]], same: bool = False) -> int:
    """Pairs of runs that overlap in time: of different jobs, or (``same``) of the
    same job (whose third field is then the attempt)."""
    runs = sorted(runs)
    pairs = 0
    for i, (_, end, who) in enumerate(runs):
        for other_start, _, other in runs[i + 1 :]:
            if other_start >= end:
                break
            if same or other != who:
                pairs += 1
    return pairs


def windows_over_limit(times: list[float], limit: int, period: float) -> int:
    """How many starts close a period holding more than ``limit`` starts."""
    times = sorted(times)
    over, first = 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - period:
            first += 1
        over += last - first + 1 > limit
    return over


def hostile_verdict(name: str, row: dict | None, failures: list[tuple]) -> bool:
    """A hostile job's end is defined when it failed with a clear error (its class and a
    message, the one its body raised, or ResultNotStored for a value the database
    cannot take; ProcessDied where a kill landed), or succeeded with the value stored
    exactly as returned (a NUL outside PostgreSQL, 40 levels outside MariaDB)."""
    if row is None or row["status"] not in FINISHED_STATUSES:
        return False
    if row["status"] == JobStatus.SUCCEEDED:
        return name.endswith("_return") and row["return_value"] == tasks.hostile_value(name)
    if not failures:
        return False
    _, path, message, _ = failures[-1]
    expected = {
        "nul_error": "builtins.ValueError",
        "str_raises": "bench.soak_tasks.StrRaises",
    }.get(name, RESULT_NOT_STORED)
    return bool(message) and path in (expected, PROCESS_DIED)


def log_notes(logs: list[RunJobs]) -> dict[str, Any]:
    """What the workers' logs say went wrong beyond the jobs' own failures."""
    counts: Counter = Counter()
    samples: dict[str, str] = {}
    for proc in logs:
        try:
            text = proc.output()
        except OSError:
            continue
        for line in text.splitlines():
            for label, needle in (
                ("tracebacks", "Traceback (most recent call last)"),
                ("thread crashes", "Exception in thread"),
                ("processes pruned as dead while alive", "was pruned; stopping"),
                ("deadlocks", "eadlock"),
                ("errors besides job failures and our kills", " ERROR "),
                ("critical", " CRITICAL "),
            ):
                if needle in line and not (
                    needle == " ERROR " and ("job failed" in line or "(code -9)" in line)
                ):
                    counts[label] += 1
                    samples.setdefault(label, line[-300:])
    return {"counts": dict(counts), "first": samples} if counts else {}


def server_version() -> str:
    query = "SELECT sqlite_version()" if connection.vendor == "sqlite" else "SELECT version()"
    with connection.cursor() as cursor:
        cursor.execute(query)
        return str(cursor.fetchone()[0]).split(" on ")[0].split(",")[0]


def run_soak(config: Config) -> Report:
    """Run the soak against the database Django is connected to (``config.database_url``
    names the same database for the run_jobs processes) and return its report. The fair
    queue is declared in the settings for the run (``soak_settings``)."""
    with override_settings(**soak_settings(config.fair)):
        return Soak(config).run()


# --- the command ----------------------------------------------------------------------------


def main(options: argparse.Namespace) -> int:
    prepare_soak_database(SAFE_NAME_PART)
    seed = options.seed if options.seed is not None else time.time_ns() % 1_000_000
    config = Config(
        duration=options.duration,
        processes=options.processes,
        threads=options.threads,
        seed=seed,
        rate=options.rate,
        fault_every=tuple(options.fault_every),
        drain_timeout=options.drain_timeout,
        restart_db=options.restart_db,
        fair=not options.unfair,
        database_url=os.environ["DATABASE_URL"],
    )
    try:
        report = run_soak(config)
    except Exception:
        progress(f"the soak failed; logs kept in {config.work_dir}")
        raise
    print(report.table())
    if options.json:
        options.json.write_text(json.dumps(report.as_json(), indent=2, default=str))
    if options.keep_logs or report.over():
        progress(f"logs and records kept in {config.work_dir}")
    else:
        shutil.rmtree(config.work_dir, ignore_errors=True)
    return 1 if report.over() else 0


if __name__ == "__main__":
    try:
        sys.exit(main(OPTIONS))
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(2)
