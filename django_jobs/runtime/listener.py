"""LISTEN for ready jobs and cancel requests on PostgreSQL, so a worker acts at once
instead of at its next poll.

Whatever makes a job ready (enqueue, promotion, retry, hand-back) has
``django_jobs.notify`` NOTIFY :data:`CHANNEL` once its transaction has
committed, and never if it rolled back. The payload is the JSON list of the
queues made ready (``[]``: any queue). A cancel request for a claimed or
running job is sent on :data:`CANCEL_CHANNEL` the same way, with the JSON list
of the job ids (``[]``: some jobs, too many to name).

One daemon thread per worker process holds its own connection (never one of
Django's: LISTEN needs a session of its own, idle between notifications), sets
the worker's wake event for each notification about a queue it serves, and
hands cancelled job ids to the process's watchdog (``watchdog.cancel_notified``),
which checks the database at once if it runs one of them. Polling goes on
underneath for both: if the connection is lost, the worker simply keeps polling
while this thread reconnects with a backoff, logging once per outage.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from django_jobs.conf import JobsSettings
from django_jobs.core.queues import QueueSelector
from django_jobs.db import features
from django_jobs.db.notify import CANCEL_CHANNEL, CHANNEL, first_line, own_connection_params
from django_jobs.db.retry import Backoff
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.watchdog import cancel_notified
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.listener")

APPLICATION_NAME = "django-jobs listener"
# How often the thread looks up from the socket to see whether it should stop.
STOP_CHECK_INTERVAL = 0.5
# A connection that stayed up this long ends an outage: the next loss starts the
# backoff from its first step again (a connection that drops at once does not).
STABLE_AFTER = 30.0

OnCancel = Callable[[Collection[int] | None], None]


def listen_alias(conf: JobsSettings) -> str | None:
    """The database alias to LISTEN through, or None when workers only poll."""
    if conf.listen_notify is False or not features(conf.database).can_listen:
        return None
    alias = conf.database if conf.listen_notify is True else conf.listen_notify
    return alias if features(alias).can_listen else None


def start_listener(
    conf: JobsSettings,
    selector: QueueSelector,
    lifecycle: Lifecycle,
    *,
    on_cancel: OnCancel = cancel_notified,
) -> Listener | None:
    """Start listening for ``selector``'s queues (and cancel requests, for ``on_cancel``:
    by default this process's watchdogs) if the database and settings allow it."""
    alias = listen_alias(conf)
    if alias is None:
        if conf.listen_notify is False and features(conf.database).has_listen_notify:
            logger.info(
                "not listening for ready jobs (DJANGO_JOBS['listen_notify'] is False): "
                "polling every %ss (cancel requests every %ss)",
                conf.polling_interval,
                conf.cancel_poll_interval,
            )
        return None
    listener = Listener(
        connection_params(alias),
        selector,
        lifecycle,
        polling_interval=conf.polling_interval,
        cancel_poll_interval=conf.cancel_poll_interval,
        max_delay=conf.db_retry_max_delay,
        on_cancel=on_cancel,
    )
    listener.start()
    return listener


def connection_params(alias: str) -> dict[str, Any]:
    """psycopg keyword arguments from Django's settings for ``alias``, for our own connection."""
    return own_connection_params(alias, f"{APPLICATION_NAME} pid={os.getpid()}")


class Listener:
    def __init__(
        self,
        params: dict[str, Any],
        selector: QueueSelector,
        lifecycle: Lifecycle,
        *,
        polling_interval: float,
        max_delay: float,
        on_cancel: OnCancel = cancel_notified,
        cancel_poll_interval: float = JobsSettings.cancel_poll_interval,
    ) -> None:
        self.params = params
        self.selector = selector
        self.lifecycle = lifecycle
        self.on_cancel = on_cancel
        self.polling_interval = polling_interval
        # Only for the outage's log line: the watchdog polls at this interval meanwhile.
        self.cancel_poll_interval = cancel_poll_interval
        self.backoff = Backoff(max_delay)
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, name="django-jobs-listener", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(STOP_CHECK_INTERVAL * 2)

    def stopped(self) -> bool:
        return self.halt.is_set() or self.lifecycle.stopping.is_set()

    def run(self) -> None:
        import psycopg

        outage_since: float | None = None
        while not self.stopped():
            connection = None
            try:
                connection = psycopg.connect(**self.params)
                # CHANNEL last: a session whose last statement is its LISTEN listens on both.
                connection.execute(f"LISTEN {CANCEL_CHANNEL}")
                connection.execute(f"LISTEN {CHANNEL}")
                if outage_since is None:
                    logger.info(
                        "listening for ready jobs (channel %s) and cancel requests (channel %s)",
                        CHANNEL,
                        CANCEL_CHANNEL,
                    )
                else:
                    logger.info(
                        "listening for ready jobs again, after %.1fs of polling only",
                        time.monotonic() - outage_since,
                    )
                    outage_since = None
                # A job made ready, or a running job cancelled, before LISTEN took effect
                # sent its notification to nobody: one claim and one check now find
                # them (everything later is notified).
                self.lifecycle.jobs_may_be_ready()
                self.on_cancel(None)
                self.receive(connection)
            except Exception as exc:  # psycopg.Error, or anything: never die silently
                if self.stopped():
                    break
                if outage_since is None:
                    outage_since = time.monotonic()
                    logger.warning(
                        "not listening for ready jobs (%s: %s); polling every %ss (cancel "
                        "requests every %ss) and reconnecting",
                        type(exc).__name__,
                        first_line(exc),
                        self.polling_interval,
                        self.cancel_poll_interval,
                    )
                else:
                    logger.debug("still not listening for ready jobs: %s", first_line(exc))
                self.halt.wait(self.backoff.next())
            finally:
                if connection is not None:
                    connection.close()

    def receive(self, connection: Any) -> None:
        """Wake the worker for each notification about one of its queues, and pass on
        each about cancelled jobs, until stopped."""
        connected_at = time.monotonic()
        while not self.stopped():
            for notify in connection.notifies(timeout=STOP_CHECK_INTERVAL):
                if notify.channel == CANCEL_CHANNEL:
                    self.on_cancel(cancelled_ids(notify.payload))
                elif self.wanted(notify.payload):
                    self.lifecycle.jobs_may_be_ready()
            if time.monotonic() - connected_at > STABLE_AFTER:
                self.backoff.reset()

    def wanted(self, payload: str) -> bool:
        """True unless the payload names only queues this worker does not serve."""
        try:
            queues = json.loads(payload)
        except ValueError:
            return True
        if not isinstance(queues, list) or not queues:
            return True
        return any(not isinstance(q, str) or self.selector.matches(q) for q in queues)


def cancelled_ids(payload: str) -> list[int] | None:
    """The job ids a cancel notification names, or None (look at every job) for ``[]``
    or anything else than a list of integers: not ours to judge, so check."""
    try:
        ids = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(ids, list) or not ids:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return ids
