"""Helpers for tests that run real worker processes.

``wait_until`` polls a condition with a deadline and fails loudly with what it
last saw: the condition is what the test asserts, never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.db import connections

REPO_ROOT = Path(__file__).resolve().parent.parent
MANAGE = REPO_ROOT / "testproject" / "manage.py"

# Fast clocks for tests: heartbeats and pruning in seconds, not minutes.
FAST_ENV = {
    "JOBS_POLLING_INTERVAL": "0.05",
    "JOBS_DISPATCHER_INTERVAL": "0.1",
    "JOBS_HEARTBEAT_INTERVAL": "0.5",
    "JOBS_ALIVE_THRESHOLD": "3",
    "JOBS_SHUTDOWN_TIMEOUT": "5",
    "JOBS_LOG_LEVEL": "INFO",
}


def database_url(alias: str = "default", port: int | None = None) -> str:
    """A DATABASE_URL naming the *test* database, for subprocesses (via ``port`` if given)."""
    s = connections[alias].settings_dict
    engine = s["ENGINE"]
    if engine.endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    scheme = "postgres" if "postgresql" in engine else "mysql"
    user = quote(s.get("USER") or "")
    password = f":{quote(s['PASSWORD'])}" if s.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    host = "127.0.0.1" if port else s.get("HOST") or "127.0.0.1"
    port = port or s.get("PORT")
    return f"{scheme}://{auth}{host}{f':{port}' if port else ''}/{s['NAME']}"


def app_permissions() -> None:
    """Every installed app's content types and permissions, as ``migrate`` leaves them.

    The suite's flushes skip the ``post_migrate`` signal that would make them again after
    every ``transactional_db`` test (tests/conftest.py), so a test that reads a permission
    makes them first (cheap when they exist: one read per app)."""
    from django.apps import apps
    from django.contrib.auth.management import create_permissions

    for config in apps.get_app_configs():
        create_permissions(config, verbosity=0)


def wait_until(
    predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what or predicate}; last={last!r}"
    )


class RunJobs:
    """One ``manage.py run_jobs`` subprocess with its output in a log file."""

    def __init__(
        self, args: list[str], *, database_url: str, log_path: Path, extra_env: dict[str, str]
    ) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {
            **os.environ,
            **FAST_ENV,
            "DATABASE_URL": database_url,
            "PYTHONUNBUFFERED": "1",
            **extra_env,
        }
        self.env.pop("TEST_DATABASE_NAME", None)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log = open(self.log_path, "wb")  # closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, str(MANAGE), "run_jobs", *self.args],
            cwd=REPO_ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"run_jobs did not exit within {timeout}s; output:\n{self.output()}"
            ) from None

    def wait_for_output(self, text: str, timeout: float = 20.0) -> None:
        wait_until(lambda: text in self.output(), timeout, what=f"{text!r} in run_jobs output")

    def count(self, text: str) -> int:
        """How many times ``text`` appears in the output so far."""
        return self.output().count(text)

    def tree(self) -> list[int]:
        """The pids of every live descendant (worker and dispatcher children, ...)."""
        return descendant_pids(self.pid) if self.proc is not None else []

    def kill(self) -> None:
        """SIGKILL the whole tree at once: no process of it gets to clean anything up.

        The parent is frozen first (SIGSTOP) so it can neither start a new child
        nor see one die, then every descendant and the parent are killed.
        Children must be found while the parent lives: once it is gone they are
        reparented and no longer recognisable by their parent pid.
        """
        if self.proc is None:
            return
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGSTOP)
        for pid in [*self.tree(), self.pid] if alive else self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if alive:
            self.proc.wait(10)

    def close(self) -> None:
        """Teardown: kill whatever is left of the tree, close the log."""
        self.kill()
        if hasattr(self, "log"):
            self.log.close()


def descendant_pids(root: int) -> list[int]:
    """Every live process below ``root`` (children first, then theirs)."""
    found: list[int] = []
    frontier = [root]
    while frontier:
        children = [pid for parent in frontier for pid in child_pids(parent)]
        found += children
        frontier = children
    return found


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent:
            pids.append(int(entry.name))
    return pids


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- Reading jobs back (models imported late: this module loads before Django is set up).


def job_row(result_or_id: Any):
    """The ``Job`` row of a ``TaskResult`` (or of a job id), fresh from the database."""
    from django_jobs.models import Job

    job_id = getattr(result_or_id, "id", result_or_id)
    return Job.objects.get(pk=int(job_id))


def error_paths(result_or_id: Any) -> list[str]:
    """Exception class paths of a job's failed attempts, in attempt order."""
    from django_jobs.models import FailedExecution

    job_id = getattr(result_or_id, "id", result_or_id)
    return list(
        FailedExecution.objects.filter(job_id=int(job_id))
        .order_by("attempt", "pk")
        .values_list("exception_class_path", flat=True)
    )


def runs_of(log: Path) -> list[str]:
    """Labels a ``tests.tasks.record_run`` job appended to ``log``, one per run."""
    return log.read_text().split() if log.exists() else []


# --- audits from the jobs' own records (tests, and bench/soak.py) ---------------------------


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an end at t comes before a start at t)."""
    points = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, delta in points:
        running += delta
        peak = max(peak, running)
    return peak


def most_in_any_period(times: list[float], period: float) -> int:
    """The largest number of ``times`` inside one half-open interval of ``period``."""
    times = sorted(times)
    best, first = 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - period:
            first += 1
        best = max(best, last - first + 1)
    return best


def create_server_database(name: str) -> None:
    """Create database ``name`` on the server ``connection`` talks to, if it is missing
    (SQLite creates its file itself): bench/throughput.py's and bench/soak.py's own."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection._nodb_cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            if cursor.fetchone() is None:
                cursor.execute(f"CREATE DATABASE {connection.ops.quote_name(name)}")
    elif connection.vendor == "mysql":
        with connection._nodb_cursor() as cursor:
            quoted = connection.ops.quote_name(name)
            cursor.execute(f"CREATE DATABASE IF NOT EXISTS {quoted} CHARACTER SET utf8mb4")


def prepare_soak_database(safe_part: str) -> None:
    """Create the run's database if missing, migrate it, and empty django_jobs' tables:
    bench/soak.py's and bench/workflow_soak.py's. Refuses a database whose name lacks
    ``safe_part``, so a mistyped URL never empties someone's real tables."""
    from django.apps import apps
    from django.conf import settings
    from django.core.management import call_command
    from django.core.management.color import no_style
    from django.db import connection

    name = str(settings.DATABASES["default"]["NAME"])
    if safe_part not in Path(name).name:
        raise SystemExit(
            f"refusing to empty database {name!r}: its name must contain {safe_part!r}"
        )
    create_server_database(name)
    call_command("migrate", verbosity=0)
    tables = [m._meta.db_table for m in apps.get_app_config("django_jobs").get_models()]
    statements = connection.ops.sql_flush(no_style(), tables, allow_cascade=True)
    connection.ops.execute_sql_flush(statements)
