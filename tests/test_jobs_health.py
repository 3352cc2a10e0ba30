"""``manage.py jobs_health``: the liveness check, on process rows and on real ``run_jobs``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from django_jobs.models import Process
from tests.factories import ProcessFactory
from tests.harness import FAST_ENV, MANAGE, REPO_ROOT, database_url, wait_until

HOST = socket.gethostname()


def health(*args: str) -> tuple[int, str]:
    """(exit code, output) of the command run in this process."""
    out, err = StringIO(), StringIO()
    try:
        call_command("jobs_health", *args, stdout=out, stderr=err)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue() + err.getvalue()
    return 0, out.getvalue() + err.getvalue()


def beat(kind: str, seconds_ago: float = 1, host: str = HOST, **fields) -> Process:
    return ProcessFactory(
        kind=kind,
        hostname=host,
        last_heartbeat_at=timezone.now() - timedelta(seconds=seconds_ago),
        **fields,
    )


@pytest.mark.django_db
def test_healthy_with_a_recent_worker_and_dispatcher_on_this_host():
    worker = beat(Process.Kind.WORKER, 5)
    dispatcher = beat(Process.Kind.DISPATCHER, 2)
    code, output = health()
    assert code == 0, output
    assert output.startswith(f"ok on host {HOST}: worker pid {worker.pid} (heartbeat 5s ago)")
    assert f"dispatcher pid {dispatcher.pid} (heartbeat 2s ago)" in output


@pytest.mark.django_db
def test_unhealthy_without_processes():
    code, output = health()
    assert code == 1
    assert f"unhealthy on host {HOST}: no worker; no dispatcher" in output


@pytest.mark.django_db
def test_unhealthy_when_a_heartbeat_is_older_than_the_alive_threshold(settings):
    settings.DJANGO_JOBS = {"alive_threshold": 300, "heartbeat_interval": 60}
    beat(Process.Kind.WORKER, 10)
    beat(Process.Kind.DISPATCHER, 600)
    code, output = health()
    assert code == 1
    assert "dispatcher: last heartbeat 600s ago (heartbeats must be at most 300s old)" in output
    assert health("--max-age", "900")[0] == 0
    assert health("--kind", "worker")[0] == 0


@pytest.mark.django_db
def test_max_age_and_kinds_can_be_chosen():
    beat(Process.Kind.WORKER, 60)
    beat(Process.Kind.DISPATCHER, 1)
    assert health("--max-age", "30")[0] == 1
    assert health("--max-age", "90")[0] == 0
    code, output = health("--kind", "worker", "--kind", "scheduler")
    assert code == 1 and "no scheduler" in output
    beat(Process.Kind.SCHEDULER, 1)
    assert health("--kind", "worker", "--kind", "scheduler")[0] == 0


@pytest.mark.django_db
def test_the_single_process_worker_counts_as_the_dispatcher():
    beat(Process.Kind.WORKER, 1, metadata={"single_process": True})
    assert health()[0] == 0
    beat(Process.Kind.WORKER, 1, host="elsewhere")
    code, output = health("--host", "elsewhere")
    assert code == 1 and "no dispatcher" in output


@pytest.mark.django_db
def test_processes_of_another_host_do_not_count_unless_asked():
    beat(Process.Kind.WORKER, 1, host="pod-b")
    beat(Process.Kind.DISPATCHER, 1, host="pod-b")
    assert health()[0] == 1
    assert health("--host", "pod-b")[0] == 0
    code, output = health("--any-host")
    assert code == 0 and output.startswith("ok on any host: ")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **FAST_ENV, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("TEST_DATABASE_NAME", None)
    return env


def health_process(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(MANAGE), "jobs_health"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_unreadable_database_exits_2(tmp_path):
    env = subprocess_env(DATABASE_URL=f"sqlite:///{tmp_path}/no-such-dir/jobs.sqlite3")
    done = health_process(env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unhealthy: cannot read the jobs database" in done.stderr


@pytest.mark.workers
def test_follows_real_run_jobs_processes(run_jobs):
    """Healthy while run_jobs runs; unhealthy once it stops, or once its heartbeats stop."""
    env = subprocess_env(DATABASE_URL=database_url())
    proc = run_jobs()
    wait_until(lambda: health_process(env).returncode == 0, what="a healthy check")
    assert "ok on host" in health_process(env).stdout
    proc.send(signal.SIGTERM)
    assert proc.wait() == 0
    done = health_process(env)
    assert done.returncode == 1 and "no worker; no dispatcher" in done.stderr
    # Killed outright: the rows stay, and the check fails once their heartbeats are older
    # than the alive threshold (3 s in the tests' settings).
    killed = run_jobs()
    wait_until(lambda: health_process(env).returncode == 0, what="a healthy check")
    killed.kill()
    assert Process.objects.exists()
    failed = wait_until(
        lambda: (done := health_process(env)).returncode == 1 and done,
        what="an unhealthy check after SIGKILL",
    )
    assert "last heartbeat" in failed.stderr
