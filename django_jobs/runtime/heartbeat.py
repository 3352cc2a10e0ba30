"""A thread that keeps this process's row alive, and notices if it was pruned."""

from __future__ import annotations

import threading

from django.db import close_old_connections

from django_jobs.core.processes import heartbeat
from django_jobs.db.retry import DB_ERRORS, reset_connection
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.runner")


class Heartbeat(threading.Thread):
    def __init__(self, db: str, process_id: int, interval: float, lifecycle: Lifecycle) -> None:
        super().__init__(name="django-jobs-heartbeat", daemon=True)
        self.db = db
        self.process_id = process_id
        self.interval = interval
        self.lifecycle = lifecycle
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            try:
                alive = heartbeat(self.db, self.process_id)
            except DB_ERRORS as exc:
                reset_connection(self.db)
                logger.warning("heartbeat failed, database unavailable: %s", exc)
                continue
            except Exception:
                # Never let the thread die: a process without heartbeats is pruned
                # as dead while it still runs jobs.
                logger.exception("heartbeat failed")
                reset_connection(self.db)
                continue
            if not alive and self.halt.is_set():
                # Stopped while this beat was on its way: the row is gone because this
                # process deregistered itself (``stop()`` comes first), not because it
                # was pruned. Reporting a prune here made a graceful stop exit 1.
                break
            if not alive:
                # Pruned as dead (a long pause, a clock jump): our claims were
                # recovered by someone else. Stop; the supervisor starts a fresh one.
                logger.error("process row %s was pruned; stopping", self.process_id)
                self.lifecycle.pruned = True
                self.lifecycle.request_stop("pruned as dead")
                break
        close_old_connections()

    def stop(self) -> None:
        self.halt.set()
