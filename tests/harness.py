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

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        # Children live in their own process groups: make sure none outlives the test.
        for pid in child_pids(self.pid) if self.proc else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if hasattr(self, "log"):
            self.log.close()


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` (or were, before it died: by command line)."""
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
