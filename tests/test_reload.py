"""``run_jobs --reload`` with real processes: an edited task module runs as edited, the job
running at the reload is not lost, a burst of edits restarts once, broken code waits for its
fix (issue 36, point 3).

Each test writes its own task module into a directory of its own, put on the PYTHONPATH of
run_jobs (and on this process's ``sys.path``, to enqueue), so no tracked file is edited.
"""

from __future__ import annotations

import importlib
import itertools
import os
import signal
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from django_jobs.models import FailedExecution, JobStatus, Process
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.reloader import (
    MAX_BURST,
    POLL_INTERVAL,
    RELOADER_ENV,
    SETTLE_INTERVAL,
    Reloader,
)
from django_jobs.runtime.watched_files import ImportedCode, Watcher
from tests.harness import (
    MANAGE,
    REPO_ROOT,
    RunJobs,
    database_url,
    descendant_pids,
    job_row,
    pid_alive,
    wait_until,
)

# What a reload does is the same on every database: tox runs this module in one database's
# environment (pyproject.toml, marker one_database).
pytestmark = [
    pytest.mark.workers,
    pytest.mark.one_database,
    pytest.mark.django_db(transaction=True),
]

MODULE = '''\
import time
from pathlib import Path

from django.tasks import task

{extra}

@task
def version() -> str:
    return "{version}"


@task
def asks(started: str) -> str:
    """Writes ``started``, then reads its answer from the terminal, as a breakpoint would."""
    Path(started).write_text("started")
    return input()


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
IMMEDIATE = "django_jobs.runner: stopping immediately (second SIGINT)"
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
    started: list[RunJobs] = []

    def start(*args: str, env: dict[str, str] | None = None) -> RunJobs:
        proc = run_jobs(
            "--reload", *args, env={"PYTHONPATH": str(task_module.directory), **(env or {})}
        )
        started.append(proc)
        proc.wait_for_output("worker started", 60)
        return proc

    yield start
    assert_nothing_left_behind(started)


def left_behind(reloader: int) -> list[int]:
    """Live processes of the run_jobs the reloader ``reloader`` started and of whatever those
    started, found by the environment they inherit (``RELOADER_ENV``): still found once
    orphaned, when their parent pid no longer leads back to the reloader."""
    marker = f"{RELOADER_ENV}={reloader}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environment.split(b"\0") and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def assert_nothing_left_behind(reloaders: list[RunJobs]) -> None:
    """Teardown: a reloader that has exited (whatever way the test stopped it) left no
    process behind. One still running is the harness's to kill."""
    for proc in reloaders:
        if proc.proc is not None and proc.proc.poll() is not None:
            assert not left_behind(proc.pid), (left_behind(proc.pid), proc.output())


def voluntary_switches(pid: int) -> int:
    """How often the main thread of ``pid`` has given up the processor (to sleep, mostly)."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("voluntary_ctxt"))
    return int(line.split()[1])


def succeeded_with(result, value: str) -> bool:
    job = job_row(result)
    assert job.status not in (JobStatus.FAILED, JobStatus.DISCARDED), job.status
    return job.status == JobStatus.SUCCEEDED and job.return_value == value


def wait_for_reloads(proc: RunJobs, count: int) -> None:
    """Until ``count`` restarts have their new run_jobs' worker up."""
    wait_until(lambda: proc.count(RESTARTING) >= count, 30, what=f"{count} reload(s)")
    wait_until(lambda: proc.count("worker started") >= count + 1, 60, what=f"worker {count + 1} up")


def stop(proc: RunJobs) -> None:
    """As ``kill -INT`` of the reloader (the terminal's Ctrl-C is in the tests at the end):
    it stops its run_jobs gracefully, which exits before it, leaving nothing behind."""
    tree = proc.tree()
    assert tree, "no run_jobs under the reloader"
    proc.send(signal.SIGINT)
    assert proc.wait(60) == 0, proc.output()
    assert not any(pid_alive(pid) for pid in tree), tree
    assert not left_behind(proc.pid)
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
    wait_until(lambda: "shutting down gracefully (asked by the reloader)" in proc.output(), 30)
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
    # to end the burst, unless this machine pauses the test: then each pause that could have
    # ended it (its two saves, timed around the writes, SETTLE_INTERVAL apart or more) may
    # add a restart, as may each MAX_BURST of saves, and the test allows for what it saw.
    saves: list[tuple[float, float]] = []
    for i in range(40):
        before = time.monotonic()
        others[i % len(others)].write_text(f"VALUE = {i + 1}\n")
        saves.append((before, time.monotonic()))
        time.sleep(0.1)
    before = time.monotonic()
    task_module.write("v2")
    saves.append((before, time.monotonic()))
    pauses = sum(
        1
        for (earlier, _), (_, later) in itertools.pairwise(saves)
        if later - earlier >= SETTLE_INTERVAL
    )
    allowed = 1 + pauses + int((saves[-1][1] - saves[0][0]) // MAX_BURST)

    wait_for_reloads(proc, 1)
    result = task_module.enqueue()
    wait_until(lambda: job_row(result).status == JobStatus.SUCCEEDED, 30, what="its result")
    if allowed == 1:
        # The one restart ran v2, so no save came after it: every restart is in the log.
        assert job_row(result).return_value == "v2"
        assert proc.count(RESTARTING) == 1, proc.output()
        assert proc.count(STARTED) == 2, proc.output()
    else:
        assert proc.count(RESTARTING) <= allowed, (allowed, proc.output())
    stop(proc)


def test_a_syntax_error_stops_run_jobs_until_the_fix(run_reloading, task_module):
    """In a module run_jobs imports: here loaded at start through a recurring task, as the
    settings load an app (whose other modules, its tasks.py, count the same)."""
    recurring = f'{{"v": {{"task": "{task_module.name}.version", "schedule": "@yearly"}}}}'
    proc = run_reloading(env={"JOBS_RECURRING": recurring})
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


def test_a_syntax_error_in_a_file_run_jobs_does_not_import_holds_nothing_back(
    run_reloading, task_module
):
    """A script beside the code (a test module the same): run_jobs imports none of it, so
    its error is reported and run_jobs restarts all the same, running the edited code."""
    script = task_module.directory / f"scratch_{uuid.uuid4().hex[:12]}.py"
    script.write_text("x = 1\n")
    proc = run_reloading()
    script.write_text("def broken(:\n    pass\n")
    task_module.write("v2")
    wait_for_reloads(proc, 1)
    result = task_module.enqueue()
    wait_until(lambda: succeeded_with(result, "v2"), 30, what="v2's result")
    assert f"--reload: {script}, line 1: SyntaxError: " in proc.output()
    assert "(not a module run_jobs imports: restarting all the same)" in proc.output()
    assert STAYS_STOPPED not in proc.output()
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
    # A crash loop would start run_jobs again at the reloader's next poll. That nothing
    # happens can only be watched for a while: the window is three of the reloader's own
    # sleeps between two polls (its main thread's voluntary context switches), so that a
    # machine too loaded to let it poll lengthens the window rather than emptying it, and
    # at least three poll intervals. Throughout, neither the log nor the process table may
    # show a run_jobs started without a change logged first (a change to any watched file,
    # this checkout's included, restarts it, rightly).
    restarts = proc.count(RESTARTING)
    sleeps, opened = voluntary_switches(proc.pid), time.monotonic()

    def window_closed() -> bool:
        running = proc.tree()
        output = proc.output()
        assert output.count(RESTARTING) > restarts or not running, output
        assert output.count(STARTED) - output.count(RESTARTING) <= 1, output
        polled = voluntary_switches(proc.pid) - sleeps >= 3
        return polled and time.monotonic() - opened >= 3 * POLL_INTERVAL

    wait_until(window_closed, 60, what="three polls of the reloader")

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


# --- From a terminal: the developer's Ctrl-C, and a task that reads the terminal -------------

# Makes the pseudo-terminal on stdin this (new session's) process's controlling terminal,
# its process group the terminal's foreground group, then becomes the command: what a shell
# does for the job it runs in the foreground.
LOGIN_TTY = (
    "import fcntl, os, sys, termios; "
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


class TerminalRunJobs(RunJobs):
    """``run_jobs`` started in the foreground of a terminal: a pseudo-terminal is its
    controlling terminal and its stdin; its output goes to the log, as RunJobs'. Typing
    ``^C`` into the terminal sends SIGINT to its foreground process group, as a keyboard's
    Ctrl-C does."""

    def start(self) -> None:
        self.terminal, tty = os.openpty()
        attributes = termios.tcgetattr(tty)
        attributes[3] = (attributes[3] | termios.ISIG | termios.ICANON) & ~termios.ECHO
        attributes[6][termios.VINTR] = b"\x03"
        termios.tcsetattr(tty, termios.TCSANOW, attributes)
        self.log = open(self.log_path, "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOGIN_TTY, str(MANAGE), "run_jobs", *self.args],
            cwd=REPO_ROOT,
            env=self.env,
            stdin=tty,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        os.close(tty)

    def type(self, text: bytes) -> None:
        os.write(self.terminal, text)

    def ctrl_c(self) -> None:
        self.type(b"\x03")

    def close(self) -> None:
        super().close()
        os.close(self.terminal)


@pytest.fixture
def reloading_in_terminal(transactional_db, tmp_path, task_module):
    started: list[TerminalRunJobs] = []

    def start(*args: str, env: dict[str, str] | None = None) -> TerminalRunJobs:
        proc = TerminalRunJobs(
            ["--reload", *args],
            database_url=database_url(),
            log_path=tmp_path / f"terminal-{len(started)}.log",
            extra_env={"PYTHONPATH": str(task_module.directory), **(env or {})},
        )
        proc.start()
        started.append(proc)
        proc.wait_for_output("worker started", 60)
        return proc

    yield start
    assert_nothing_left_behind(started)
    for proc in started:
        proc.close()


def graceful_stops(proc: RunJobs, pid: int) -> int:
    """How many times process ``pid`` logged the start of its graceful stop."""
    return proc.count(f"[{pid}] INFO django_jobs.runner: shutting down gracefully")


def child_pid(proc: RunJobs) -> int:
    """The pid of the run_jobs the reloader started last."""
    return int(proc.output().rsplit(STARTED, 1)[1].split(")", 1)[0])


def test_a_task_reading_the_terminal_gets_its_answer_and_ctrl_c_stops_gracefully(
    reloading_in_terminal, task_module, tmp_path
):
    """A task's ``input()`` (a ``breakpoint()``) under ``--reload --single-process`` reads the
    terminal, as without --reload; one Ctrl-C starts the graceful stop of the reloader and
    of its run_jobs alike, and the job waiting for its answer finishes once it is typed."""
    proc = reloading_in_terminal("--single-process", env={"JOBS_SHUTDOWN_TIMEOUT": "60"})
    first, started = tmp_path / "first", tmp_path / "second"
    answered = task_module.enqueue("asks", str(first))
    wait_until(first.exists, 30, what="the first job asking")
    proc.type(b"first answer\n")
    wait_until(lambda: succeeded_with(answered, "first answer"), 30, what="its answer read")

    asking = task_module.enqueue("asks", str(started))
    wait_until(started.exists, 30, what="the second job asking")
    tree = proc.tree()
    proc.ctrl_c()
    wait_until(lambda: graceful_stops(proc, proc.pid) == 1, 30, what="the reloader stopping")
    wait_until(lambda: graceful_stops(proc, child_pid(proc)) == 1, 30, what="run_jobs stopping")
    assert job_row(asking).status == JobStatus.RUNNING
    proc.type(b"second answer\n")
    wait_until(lambda: succeeded_with(asking, "second answer"), 30, what="the answer read")
    assert proc.wait(60) == 0, proc.output()
    assert "stopping immediately" not in proc.output()  # one Ctrl-C: one graceful stop
    assert not any(pid_alive(pid) for pid in tree), tree
    assert not Process.objects.exists()


def test_a_second_ctrl_c_stops_at_once_while_a_task_waits_for_the_terminal(
    reloading_in_terminal, task_module, tmp_path
):
    """The second Ctrl-C reaches the reloader and its run_jobs alike: each counts it once,
    and the run_jobs stops at once, where the graceful stop would wait a minute for the
    answer. The job is left to recovery, as by any immediate stop."""
    proc = reloading_in_terminal("--single-process", env={"JOBS_SHUTDOWN_TIMEOUT": "60"})
    started = tmp_path / "started"
    asking = task_module.enqueue("asks", str(started))
    wait_until(started.exists, 30, what="the job asking")
    run_jobs_pid = child_pid(proc)
    proc.ctrl_c()
    wait_until(lambda: graceful_stops(proc, run_jobs_pid) == 1, 30, what="run_jobs stopping")
    proc.ctrl_c()
    assert proc.wait(30) == 0, proc.output()
    output = proc.output()
    assert (
        f"[{run_jobs_pid}] WARNING django_jobs.runner: stopping immediately (second SIGINT)"
        in output
    )
    assert (
        f"[{proc.pid}] WARNING django_jobs.runner: stopping immediately (second SIGINT)" in output
    )
    assert not left_behind(proc.pid)
    assert job_row(asking).status == JobStatus.RUNNING


def test_a_task_that_never_gets_its_answer_delays_the_stop_by_the_shutdown_timeout_only(
    reloading_in_terminal, task_module, tmp_path
):
    """Nobody answers: the graceful stop ends as for any body blocked in C, after the
    shutdown timeout and the interrupt grace, the job's claim left to recovery; nothing
    waits for the reloader's own kill, nothing is left running."""
    proc = reloading_in_terminal(
        "--single-process", env={"JOBS_SHUTDOWN_TIMEOUT": "1", "JOBS_INTERRUPT_GRACE": "1"}
    )
    started = tmp_path / "started"
    asking = task_module.enqueue("asks", str(started))
    wait_until(started.exists, 30, what="the job asking")
    proc.ctrl_c()
    # The reloader would kill it after 1 + 1 + 35 s.
    assert proc.wait(30) == 0, proc.output()
    assert "did not stop; killing it" not in proc.output()
    assert not left_behind(proc.pid)
    assert job_row(asking).status == JobStatus.RUNNING


def process_state(pid: int) -> str | None:
    """The process's state letter, or None once it is gone (its pid read from the tree a
    moment before: a process of the tree may end meanwhile, as one did on a loaded machine)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_stopped_run_jobs_is_continued_to_hear_the_stop(run_reloading):
    """The reloaded supervisor and its worker stopped (SIGSTOP, as Ctrl-Z or a read of the
    terminal from a background group would): the reloader's request is followed by
    SIGCONT to the whole tree, so the stop is graceful and prompt, not a kill minutes on."""
    proc = run_reloading(env={"JOBS_SHUTDOWN_TIMEOUT": "60"})  # a kill after 100 s
    tree = proc.tree()
    assert len(tree) >= 2, tree  # run_jobs (a supervisor) and its worker processes
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    wait_until(
        lambda: all(process_state(pid) in ("T", None) for pid in tree), 10, what="all stopped"
    )
    supervisor = child_pid(proc)
    assert process_state(supervisor) == "T"
    proc.send(signal.SIGINT)
    assert proc.wait(40) == 0, proc.output()
    assert graceful_stops(proc, supervisor) == 1, proc.output()
    assert "did not stop; killing it" not in proc.output()
    assert not any(pid_alive(pid) for pid in tree), tree
    assert not Process.objects.exists()


# Ignores the graceful request and SIGTERM, and starts a process of its own in a process
# group of its own, as a supervisor's worker is.
STUBBORN = (
    "import signal, subprocess, sys, time; "
    "signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], process_group=0); "
    "time.sleep(600)"
)


def test_a_run_jobs_that_does_not_stop_in_time_is_killed_with_its_whole_tree(tmp_path):
    """Its kill reaches every process below it, not the child's pid alone."""
    reloader = Reloader(
        [sys.executable, "-c", STUBBORN], Watcher([]), Lifecycle(), 1.0, ImportedCode()
    )
    reloader.start()
    assert reloader.child is not None
    child = reloader.child.pid
    tree = wait_until(lambda: descendant_pids(child), 30, what="its own process")
    try:
        assert reloader.stop() == -signal.SIGKILL
        wait_until(lambda: not any(pid_alive(pid) for pid in tree), 10, what="all killed")
    finally:
        for pid in tree:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
