"""The dispatcher loop: due scheduled jobs, dead processes, periodic maintenance."""

from __future__ import annotations

import logging
import time

from ..conf import JobsSettings
from ..maintenance import clear_finished_jobs, reconcile_blocked_keys
from ..processes import prune_dead_processes
from ..scheduling import promote_due_jobs
from .db_retry import DB_ERRORS, Backoff, reset_connection
from .lifecycle import Lifecycle

logger = logging.getLogger("django_jobs.dispatcher")


class Dispatcher:
    def __init__(self, conf: JobsSettings, lifecycle: Lifecycle, *, once: bool = False) -> None:
        self.conf = conf
        self.db = conf.database
        self.lifecycle = lifecycle
        self.once = once
        self.next_maintenance = 0.0

    def run(self) -> None:
        backoff = Backoff(self.conf.db_retry_max_delay)
        while not self.lifecycle.stopping.is_set():
            try:
                self.tick()
                backoff.reset()
            except DB_ERRORS as exc:
                reset_connection(self.db)
                delay = backoff.next()
                logger.warning("database unavailable (%s); retrying in %.2fs", exc, delay)
                self.lifecycle.sleep(delay)
                continue
            self.lifecycle.sleep(self.conf.dispatcher_interval)

    def tick(self) -> None:
        promoted = 0
        while not self.lifecycle.stopping.is_set():
            moved = promote_due_jobs(self.db, self.conf.batch_size)
            promoted += moved
            if moved < self.conf.batch_size:
                break
        if promoted:
            logger.debug("promoted %d scheduled job(s)", promoted)
        prune_dead_processes(self.db, self.conf.alive_threshold)
        now = time.monotonic()
        if now >= self.next_maintenance:
            self.next_maintenance = now + self.conf.maintenance_interval
            unblocked = reconcile_blocked_keys(self.db)
            if unblocked:
                logger.warning("maintenance promoted %d blocked job(s)", unblocked)
            if self.conf.clear_finished_jobs_after is not None:
                clear_finished_jobs(self.db, self.conf.clear_finished_jobs_after)
