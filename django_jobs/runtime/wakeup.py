"""Wake a host's idle workers when a job becomes ready, on databases without LISTEN.

MariaDB/MySQL and SQLite have no LISTEN/NOTIFY, so a worker learns of a new job
only by polling. Each worker process polling fast enough to start a job within
a few milliseconds would cost each of them dozens of claims a second while idle
(a claim on MariaDB is three statements even when it finds nothing), and it
multiplies with the processes. So one thread of the supervisor (:class:`ReadyCheck`)
asks the database one cheap question every ``ready_check_interval`` (25 ms):
the highest id in the ready table and how many rows it holds (counted up to
:data:`COUNT_CAP`). Either going up means a job became ready since the last look
(an enqueue raises the highest id; a promoted, retried, handed-back or unblocked
job, whose id is older, raises the count). The check then writes one byte down a
pipe to each worker process (:class:`WakeFeed`), which sets its wake event and
claims at once. One query per host replaces the workers' fast polls: about 40
queries a second for the whole host, however many processes and threads it runs.

The workers keep polling by themselves, every ``fallback_polling_interval``
(2 s) instead of ``polling_interval``, for what the check does not see: a paused
queue resumed, a slot freed under a queue-wide cap by another host, two rows
whose commits crossed (an older id committed after a newer one was claimed), a
claim and a new ready row in one interval. While the feed is not live (the check
failed, the database is away, the supervisor's thread died or hung, the pipe is
closed) a worker polls every ``polling_interval`` as before: the check sends a
keep-alive byte every :data:`KEEPALIVE` seconds after a successful query, and a
feed that hears nothing for :data:`LIVE_FOR` seconds wakes its worker, which
then sleeps the short interval. A worker's crash closes its end of the pipe and
nothing else: the supervisor's writes to it fail quietly.

The check does not filter by queue: a job made ready in a queue no worker of
this host serves wakes them anyway, one claim each, at most one per interval.
Every host runs its own check, so N hosts add N times its queries. Why not
server-side waiting: MariaDB has no statement that blocks until a table changes
without a writer's help (``GET_LOCK`` or ``KILL QUERY`` would need every
enqueuing process, web processes included, to take part).
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection

from django.db import connections

from django_jobs.conf import JobsSettings
from django_jobs.db import features
from django_jobs.db.notify import first_line
from django_jobs.db.retry import DB_ERRORS, Backoff, reset_connection
from django_jobs.models import ReadyExecution
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.wakeup")

# Bytes written down a worker's pipe.
WAKE = b"w"  # a job may be ready: claim now
ALIVE = b"k"  # the check works: keep polling slowly
DOWN = b"d"  # the check failed: poll at polling_interval until it works again
# Seconds between two keep-alive bytes while the check works and nothing is ready.
KEEPALIVE = 0.25
# Seconds a feed stays live after its last byte.
LIVE_FOR = 1.0
# The count is bounded, so the check costs the same with a backlog of a million rows;
# past it only the highest id tells (with that many ready rows, workers are busy anyway).
COUNT_CAP = 1000


def ready_check_applies(conf: JobsSettings) -> bool:
    """True where the supervisor checks for ready jobs: not on PostgreSQL, which LISTENs
    (with ``listen_notify`` off it polls as before), and unless the setting is None."""
    return conf.ready_check_interval is not None and not features(conf.database).has_listen_notify


def check_statement(db: str) -> str:
    connection = connections[db]
    table = connection.ops.quote_name(ReadyExecution._meta.db_table)
    column = connection.ops.quote_name(ReadyExecution._meta.get_field("job").column or "job_id")
    return (
        f"SELECT (SELECT MAX({column}) FROM {table}), "
        f"(SELECT COUNT(*) FROM (SELECT {column} FROM {table} LIMIT {COUNT_CAP}) AS ready_)"
    )


class ReadyCheck:
    """The supervisor's thread: one query per interval, a byte to each worker's pipe."""

    def __init__(self, conf: JobsSettings, lifecycle: Lifecycle) -> None:
        assert conf.ready_check_interval is not None
        self.db = conf.database
        self.interval = conf.ready_check_interval
        self.lifecycle = lifecycle
        self.backoff = Backoff(conf.db_retry_max_delay)
        self.lock = threading.Lock()
        self.feeds: dict[int, Connection] = {}  # worker slot -> write end of its pipe
        self.last: tuple[int, int] | None = None
        self.checks = 0  # queries run (tests read it)
        self.thread = threading.Thread(target=self.run, name="django-jobs-ready-check", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def attach(self, slot: int, writer: Connection) -> None:
        """Feed the worker of ``slot`` through ``writer`` (replacing a dead one's pipe)."""
        os.set_blocking(writer.fileno(), False)
        with self.lock:
            previous = self.feeds.pop(slot, None)
            self.feeds[slot] = writer
        if previous is not None:
            previous.close()
        # Live from the start: the worker claims when it starts, and the next check
        # follows within an interval.
        self.write(ALIVE, [writer])

    def close(self) -> None:
        with self.lock:
            feeds, self.feeds = list(self.feeds.values()), {}
        for writer in feeds:
            writer.close()

    def write(self, byte: bytes, writers: list[Connection] | None = None) -> None:
        if writers is None:
            with self.lock:
                writers = list(self.feeds.values())
        for writer in writers:
            try:
                os.write(writer.fileno(), byte)
            except (BlockingIOError, BrokenPipeError, OSError, ValueError):
                # Full (the worker is not reading: it hangs, and will be noticed by other
                # means), or closed (it died; the supervisor replaces its pipe).
                pass

    def run(self) -> None:
        outage_since: float | None = None
        sql = check_statement(self.db)
        last_sent = 0.0
        while not self.lifecycle.stopping.is_set():
            try:
                with connections[self.db].cursor() as cursor:
                    cursor.execute(sql)
                    highest, count = cursor.fetchone()
                self.checks += 1
            except Exception as exc:  # an outage, or anything: never die, never take down
                reset_connection(self.db)
                self.write(DOWN)
                delay = self.backoff.next()
                if outage_since is None:
                    outage_since = time.monotonic()
                    level = logger.warning if isinstance(exc, DB_ERRORS) else logger.error
                    level(
                        "not checking for ready jobs (%s: %s); workers poll every "
                        "polling_interval meanwhile; retrying",
                        type(exc).__name__,
                        first_line(exc),
                    )
                self.last = None
                self.lifecycle.stopping.wait(delay)
                continue
            if outage_since is not None:
                logger.info(
                    "checking for ready jobs again, after %.1fs", time.monotonic() - outage_since
                )
                outage_since = None
            self.backoff.reset()
            now = time.monotonic()
            current = (highest or 0, count or 0)
            if self.changed(current):
                self.write(WAKE)
                last_sent = now
            elif now - last_sent >= KEEPALIVE:
                self.write(ALIVE)
                last_sent = now
            self.lifecycle.stopping.wait(self.interval)
        self.write(DOWN)
        connections[self.db].close()

    def changed(self, current: tuple[int, int]) -> bool:
        """True if a job may have become ready since the last check (or this is the first)."""
        last, self.last = self.last, current
        if last is None:
            return True
        return current[0] > last[0] or current[1] > last[1]


class WakeFeed:
    """A worker's thread reading its pipe from the supervisor's :class:`ReadyCheck`."""

    def __init__(self, reader: Connection, lifecycle: Lifecycle) -> None:
        self.reader = reader
        self.lifecycle = lifecycle
        self.live_until = 0.0
        self.thread = threading.Thread(target=self.run, name="django-jobs-wake-feed", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def live(self) -> bool:
        return time.monotonic() < self.live_until

    def run(self) -> None:
        fd = self.reader.fileno()
        try:
            while not self.lifecycle.stopping.is_set():
                if not self.reader.poll(LIVE_FOR):
                    self.lost()
                    continue
                data = os.read(fd, 256)
                if not data:
                    break  # the supervisor is gone
                if data.endswith(DOWN):
                    self.lost()
                    continue
                self.live_until = time.monotonic() + LIVE_FOR
                if WAKE in data:
                    self.lifecycle.jobs_may_be_ready()
        except Exception:  # a closed pipe, or anything: the worker polls by itself
            logger.debug("the wake feed stopped", exc_info=True)
        self.lost()

    def lost(self) -> None:
        """No word from the check: wake the worker once, which then sleeps the short
        interval (a worker asleep for the fallback interval would not see this)."""
        if self.live_until:
            self.live_until = 0.0
            self.lifecycle.jobs_may_be_ready()
