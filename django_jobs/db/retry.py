"""Surviving a database that goes away: log, back off, reconnect, carry on."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, connections

from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.runner")

DB_ERRORS = (OperationalError, InterfaceError)


def reset_connection(db: str) -> None:
    """Drop this thread's connection so the next query opens a fresh one."""
    try:
        connections[db].close()
    except DB_ERRORS:
        pass


class Backoff:
    def __init__(self, max_delay: float, first: float = 0.25) -> None:
        self.first = first
        self.max_delay = max_delay
        self.delay = 0.0

    def next(self) -> float:
        self.delay = min(self.max_delay, self.delay * 2 if self.delay else self.first)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


def retry_until_done[T](
    db: str,
    what: str,
    action: Callable[[], T],
    *,
    give_up: Callable[[], bool],
    max_delay: float,
) -> T | None:
    """Run ``action`` until it gets through to the database, or ``give_up()`` says stop.

    Used for writes that must not be lost, like the outcome of a job that has
    already run: dropping it would make recovery run the job a second time.
    """
    backoff = Backoff(max_delay)
    while True:
        try:
            return action()
        except DB_ERRORS as exc:
            reset_connection(db)
            if give_up():
                logger.error("database unavailable; giving up on %s: %s", what, exc)
                return None
            delay = backoff.next()
            logger.warning(
                "database unavailable during %s (%s); retrying in %.2fs", what, exc, delay
            )
            time.sleep(delay)
