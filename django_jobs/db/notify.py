"""NOTIFY idle workers that jobs became ready, and busy ones that a job they run was
cancelled, from outside the transaction that did it.

PostgreSQL serialises the commits of every transaction that sent a
notification: ``PreCommit_Notify`` takes one lock for the whole server and
holds it until the commit's WAL flush is over. A NOTIFY inside the enqueuing
transaction (migration 0004's trigger did that) therefore made concurrent
enqueues commit one after another. Here the enqueuing transaction notifies
nobody; each process has one notifier per database alias instead:

- Code that makes jobs ready (``core.ready.make_ready``, ``db/postgresql/insert.py``'s
  one-statement enqueue) calls :func:`jobs_ready`, which registers
  ``on_commit``: the queue names reach the notifier only once the transaction
  has committed, and never if it rolls back. In autocommit that is at once.
  The one exception: a single enqueue by a process quiet for a while notifies
  in its own statement (:func:`inline_payload`), which the commit of an
  occasional enqueue can afford and which starts its job a round trip sooner.
- A daemon thread (started by the first such commit of the process, so never
  at import and never before a web server forks) holds a psycopg connection of
  its own, never one of Django's, to the alias the jobs were written through,
  and sends one ``pg_notify`` per round for everything handed over since the
  last, rounds at least :data:`MIN_INTERVAL` apart: under load, many enqueues
  share one notification. (Not ``listen_notify``'s alias: that one exists to
  bypass PgBouncer for LISTEN, and a NOTIFY needs no session of its own.)
- That statement is its own transaction and sets ``synchronous_commit = off``
  for itself alone (``set_config(..., true)``: safe behind PgBouncer in
  transaction pooling, where a session setting would leak to other clients). A
  notification is not data: its commit need not wait for the disk, so the
  server-wide notify lock is held for microseconds, not for a WAL flush.

A cancel request for a claimed or running job (``cancellation.cancel_job``)
goes the same way: :func:`cancel_requested` registers ``on_commit``, the
notifier sends the job ids on :data:`CANCEL_CHANNEL` (in the same statement as
the round's ready queues, if any), and the worker running the job checks the
database at once instead of at its next poll (``runtime.watchdog``). The request
itself is the committed column: a notification lost on the way costs that
worker its poll interval, nothing more.

Sending never blocks an enqueue and never fails one: the enqueuer only adds
queue names to a set under a lock. A lost connection is logged once and retried
with a growing delay; queues not yet notified are kept and sent once it is back
(workers poll meanwhile). The connection is closed after :data:`IDLE_CLOSE`
seconds with nothing to send, so a process that enqueues now and then holds no
connection in between. At interpreter exit the notifier gets up to
:data:`FLUSH_AT_EXIT` seconds to send what it holds; a process that dies
without running ``atexit`` handlers (``os._exit``, SIGKILL) can lose the last
notification, which delays a worker until its next poll, nothing more.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from typing import Any

from django.conf import settings
from django.db import connections
from django.db.transaction import TransactionManagementError

from django_jobs.conf import JobsSettings
from django_jobs.db import features
from django_jobs.db.retry import Backoff
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.notify")

CHANNEL = "django_jobs_ready"  # what workers LISTEN on (runtime.listener)
CANCEL_CHANNEL = "django_jobs_cancel"  # ... and this, for cancel requests of running jobs
APPLICATION_NAME = "django-jobs notifier"
# pg_notify refuses payloads of 8000 bytes or more; a list too long to send is sent
# as "[]", which every worker takes as "any queue" (or "look at every job you run").
MAX_PAYLOAD = 7900
# One statement, one transaction: the commit does not wait for the WAL flush.
NOTIFY_SQL = "SELECT set_config('synchronous_commit', 'off', true)"
# Seconds between two notifications of one process at least: what is handed over
# meanwhile goes out with the next one, and the first after a quiet spell at once. Each
# notification wakes every listening worker process, and each takes the server's notify
# lock, which every committing transaction that notifies queues for: 8 processes
# enqueuing at once kept 0.68-0.73 of their rate without notifications at 5 ms, 0.80-0.97
# at 20 ms (bench/throughput.py --phases concurrent, alternated runs).
MIN_INTERVAL = 0.02
# Seconds since a process last notified (or handed over) ready queues past which its next
# single enqueue notifies in its own statement (:func:`inline_payload`).
INLINE_AFTER = MIN_INTERVAL
# Seconds without anything to send after which the connection is closed.
IDLE_CLOSE = 2.0
# Seconds the interpreter's exit waits for pending notifications (none in an outage).
FLUSH_AT_EXIT = 1.0
# For our own connections (the notifier's, the listener's), unless the database settings
# choose otherwise: notice a server or network that went away without a word within
# about a minute, and never hang on connecting.
DEFAULT_PARAMS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def jobs_ready(db: str, queue_names: Iterable[str]) -> None:
    """Notify workers of ``queue_names`` once the current transaction on ``db`` commits.

    Read on every enqueue, so cheap: nothing happens off PostgreSQL or when
    ``DJANGO_JOBS["listen_notify"]`` is False. Under manual transaction
    management (autocommit off outside ``atomic()``) the commit cannot be
    awaited, so nothing is notified and workers find the jobs by polling.
    """
    if not enabled(db):
        return
    queues = frozenset(queue_names)
    if not queues:
        return
    try:
        connections[db].on_commit(partial(send, db, queues), robust=True)
    except TransactionManagementError:
        pass


def cancel_requested(db: str, job_id: int) -> None:
    """Tell the worker running job ``job_id`` of its cancel request once the current
    transaction on ``db`` commits (the conditions of :func:`jobs_ready`)."""
    if not enabled(db):
        return
    try:
        connections[db].on_commit(partial(send_cancels, db, (job_id,)), robust=True)
    except TransactionManagementError:
        pass


def inline_payload(db: str, queues: Iterable[str]) -> str | None:
    """The payload for the enqueuing statement to ``pg_notify`` itself, or None: hand the
    queues to the notifier instead (:func:`jobs_ready`).

    A job enqueued by a process that has been quiet for :data:`INLINE_AFTER` seconds
    (nothing notified or handed over, nothing pending) is notified by its own
    statement: the notification leaves with the commit, a round trip sooner than the
    notifier's own transaction could send it, and that round trip was the largest
    part of the time from an idle enqueue to its start (bench/throughput.py
    --phases latency: the notifier's NOTIFY took 0.8-1 ms of 3.3 ms, its connection
    idle since the last job). The price is the one this module's docstring names:
    the commit holds the server's notify lock through its WAL flush. A quiet
    process pays it once per :data:`INLINE_AFTER` at most; a busy one never (its
    enqueues follow each other closer than that, so they all go through the
    notifier, coalesced). Like any NOTIFY it is transactional: sent at commit,
    never on rollback, whatever the transaction around it.
    """
    if not enabled(db):
        return None
    return payload(queues) if notifier_for(db).quiet() else None


# True while the test toolkit runs jobs in a test's own process (django_jobs.testing): no
# worker listens there, and a notification would open the notifier's connection of its
# own in the middle of a test (on the test database, which the test run then drops).
_silenced: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "django_jobs_notify_silenced", default=False
)


@contextmanager
def silenced() -> Iterator[None]:
    """Notify nobody from this context while inside (:func:`jobs_ready`,
    :func:`cancel_requested` and :func:`inline_payload` do nothing)."""
    token = _silenced.set(True)
    try:
        yield
    finally:
        _silenced.reset(token)


def enabled(db: str) -> bool:
    if _silenced.get():
        return False
    raw = getattr(settings, "DJANGO_JOBS", None) or {}
    return raw.get("listen_notify", True) is not False and supported(db)


@cache
def supported(db: str) -> bool:
    """PostgreSQL through psycopg 3 (what the listener needs too)."""
    return features(db).can_listen


def payload(items: Iterable[str] | Iterable[int]) -> str:
    """The JSON list of queue names (or job ids), or ``[]`` (any queue, any job) when
    it would be too long."""
    text = json.dumps(sorted(items), separators=(",", ":"))
    return "[]" if len(text.encode()) > MAX_PAYLOAD else text


def notify_statement(queues: set[str], cancels: set[int]) -> tuple[str, list[str]]:
    """One statement (one transaction) notifying both channels of a round as needed."""
    sql, params = NOTIFY_SQL, []
    for channel, items in ((CHANNEL, queues), (CANCEL_CHANNEL, cancels)):
        if items:
            sql += ", pg_notify(%s, %s)"
            params += [channel, payload(items)]
    return sql, params


# --- one notifier per database alias and process -----------------------------------------

_registry_lock = threading.Lock()
_notifiers: dict[str, Notifier] = {}
_atexit_registered = False


def send(db: str, queues: Iterable[str]) -> None:
    """Hand ``queues`` (committed) to this process's notifier for ``db``; never blocks."""
    try:
        notifier_for(db).send(queues)
    except Exception:  # never fail the enqueue whose commit called us
        logger.exception("could not hand ready queues to the notifier")


def send_cancels(db: str, job_ids: Iterable[int]) -> None:
    """Hand the ids of jobs whose cancel request committed to the notifier; never blocks."""
    try:
        notifier_for(db).send(cancels=job_ids)
    except Exception:  # never fail the cancel whose commit called us
        logger.exception("could not hand cancel requests to the notifier")


def notifier_for(db: str) -> Notifier:
    notifier = _notifiers.get(db)
    if notifier is None:
        with _registry_lock:
            notifier = _notifiers.get(db)
            if notifier is None:
                notifier = _notifiers[db] = Notifier(partial(connection_params, db))
    return notifier


def install(db: str, notifier: Notifier) -> Notifier | None:
    """Use ``notifier`` for ``db`` from now on (tests); returns the one it replaces."""
    with _registry_lock:
        previous = _notifiers.get(db)
        _notifiers[db] = notifier
    return previous


def stop_all(timeout: float = 5.0) -> None:
    """Stop every notifier of this process and close their connections (tests)."""
    with _registry_lock:
        notifiers = list(_notifiers.values())
        _notifiers.clear()
    for notifier in notifiers:
        notifier.stop(timeout)


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads, and maybe a copy of a held lock:
    it starts from nothing, and its first commit starts a notifier of its own."""
    global _registry_lock, _notifiers
    _registry_lock = threading.Lock()
    _notifiers = {}


os.register_at_fork(after_in_child=_forget_after_fork)


def _flush_at_exit() -> None:
    deadline = time.monotonic() + FLUSH_AT_EXIT
    for notifier in list(_notifiers.values()):
        notifier.flush(max(0.0, deadline - time.monotonic()))


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_flush_at_exit)


def connection_params(db: str) -> dict[str, Any]:
    """psycopg arguments for the notifier's connection to ``db``."""
    return own_connection_params(db, f"{APPLICATION_NAME} pid={os.getpid()}")


def own_connection_params(alias: str, application_name: str) -> dict[str, Any]:
    """psycopg keyword arguments from Django's settings for ``alias``, for a connection of
    our own (never one of Django's): autocommit, named, keepalives and connect timeout."""
    params = connections[alias].get_connection_params()
    params.update(autocommit=True, application_name=application_name)
    for key, value in DEFAULT_PARAMS.items():
        params.setdefault(key, value)
    return params


def first_line(exc: BaseException) -> str:
    """libpq's messages run over several lines; the first says what happened."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class Notifier:
    """A thread that sends the queues (and cancelled job ids) handed to it, coalesced,
    one statement per round."""

    def __init__(
        self, params: Any, *, max_delay: float | None = None, idle_close: float = IDLE_CLOSE
    ) -> None:
        self.params = params  # a callable returning psycopg.connect's keyword arguments
        self.max_delay = max_delay  # of the backoff; default: db_retry_max_delay
        self.idle_close = idle_close
        # Reentrant: an enqueue from a signal handler that interrupted a hand-over in the
        # same thread must not deadlock on it.
        self.lock = threading.RLock()
        self.wanted = threading.Condition(self.lock)  # something to send, or stop
        self.settled = threading.Condition(self.lock)  # a round is over
        self.pending: set[str] = set()
        self.pending_cancels: set[int] = set()
        self.busy = False
        self.in_outage = False
        self.halted = False
        self.halt = threading.Event()
        self.thread: threading.Thread | None = None
        self.connect_function: Any = None  # psycopg.connect, imported when the thread starts
        self.sent = 0  # notifications sent (tests and the bench read it)
        # Monotonic time of the last ready queues handed over or notified by an enqueue.
        self.last_ready = -math.inf

    # -- called by enqueuers (any thread) --

    def quiet(self) -> bool:
        """True if nothing was handed over or notified for :data:`INLINE_AFTER` seconds and
        nothing waits to be sent (:func:`inline_payload`); either way, the quiet spell is
        over. Unlocked: two threads both finding it quiet notify twice, which is harmless."""
        now = time.monotonic()
        quiet = (
            now - self.last_ready > INLINE_AFTER
            and not self.pending
            and not self.pending_cancels
            and not self.busy
        )
        self.last_ready = now
        return quiet

    def send(self, queues: Iterable[str] = (), *, cancels: Iterable[int] = ()) -> None:
        with self.lock:
            if queues:
                self.last_ready = time.monotonic()
            self.pending.update(queues)
            self.pending_cancels.update(cancels)
            if (self.thread is None or not self.thread.is_alive()) and not self.halted:
                self.start_thread()
            self.wanted.notify()

    def start_thread(self) -> None:
        # Everything the thread needs is imported here, by the caller: a fork while the
        # thread imported a module would leave the child that module half-initialised.
        import psycopg

        self.connect_function = psycopg.connect
        if self.max_delay is None:
            self.max_delay = JobsSettings.load().db_retry_max_delay
        thread = threading.Thread(target=self.run, name="django-jobs-notifier", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # interpreter shutting down, or out of threads
            logger.debug("notifier thread not started: %s", exc)
            return
        self.thread = thread
        _register_atexit()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until what was handed over is sent.

        Returns at once (False) during an outage, or if there is no thread.
        """
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.pending or self.pending_cancels or self.busy:
                remaining = deadline - time.monotonic()
                if self.in_outage or self.thread is None or remaining <= 0:
                    return False
                self.settled.wait(remaining)
        return True

    def stop(self, timeout: float = 5.0) -> None:
        with self.lock:
            self.halted = True
            self.halt.set()
            self.wanted.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join(timeout)

    # -- the thread --

    def take(self, idle: float | None) -> tuple[set[str], set[int]] | None:
        """The queues and cancelled job ids to send next, or None when stopped or idle
        for ``idle`` seconds."""
        deadline = None if idle is None else time.monotonic() + idle
        with self.lock:
            while not self.pending and not self.pending_cancels and not self.halted:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self.wanted.wait(remaining)
            if self.halted:
                return None
            queues, self.pending = self.pending, set()
            cancels, self.pending_cancels = self.pending_cancels, set()
            self.busy = True
            return queues, cancels

    def settle(self, unsent: tuple[set[str], set[int]] | None = None, *, outage: bool) -> None:
        with self.lock:
            if unsent:
                self.pending |= unsent[0]
                self.pending_cancels |= unsent[1]
            self.busy = False
            self.in_outage = outage
            self.settled.notify_all()

    def run(self) -> None:
        try:
            self.loop()
        except Exception:  # a bug: say so; the next hand-over starts a new thread
            logger.exception("the notifier thread failed")

    def loop(self) -> None:
        backoff = Backoff(self.max_delay or 0.0)
        connection: Any = None
        outage_since: float | None = None
        next_round = 0.0
        while True:
            pause = next_round - time.monotonic()
            if pause > 0:
                self.halt.wait(pause)
            taken = self.take(self.idle_close if connection is not None else None)
            if taken is None:
                close(connection)
                connection = None
                if self.halted:
                    return
                continue
            worked = connection is not None
            try:
                if connection is None:
                    connection = self.connect()
                connection.execute(*notify_statement(*taken))
            except Exception as exc:  # psycopg.Error, or anything: never die silently
                close(connection)
                connection = None
                self.settle(taken, outage=True)
                if self.halted:
                    return
                if outage_since is None:
                    outage_since = time.monotonic()
                    logger.warning(
                        "not notifying workers of ready jobs (%s: %s); they find them by "
                        "polling meanwhile; reconnecting",
                        type(exc).__name__,
                        first_line(exc),
                    )
                    if worked:
                        continue  # a connection that worked went away: a new one at once
                else:
                    logger.debug("still not notifying workers of ready jobs: %s", first_line(exc))
                self.halt.wait(backoff.next())
                continue
            self.sent += 1
            next_round = time.monotonic() + MIN_INTERVAL
            backoff.reset()
            if outage_since is not None:
                logger.info(
                    "notifying workers of ready jobs again, after %.1fs",
                    time.monotonic() - outage_since,
                )
                outage_since = None
            self.settle(outage=False)

    def connect(self) -> Any:
        return self.connect_function(**self.params())


def close(connection: Any) -> None:
    """Close ``connection`` if there is one (the caller then holds None)."""
    if connection is not None:
        try:
            connection.close()
        except Exception:
            pass
