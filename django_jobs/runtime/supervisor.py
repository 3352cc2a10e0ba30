"""The supervisor: starts worker, dispatcher and scheduler processes, replaces the ones that die.

Children are forks of the warm parent (``runtime/warm.py``), which the
supervisor forks once before it opens a connection or starts a thread of its
own: they share one copy of Django's pages instead of setting up one each
(about 60 MB a process), and still never inherit a connection or a thread.
Should the warm parent die, further children are fresh interpreters
(``multiprocessing`` spawn). Each child is a separate process, so a crash in a
job takes down that child at most; the supervisor recovers its jobs and starts
another. Each child moves to its own
process group, so a Ctrl-C in the terminal reaches only the supervisor, which
then asks each child once, with SIGUSR1: a graceful stop that a SIGTERM sent to
every process at once (systemd, Heroku, a container runtime) does not turn into
a child's "second SIGTERM", which would mean "immediate".

On MariaDB/MySQL and SQLite the supervisor also runs the host's one check for
ready jobs (``runtime/wakeup.py``) and hands each worker process the read end of
a pipe it writes to: the supervisor already outlives its workers and replaces
them, so one query here wakes them all instead of each polling fast. A failing
check never stops the supervisor: the workers fall back to polling.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from django_jobs.conf import JobsSettings
from django_jobs.core.processes import deregister_process, prune_dead_processes
from django_jobs.db.retry import DB_ERRORS, reset_connection, retry_until_done
from django_jobs.models import Process
from django_jobs.runtime.entry import child_main
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.recycling import ABANDONED_EXIT_CODE, RECYCLE_EXIT_CODE
from django_jobs.runtime.registration import registered
from django_jobs.runtime.wakeup import ReadyCheck, ready_check_applies
from django_jobs.runtime.warm import WarmParent, WarmParentGone
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.supervisor")

RESTART_DELAY = 1.0


@dataclass
class Child:
    kind: Process.Kind
    slot: int
    process: Any = None
    started_at: float = 0.0
    restarts: int = field(default=0)


class Supervisor:
    def __init__(
        self, conf: JobsSettings, lifecycle: Lifecycle, overrides: dict[str, Any], verbosity: int
    ) -> None:
        self.conf = conf
        self.db = conf.database
        self.lifecycle = lifecycle
        self.overrides = overrides
        self.verbosity = verbosity
        self.context = multiprocessing.get_context("spawn")
        self.warm = WarmParent()
        self.children = [Child(Process.Kind.WORKER, i) for i in range(conf.processes)]
        self.children.append(Child(Process.Kind.DISPATCHER, 0))
        if conf.recurring:
            self.children.append(Child(Process.Kind.SCHEDULER, 0))
        self.process_id: int | None = None
        self.ready_check: ReadyCheck | None = None

    def run(self) -> None:
        try:
            self.warm.start()
        except OSError as exc:
            logger.warning("could not fork the warm parent (%s); children start afresh", exc)
        try:
            self.supervise()
        finally:
            self.warm.close()

    def supervise(self) -> None:
        with registered(
            self.conf, self.lifecycle, Process.Kind.SUPERVISOR, settle_when_immediate=True
        ) as process:
            if process is None:
                return
            self.process_id = process.pk
            logger.info(
                "supervisor started: %s, %d worker process(es) x %d thread(s) + dispatcher%s",
                process.name,
                self.conf.processes,
                self.conf.threads,
                " + scheduler" if self.conf.recurring else "",
            )
            if ready_check_applies(self.conf):
                self.ready_check = ReadyCheck(self.conf, self.lifecycle)
            try:
                for child in self.children:
                    self.start(child)
                if self.ready_check is not None:
                    self.ready_check.start()
                self.monitor()
            finally:
                self.stop_children()
                if self.ready_check is not None:
                    self.ready_check.close()
        logger.info("supervisor stopped")

    def start(self, child: Child) -> None:
        reader = writer = None
        if self.ready_check is not None and child.kind == Process.Kind.WORKER:
            reader, writer = self.context.Pipe(duplex=False)
        if child.process is not None:
            child.process.close()  # exited: its sentinel goes
        args = (str(child.kind.value), self.overrides, self.process_id, self.verbosity)
        try:
            try:
                child.process = self.warm.fork(args, reader)
            except WarmParentGone:
                child.process = self.context.Process(
                    target=child_main,
                    args=(*args, reader),
                    name=f"django-jobs-{child.kind}-{child.slot}",
                    daemon=False,
                )
                child.process.start()
        finally:
            if reader is not None:
                reader.close()  # the child has its own copy; ours would keep the pipe open
        if self.ready_check is not None and writer is not None:
            self.ready_check.attach(child.slot, writer)
        child.started_at = time.monotonic()

    def monitor(self) -> None:
        while not self.lifecycle.stopping.is_set():
            sentinels = {child.process.sentinel: child for child in self.children}
            ready = wait(list(sentinels), timeout=1.0)
            if self.lifecycle.stopping.is_set():
                return
            for sentinel in ready:
                child = sentinels[sentinel]
                try:
                    self.replace(child)
                except Exception:
                    # Recovery isolates each claim; whatever still escapes must not take
                    # the supervisor, and every other child, down with it. A child left
                    # unreplaced is tried again at the next round (its sentinel stays ready).
                    logger.exception("replacing the %s process failed; trying again", child.kind)
                    self.lifecycle.stopping.wait(RESTART_DELAY)
            self.lifecycle.wake.clear()

    def replace(self, child: Child) -> None:
        # Its sentinel can be ready a moment before the process is reaped: join first,
        # or the exit code reads None.
        child.process.join(5)
        if child.process.is_alive():
            # Its warm parent died under it: the exit went unreported, the process is not.
            logger.error(
                "%s process %s outlived its parent; killing it", child.kind, child.process.pid
            )
            child.process.kill()
            child.process.join(5)
        pid, code = child.process.pid, child.process.exitcode
        what = f"{child.kind} process {pid}"
        if code == RECYCLE_EXIT_CODE:
            # It stopped by itself with nothing left behind.
            logger.info("%s recycled; starting a fresh one", what)
            reason = f"{what} recycled"
        elif code == ABANDONED_EXIT_CODE:
            logger.warning(
                "%s exited, leaving a job it could not interrupt; recovering it and "
                "starting a fresh process",
                what,
            )
            reason = abandoned_reason(what)
        else:
            logger.error("%s exited unexpectedly (code %s); replacing it", what, code)
            reason = f"{what} exited with code {code}"
        self.recover_child(pid, reason)
        planned = code in (RECYCLE_EXIT_CODE, ABANDONED_EXIT_CODE)
        # A planned exit is replaced at once; a crash soon after starting waits a little.
        if not planned and time.monotonic() - child.started_at < RESTART_DELAY * 5:
            self.lifecycle.stopping.wait(RESTART_DELAY)
        if not self.lifecycle.stopping.is_set():
            child.restarts += 1
            self.start(child)

    def recover_child(self, pid: int | None, reason: str) -> None:
        """Settle the claims of a child that is gone, without waiting for its heartbeat to age."""
        if pid is None:
            return  # never started: it registered nothing
        rows = retry_until_done(
            self.db,
            "looking up a dead child",
            lambda: list(
                Process.objects.using(self.db)
                .filter(supervisor_id=self.process_id, pid=pid)
                .values_list("pk", flat=True)
            ),
            give_up=self.lifecycle.immediate.is_set,
            max_delay=self.conf.db_retry_max_delay,
        )
        for process_id in rows or []:
            self.settle(process_id, reason)

    def settle(self, process_id: int, reason: str) -> None:
        outcomes = retry_until_done(
            self.db,
            "recovering claims",
            lambda: deregister_process(self.db, process_id, reason),
            give_up=self.lifecycle.immediate.is_set,
            max_delay=self.conf.db_retry_max_delay,
        )
        if outcomes:
            logger.warning("recovered %d claim(s) of %s: %s", len(outcomes), reason, outcomes)

    def stop_children(self) -> None:
        """Ask every child to stop; force the ones that outlive the shutdown timeout.

        A second signal to the supervisor while it waits escalates to SIGQUIT.
        """
        alive = [c for c in self.children if c.process is not None and c.process.is_alive()]
        escalated = self.lifecycle.immediate.is_set()
        for child in alive:
            self.signal(child, signal.SIGQUIT if escalated else signal.SIGUSR1)
        # A child's jobs get the shutdown timeout, then the interrupt's grace, then
        # the writing of their outcomes.
        deadline = time.monotonic() + self.conf.shutdown_timeout + self.conf.interrupt_grace + 5.0
        while alive and time.monotonic() < deadline:
            if self.lifecycle.immediate.is_set() and not escalated:
                escalated = True
                for child in alive:
                    self.signal(child, signal.SIGQUIT)
            alive[0].process.join(0.1)
            alive = [c for c in alive if c.process.is_alive()]
        for child in alive:
            logger.error("%s process %s did not stop; killing it", child.kind, child.process.pid)
            child.process.kill()
            child.process.join(5)
        for child in self.children:
            if child.process is not None:
                what = f"{child.kind} process {child.process.pid}"
                abandoned = child.process.exitcode == ABANDONED_EXIT_CODE
                reason = abandoned_reason(what) if abandoned else f"{what} stopped"
                self.recover_child(child.process.pid, reason)

    @staticmethod
    def signal(child: Child, signum: int) -> None:
        try:
            os.kill(child.process.pid, signum)
        except ProcessLookupError:
            pass


def abandoned_reason(what: str) -> str:
    """The recorded error of a job its process exited without (exit code 76)."""
    return (
        f"{what} exited: the job could not be interrupted (past its timeout, cancelled, "
        "or at the shutdown deadline)"
    )


def prune_stale(conf: JobsSettings) -> None:
    try:
        prune_dead_processes(conf.database, conf.alive_threshold)
    except DB_ERRORS as exc:
        reset_connection(conf.database)
        logger.warning("could not prune dead processes at start: %s", exc)
    except Exception:
        # Each claim's recovery is isolated (claims.recover_process_claims); whatever is
        # left must not stop run_jobs from starting: the dispatcher prunes again.
        logger.exception("could not prune dead processes at start")
