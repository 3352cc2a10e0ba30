"""``run_jobs --reload`` with real processes: an edited task module runs as edited, the job
running at the reload is not lost, a burst of edits restarts once, broken code waits for its
fix (issue 36, point 3).

Each test writes its own task module into a directory of its own, put on the PYTHONPATH of
run_jobs (and on this process's ``sys.path``, to enqueue), so no tracked file is edited.
"""

from __future__ import annotations

import importlib
import itertools
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from django_jobs.models import FailedExecution, JobStatus, Process
from django_jobs.runtime.reloader import SETTLE_INTERVAL
from tests.harness import (
    MANAGE,
    REPO_ROOT,
    RunJobs,
    database_url,
    job_row,
    pid_alive,
    wait_until,
)

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

MODULE = '''\
import time
from pathlib import Path

from django.tasks import task

{extra}

@task
def version() -> str:
    return "{version}"


@task
def version_when(started: str, go: str) -> str:
    """Writes ``started``, then waits for the test to create ``go``."""
    Path(started).write_text("started")
    while not Path(go).exists():
        time.sleep(0.02)
    return "{version}"
'''

RESTARTING = "changed; restarting run_jobs"
STARTED = "run_jobs started (pid"
STAYS_STOPPED = "run_jobs stays stopped until this file compiles"


class TaskModule:
    """A task module of the test's own, written (and rewritten) as an editor would."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.name = f"reload_tasks_{uuid.uuid4().hex[:12]}"
        self.path = directory / f"{self.name}.py"

    def write(self, version: str, extra: str = "") -> None:
        self.path.write_text(MODULE.format(version=version, extra=extra))

    def enqueue(self, task_name: str = "version", *args: str):
        """Through the module as first written: a job names its task by path, and the
        worker imports whatever the file holds by then."""
        return getattr(sys.modules[self.name], task_name).enqueue(*args)


@pytest.fixture
def task_module(tmp_path):
    directory = tmp_path / "code"
    directory.mkdir()
    module = TaskModule(directory)
    module.write("v1")
    sys.path.insert(0, str(directory))
    importlib.import_module(module.name)
    yield module
    sys.path.remove(str(directory))
    sys.modules.pop(module.name, None)


@pytest.fixture
def run_reloading(run_jobs, task_module):
    def start(*args: str, env: dict[str, str] | None = None) -> RunJobs:
        proc = run_jobs(
            "--reload", *args, env={"PYTHONPATH": str(task_module.directory), **(env or {})}
        )
        proc.wait_for_output("worker started", 60)
        return proc

    return start


def succeeded_with(result, value: str) -> bool:
    job = job_row(result)
    assert job.status not in (JobStatus.FAILED, JobStatus.DISCARDED), job.status
    return job.status == JobStatus.SUCCEEDED and job.return_value == value


def wait_for_reloads(proc: RunJobs, count: int) -> None:
    """Until ``count`` restarts have their new run_jobs' worker up."""
    wait_until(lambda: proc.count(RESTARTING) >= count, 30, what=f"{count} reload(s)")
    wait_until(lambda: proc.count("worker started") >= count + 1, 60, what=f"worker {count + 1} up")


def stop(proc: RunJobs) -> None:
    proc.send(signal.SIGINT)  # Ctrl-C reaches the reloader only: it stops its run_jobs
    assert proc.wait(60) == 0, proc.output()
    assert not Process.objects.exists()


@pytest.mark.parametrize("mode", [[], ["--single-process"]], ids=["supervisor", "single"])
def test_an_edited_task_module_runs_as_edited_after_the_reload(run_reloading, task_module, mode):
    proc = run_reloading(*mode)
    first = task_module.enqueue()
    wait_until(lambda: succeeded_with(first, "v1"), 30, what="v1's result")

    task_module.write("v2")
    wait_for_reloads(proc, 1)
    second = task_module.enqueue()
    wait_until(lambda: succeeded_with(second, "v2"), 30, what="v2's result")
    assert f"{task_module.path} changed; restarting run_jobs" in proc.output()
    assert not FailedExecution.objects.exists()
    stop(proc)


def test_the_job_running_at_the_reload_finishes_and_is_not_run_again(
    run_reloading, task_module, tmp_path
):
    started, go = tmp_path / "started", tmp_path / "go"
    proc = run_reloading(env={"JOBS_SHUTDOWN_TIMEOUT": "60"})  # ample for a loaded machine
    running = task_module.enqueue("version_when", str(started), str(go))
    wait_until(started.exists, 30, what="the job running")

    task_module.write("v2")
    # The reload's graceful stop has begun: the job runs on through it.
    wait_until(lambda: "shutting down gracefully (SIGTERM)" in proc.output(), 30)
    assert job_row(running).status == JobStatus.RUNNING
    go.touch()
    wait_until(lambda: succeeded_with(running, "v1"), 30, what="the running job's result")
    wait_for_reloads(proc, 1)
    after = task_module.enqueue()
    wait_until(lambda: succeeded_with(after, "v2"), 30, what="v2's result")
    assert job_row(running).attempts == 1
    assert not FailedExecution.objects.exists()
    stop(proc)


def test_a_burst_of_edits_restarts_once(run_reloading, task_module, tmp_path):
    others = [task_module.directory / f"{task_module.name}_part{i}.py" for i in range(5)]
    for other in others:
        other.write_text("VALUE = 0\n")
    proc = run_reloading()

    # Forty saves over four seconds, longer than a poll and a stop of run_jobs together:
    # without the wait for the burst to end, the reloader would restart at the first poll
    # that sees some, and again at a later one. No pause between two saves is long enough
    # to end the burst.
    saved = [time.monotonic()]
    for i in range(40):
        others[i % len(others)].write_text(f"VALUE = {i + 1}\n")
        time.sleep(0.1)
        saved.append(time.monotonic())
    task_module.write("v2")
    wait_for_reloads(proc, 1)
    result = task_module.enqueue()
    wait_until(lambda: succeeded_with(result, "v2"), 30, what="v2's result")
    longest = max(later - earlier for earlier, later in itertools.pairwise(saved))
    assert longest < SETTLE_INTERVAL, f"this machine paused the test {longest:.2f}s"
    assert proc.count(RESTARTING) == 1, proc.output()
    assert proc.count(STARTED) == 2, proc.output()
    stop(proc)


def test_a_syntax_error_stops_run_jobs_until_the_fix(run_reloading, task_module):
    proc = run_reloading()
    task_module.write("v2", extra="def broken(:\n    pass\n")
    line = MODULE.splitlines().index("{extra}") + 1
    wait_until(lambda: proc.count(STAYS_STOPPED) == 1, 30, what="the syntax error reported")
    assert f"{task_module.path}, line {line}: SyntaxError: " in proc.output()
    wait_until(lambda: not Process.objects.exists(), 30, what="run_jobs stopped")

    # Enqueued while the code is broken: it waits, where a worker would fail it for good at
    # its import. A second broken save, seen by the reloader, gives a worker the time.
    waiting = task_module.enqueue()
    task_module.write("v2", extra="def still_broken(:\n    pass\n")
    wait_until(lambda: proc.count(STAYS_STOPPED) == 2, 30, what="the second save seen")
    assert job_row(waiting).status == JobStatus.READY

    task_module.write("v3")
    wait_until(lambda: succeeded_with(waiting, "v3"), 60, what="v3's result")
    assert job_row(waiting).attempts == 1
    assert proc.count(STARTED) == 2, proc.output()  # at start, and once fixed
    stop(proc)


def test_run_jobs_failing_at_start_waits_for_a_change_instead_of_looping(
    run_reloading, task_module
):
    """An import error a compile cannot see (the module is checked at start, through a
    recurring task): the restarted run_jobs fails its checks and exits, and the reloader
    starts it again only once the file changes."""
    recurring = f'{{"v": {{"task": "{task_module.name}.version", "schedule": "@yearly"}}}}'
    proc = run_reloading(env={"JOBS_RECURRING": recurring})
    task_module.write("v2", extra='raise RuntimeError("broken on purpose")')
    wait_until(lambda: "run_jobs exited by itself (code 1)" in proc.output(), 60)
    assert "broken on purpose" in proc.output()
    # A window for a crash loop to show itself: it would start run_jobs each second.
    time.sleep(3)
    assert proc.count(STARTED) == 2, proc.output()

    task_module.write("v3")
    wait_until(lambda: proc.count("worker started") == 2, 60, what="the fixed run_jobs up")
    result = task_module.enqueue()
    wait_until(lambda: succeeded_with(result, "v3"), 30, what="v3's result")
    assert proc.count(STARTED) == 3, proc.output()
    stop(proc)


def test_reload_refuses_once(run_jobs):
    proc = run_jobs("--reload", "--once")
    assert proc.wait(60) == 1
    assert "--reload and --once exclude each other" in proc.output()
    assert not Process.objects.exists()


def test_reload_refuses_call_command():
    with pytest.raises(CommandError, match=r"start it as `manage.py run_jobs --reload`"):
        call_command("run_jobs", reload=True)


def test_a_command_line_that_cannot_be_run_again_is_refused_clearly(transactional_db, tmp_path):
    """run_jobs called from ``python -c`` has no script to run again: --reload says so, and
    the same run without --reload works."""
    harness = RunJobs([], database_url=database_url(), log_path=tmp_path / "log", extra_env={})
    env = {**harness.env, "PYTHONPATH": str(REPO_ROOT)}
    code = (
        f"import os, sys; sys.path.insert(0, {str(MANAGE.parent.parent)!r}); "
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'testproject.settings'); "
        "from django.core.management import execute_from_command_line; "
        "execute_from_command_line(['manage.py', 'run_jobs', *sys.argv[1:]])"
    )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = run("--reload")
    assert refused.returncode == 1, refused
    assert (
        "--reload: cannot find this command line to run it again (Script -c does not exist.); "
        "run_jobs without --reload works"
    ) in refused.stderr

    from tests import tasks

    result = tasks.add.enqueue(2, 3)
    drained = run("--once")
    assert drained.returncode == 0, drained
    assert job_row(result).status == JobStatus.SUCCEEDED


def test_run_jobs_stops_by_itself_when_its_reloader_is_killed(run_reloading):
    """Nothing left running unwatched: the reloaded run_jobs notices its parent is gone."""
    proc = run_reloading()
    tree = proc.tree()
    assert Process.objects.exists()
    proc.send(signal.SIGKILL)
    proc.wait(10)
    wait_until(lambda: not any(pid_alive(pid) for pid in tree), 60, what="run_jobs gone")
    assert "shutting down gracefully (the reloader is gone)" in proc.output()
    assert not Process.objects.exists()
