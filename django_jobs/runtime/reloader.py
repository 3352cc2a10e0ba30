"""``run_jobs --reload``: run ``run_jobs`` as a child process, restart it when the code changes.

The whole command is restarted, as runserver restarts the whole server, not
the workers alone: the supervisor and its warm parent (``runtime/warm.py``)
hold the modules they imported at start (settings, models, whatever those
import), and every worker is a fork of them, so only a fresh interpreter runs
the code as it is on disk.

The reloader is the process the user started. It sets Django up (so bad flags
and settings fail once, at start), then runs the same command line again as
its child, with ``RELOADER_ENV`` naming itself, and polls the watched files
(``runtime/watched_files.py``). A change, once the burst it belongs to has
settled (a save of several files, a ``git checkout``, a formatter), stops the
child gracefully (docs/running.md "Stopping") and waits for it: running jobs
finish or are handed back, within the shutdown timeout. Then a new child
starts, unless a changed file of the code ``run_jobs`` imports does not
compile (``watched_files.ImportedCode``: the modules loaded at start and the
other modules of their packages, an app's ``tasks.py``, test modules aside).
Such a file leaves ``run_jobs`` stopped, the error logged, until a later change
fixes it: a worker started on it would fail each job whose task it cannot
import, for good (``executor.fail_unloadable``). Any other file that does not
compile (a script, a test) is reported as a warning, and the child starts:
``run_jobs`` imports none of it at start, and holding every job back for it
would stop the jobs of a developer who is only editing a test (a task module
outside those packages, an unusual layout, fails its jobs as "cannot be
imported" then, as after a deploy). A child that exits by itself (a failed
check, an import error at start) is not started again until a file changes: no
crash loop.

The child stays in the reloader's process group, the terminal's foreground
group, as runserver's does: a task of a ``--single-process`` run that reads the
terminal (``input()``, ``breakpoint()``) reads it, where a background group
would be stopped by SIGTTIN, deaf to every stop signal but SIGKILL. So a
Ctrl-C reaches the child as well as the reloader, and the child takes it as
``run_jobs`` alone does (a first one graceful, a second one at once). What the
reloader forwards must not count twice: it asks with SIGUSR1, which only ever
means graceful (``runtime/lifecycle.py``), and with SIGQUIT only once it is
itself told to stop at once. Each request is followed by SIGCONT to the
child's tree, so that a stopped process gets it; a child that does not stop
in time is killed with every process below it. A child whose reloader is gone
stops gracefully by itself (``watch_reloader``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from django.db import connections
from django.utils.autoreload import get_child_arguments

from django_jobs.conf import JobsSettings
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.watched_files import ImportedCode, Watcher, project_roots
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.reloader")

# Set in the child's environment to the reloader's pid: a run_jobs whose parent
# it names is the reloaded command, and runs instead of reloading.
RELOADER_ENV = "DJANGO_JOBS_RELOADER"

POLL_INTERVAL = 1.0  # seconds between two polls of the watched files, as StatReloader's
SETTLE_INTERVAL = 0.5  # a burst of changes has ended after one such poll finds none
MAX_BURST = 5.0  # changes that never settle restart after this long all the same
NAMED_FILES = 3  # how many changed files a log line names


class ReloadUnavailable(Exception):
    """``--reload`` cannot run here; the message says why and what to do instead."""


def under_reloader() -> bool:
    """True in the command a reloader started (not in one started by hand)."""
    return os.environ.get(RELOADER_ENV) == str(os.getppid())


class ReloadedLifecycle(Lifecycle):
    """The reloaded command's: its stop signals are those of ``run_jobs`` alone, and
    its reloader's graceful request (SIGUSR1) is logged as the reloader's."""

    def on_signal(self, signum: signal.Signals) -> None:
        if signum == signal.SIGUSR1:
            self.request_stop("asked by the reloader")  # then the base's is a no-op
        super().on_signal(signum)


def watch_reloader(lifecycle: Lifecycle) -> None:
    """Stop gracefully once the reloader is gone (killed), rather than run on unwatched.

    The thread sleeps holding no lock, so the supervisor's later fork of its
    warm parent inherits nothing of it.
    """
    reloader = os.getppid()

    def watch() -> None:
        while os.getppid() == reloader:
            time.sleep(1.0)
        lifecycle.request_stop("the reloader is gone")

    threading.Thread(target=watch, name="django-jobs-reloader-watch", daemon=True).start()


def run_reloading(conf: JobsSettings, lifecycle: Lifecycle) -> int:
    """Run the command line as a child until a stop signal; ReloadUnavailable if it cannot."""
    command = child_command()
    roots = project_roots()
    if not roots:
        logger.warning(
            "--reload found no directory of the project to watch (settings.BASE_DIR, or a "
            "sys.path entry outside the interpreter's prefix and site-packages): only the "
            "modules loaded at start are watched, not the task modules"
        )
    watcher = Watcher(roots)
    logger.info(
        "--reload: watching %d files, the project's under %s (polled every %gs)",
        len(watcher.stamps),
        ", ".join(str(root) for root in roots) or "no directory",
        POLL_INTERVAL,
    )
    connections.close_all()  # each child opens its own; this process needs none
    # A child's graceful stop: its shutdown timeout and interrupt grace, the
    # supervisor's 5 s for the outcomes, and room for its own start.
    stop_timeout = conf.shutdown_timeout + conf.interrupt_grace + 5.0 + 30.0
    code = Reloader(command, watcher, lifecycle, stop_timeout, ImportedCode()).run()
    return max(code, 0)  # a child killed by the forwarded signal was stopped as asked


def child_command() -> list[str]:
    """This process's own command line, to run again (``manage.py``, ``django-admin``,
    ``python -m django``), as runserver's reloader builds it."""
    try:
        return [str(arg) for arg in get_child_arguments()]
    except RuntimeError as exc:
        raise ReloadUnavailable(f"cannot find this command line to run it again ({exc})") from exc


def syntax_errors(paths: Iterable[Path]) -> dict[Path, str]:
    """The Python files among ``paths`` that do not compile, each with its error."""
    errors: dict[Path, str] = {}
    for path in paths:
        if path.suffix != ".py":
            continue
        try:
            source = path.read_bytes()
        except OSError:
            continue  # deleted: nothing will import it
        try:
            compile(source, str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            line = getattr(exc, "lineno", None)
            where = f"{path}, line {line}" if line else str(path)
            errors[path] = f"{where}: {type(exc).__name__}: {getattr(exc, 'msg', exc)}"
    return errors


def forget_bytecode(paths: Iterable[Path]) -> None:
    """Delete the cached bytecode of the changed sources. Python trusts a ``.pyc`` whose
    recorded source size and mtime (whole seconds) match the file: a save of the same size
    within the second of the last import (an editor's quick fix of one character, a test's
    "v1" to "v2") would have the restarted run_jobs import the old code."""
    for path in paths:
        if path.suffix != ".py":
            continue
        for optimization in ("", 1, 2):
            try:
                cached = importlib.util.cache_from_source(str(path), optimization=optimization)
                Path(cached).unlink(missing_ok=True)
            except (NotImplementedError, ValueError, OSError) as exc:
                logger.debug("--reload: could not forget the bytecode of %s: %s", path, exc)


def describe(paths: set[Path]) -> str:
    names = sorted(str(path) for path in paths)
    shown = ", ".join(names[:NAMED_FILES])
    return shown if len(names) <= NAMED_FILES else f"{shown} and {len(names) - NAMED_FILES} more"


def process_tree(root: int) -> list[int]:
    """Every live process below ``root``, its children first, then theirs.

    The child's own process group would not do: it is the reloader's (the
    terminal's), and a supervisor's workers each have a group of their own.
    """
    children: dict[int, list[int]] = {}
    for pid, parent in process_parents().items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        frontier = [pid for parent in frontier for pid in children.get(parent, [])]
        found += frontier
    return found


def process_parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """Each process's parent: from ``/proc`` (Linux), else from ``ps`` (macOS, the BSDs);
    empty if neither answers (the child alone is then signalled)."""
    if (proc / "self" / "stat").exists():
        parents: dict[int, int] = {}
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            # The command name, in parentheses, may itself hold spaces and parentheses.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        return parents
    try:
        listing = subprocess.run(
            ["ps", "-A", "-o", "pid=", "-o", "ppid="],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split() for line in listing.splitlines())
    return {int(pair[0]): int(pair[1]) for pair in pairs if len(pair) == 2}


def send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # gone meanwhile


def send_child(child: subprocess.Popen[bytes], signum: int) -> None:
    """Through ``Popen``, which signals no pid once it has reaped the child."""
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass


class Reloader:
    """Runs ``command`` as a child, and again after each settled change of the code."""

    def __init__(
        self,
        command: list[str],
        watcher: Watcher,
        lifecycle: Lifecycle,
        stop_timeout: float,
        imported: ImportedCode,
    ) -> None:
        self.command = command
        self.watcher = watcher
        self.lifecycle = lifecycle
        self.stop_timeout = stop_timeout
        self.imported = imported
        self.child: subprocess.Popen[bytes] | None = None
        self.broken: dict[Path, str] = {}

    def run(self) -> int:
        """Until a stop signal; then the child's exit code (0 if none was running)."""
        self.start()
        while not self.lifecycle.stopping.is_set():
            self.lifecycle.sleep(POLL_INTERVAL)
            if self.lifecycle.stopping.is_set():
                break
            self.notice_exit()
            changed = self.watcher.poll()
            if changed:
                self.reload(changed | self.settle())
        return self.stop()

    def start(self) -> None:
        env = {**os.environ, RELOADER_ENV: str(os.getpid())}
        # In this process's group, the terminal's foreground one (see the module docstring).
        self.child = subprocess.Popen(self.command, env=env)
        logger.info("run_jobs started (pid %d); reloading it when the code changes", self.child.pid)

    def settle(self) -> set[Path]:
        """Further changes of the same burst, until a poll finds none: one restart for
        a save of ten files, not ten."""
        changed: set[Path] = set()
        deadline = time.monotonic() + MAX_BURST
        while time.monotonic() < deadline and not self.lifecycle.stopping.is_set():
            self.lifecycle.sleep(SETTLE_INTERVAL)
            more = self.watcher.poll()
            if not more:
                break
            changed |= more
        return changed

    def reload(self, changed: set[Path]) -> None:
        logger.info("%s changed; restarting run_jobs", describe(changed))
        self.stop()
        if self.lifecycle.stopping.is_set():
            return
        changed |= self.watcher.poll()  # edits made while the child stopped
        errors = syntax_errors(changed | set(self.broken))
        self.broken = {path: error for path, error in errors.items() if path in self.imported}
        for path, error in errors.items():
            if path not in self.broken:
                logger.warning(
                    "--reload: %s (not a module run_jobs imports: restarting all the same)",
                    error,
                )
        if self.broken:
            for error in self.broken.values():
                logger.error("--reload: %s", error)
            logger.error(
                "run_jobs stays stopped until %s compiles; watching for the fix",
                "this file" if len(self.broken) == 1 else "these files",
            )
            return
        forget_bytecode(changed)
        self.start()

    def notice_exit(self) -> None:
        """A child that exited by itself waits for a change of the code, not a restart
        loop: whatever stopped it (a failed check, an import error) is in the code."""
        if self.child is None or self.child.poll() is None:
            return
        logger.error(
            "run_jobs exited by itself (code %d); it starts again when a watched file changes",
            self.child.returncode,
        )
        self.child = None

    def stop(self) -> int:
        """Stop the child gracefully (at once after a second Ctrl-C); its exit code."""
        child, self.child = self.child, None
        if child is None:
            return 0
        immediate = self.lifecycle.immediate.is_set()
        self.ask(child, signal.SIGQUIT if immediate else signal.SIGUSR1)
        deadline = time.monotonic() + self.stop_timeout
        while child.poll() is None:
            if time.monotonic() > deadline:
                logger.error("run_jobs (pid %d) did not stop; killing it", child.pid)
                return self.kill(child)
            if self.lifecycle.immediate.is_set() and not immediate:
                immediate = True
                self.ask(child, signal.SIGQUIT)
            try:
                child.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        return child.returncode

    @staticmethod
    def ask(child: subprocess.Popen[bytes], signum: int) -> None:
        """Send ``signum``, then SIGCONT to the child and its tree: a stopped process
        (Ctrl-Z, SIGSTOP, a read of the terminal from a background group) would keep the
        request pending, and stop nothing, until it is continued."""
        send_child(child, signum)
        send_child(child, signal.SIGCONT)
        for pid in process_tree(child.pid):
            send(pid, signal.SIGCONT)

    @staticmethod
    def kill(child: subprocess.Popen[bytes]) -> int:
        """SIGKILL the child and every process below it (a supervisor's workers, which a
        kill of the supervisor alone would leave running): frozen first, so that it
        starts no other meanwhile."""
        send_child(child, signal.SIGSTOP)
        for pid in process_tree(child.pid):
            send(pid, signal.SIGKILL)
        send_child(child, signal.SIGKILL)
        return child.wait()
