"""The dispatcher loop: due scheduled jobs, dead processes, periodic maintenance.

An idle dispatcher is part of every host's idle queries (docs/running.md, "Waking
idle workers on MariaDB/MySQL and SQLite": a budget of 50 a second for a 2 x 8
host on MariaDB), so its rounds are cheap when there is nothing to do: one plain
read says whether any scheduled job is due before a transaction locks them (on
MariaDB that transaction is four statements finding nothing), and dead processes
are looked for every ``alive_threshold / 30`` seconds, not every round: a process
is declared dead ``alive_threshold`` seconds after its last heartbeat anyway, and
a supervisor's child is recovered by its supervisor at once.
"""

from __future__ import annotations

import time

from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core.maintenance import (
    clear_finished_jobs,
    prune_fair_turns,
    prune_rate_limits,
    reconcile_blocked_keys,
)
from django_jobs.core.processes import prune_dead_processes
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.workflows import sweep_workflows
from django_jobs.models import ScheduledExecution
from django_jobs.runtime.lifecycle import Lifecycle, loop_until_stopped
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.dispatcher")

# Looks for dead processes per alive_threshold: a dead one is pruned at most 1/30 of
# the threshold later than its heartbeat allows (10 s of the default 300 s).
PRUNES_PER_THRESHOLD = 30


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
        self.next_prune = 0.0
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

    def any_due(self) -> bool:
        """One read outside any transaction: is a scheduled job due?"""
        return (
            ScheduledExecution.objects.using(self.db)
            .filter(scheduled_at__lte=timezone.now())
            .exists()
        )

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
        while self.any_due() and not self.lifecycle.stopping.is_set():
            moved = promote_due_jobs(self.db, self.conf.batch_size)
            promoted += moved
            if moved < self.conf.batch_size:
                break
        if promoted:
            logger.debug("promoted %d scheduled job(s)", promoted)
        now = time.monotonic()
        if self.prune_after is not None and now >= max(self.prune_after, self.next_prune):
            self.next_prune = now + self.conf.alive_threshold / PRUNES_PER_THRESHOLD
            alive = [pk for pk in self.alive if pk is not None]
            prune_dead_processes(self.db, self.conf.alive_threshold, exclude=alive)
        if now >= self.next_maintenance:
            self.next_maintenance = now + self.conf.maintenance_interval
            unblocked = reconcile_blocked_keys(self.db)
            if unblocked:
                logger.warning("maintenance promoted %d blocked job(s)", unblocked)
            if self.conf.clear_finished_jobs_after is not None:
                clear_finished_jobs(self.db, self.conf.clear_finished_jobs_after)
            prune_rate_limits(self.db)
            prune_fair_turns(self.db)
            # What a lost follow-up left: ended jobs whose dependents were not told, and
            # workflows ended with jobs still to cancel (core/dependencies.py).
            repaired = sweep_workflows(self.db)
            if repaired:
                logger.warning("maintenance settled %d workflow step(s) left by a crash", repaired)
