"""The dispatcher loop: due scheduled jobs, dead processes, periodic maintenance."""

from __future__ import annotations

import time

from django_jobs.conf import JobsSettings
from django_jobs.core.maintenance import (
    clear_finished_jobs,
    prune_rate_limits,
    reconcile_blocked_keys,
)
from django_jobs.core.processes import prune_dead_processes
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.workflows import sweep_workflows
from django_jobs.runtime.lifecycle import Lifecycle, loop_until_stopped
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.dispatcher")


class Dispatcher:
    """Promotes due jobs, prunes dead processes, runs maintenance.

    ``alive``: process rows known to be alive whatever their heartbeat says: the
    dispatcher's own (or, in single-process mode, its worker's) and its
    supervisor's (a child notices within a second when its supervisor is gone).
    """

    def __init__(
        self,
        conf: JobsSettings,
        lifecycle: Lifecycle,
        *,
        once: bool = False,
        alive: tuple[int | None, ...] = (),
    ) -> None:
        self.conf = conf
        self.db = conf.database
        self.lifecycle = lifecycle
        self.once = once
        self.alive = alive
        self.next_maintenance = 0.0
        # No pruning before this (monotonic) time; None: not until the database answers.
        self.prune_after: float | None = 0.0

    def run(self) -> None:
        loop_until_stopped(
            self.db,
            self.lifecycle,
            self.step,
            on_outage=self.suspend_pruning,
            max_delay=self.conf.db_retry_max_delay,
            log=logger,
        )

    def step(self) -> float:
        self.tick()
        if self.prune_after is None:
            self.prune_after = time.monotonic() + self.grace()
            logger.info(
                "database reachable again; pruning dead processes resumes in %.1fs",
                self.grace(),
            )
        return self.conf.dispatcher_interval

    def suspend_pruning(self) -> None:
        # While the database was away nobody could heartbeat: a stale heartbeat
        # then says nothing about death. Once it is back, give every live
        # process time to heartbeat before pruning anyone.
        self.prune_after = None

    def grace(self) -> float:
        """Long enough for every live process's heartbeat thread to get through once."""
        return 2 * self.conf.heartbeat_interval + 1.0

    def tick(self) -> None:
        promoted = 0
        while not self.lifecycle.stopping.is_set():
            moved = promote_due_jobs(self.db, self.conf.batch_size)
            promoted += moved
            if moved < self.conf.batch_size:
                break
        if promoted:
            logger.debug("promoted %d scheduled job(s)", promoted)
        if self.prune_after is not None and time.monotonic() >= self.prune_after:
            alive = [pk for pk in self.alive if pk is not None]
            prune_dead_processes(self.db, self.conf.alive_threshold, exclude=alive)
        now = time.monotonic()
        if now >= self.next_maintenance:
            self.next_maintenance = now + self.conf.maintenance_interval
            unblocked = reconcile_blocked_keys(self.db)
            if unblocked:
                logger.warning("maintenance promoted %d blocked job(s)", unblocked)
            if self.conf.clear_finished_jobs_after is not None:
                clear_finished_jobs(self.db, self.conf.clear_finished_jobs_after)
            prune_rate_limits(self.db)
            # What a lost follow-up left: ended jobs whose dependents were not told, and
            # workflows ended with jobs still to cancel (core/dependencies.py).
            repaired = sweep_workflows(self.db)
            if repaired:
                logger.warning("maintenance settled %d workflow step(s) left by a crash", repaired)
