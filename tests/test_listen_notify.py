"""LISTEN/NOTIFY on PostgreSQL: an idle worker wakes at once when a job becomes ready,
and a busy one looks at once when a job it runs is cancelled.

Who notifies: ``django_jobs.notify``. Code that makes jobs ready hands their
queues to a per-process notifier once the transaction commits, and its thread
sends ``pg_notify`` on a connection of its own, so the enqueuing transaction
never takes PostgreSQL's notify lock (migration 0006 dropped 0004's trigger).

The process tests run workers whose polling interval (30 s) is far longer than
any wait here, so a job they start within seconds was found because of a
notification. To prove it, each of them first makes a job ready without a
notification (``listen_notify`` off in this process) and sees it stay ready,
then makes another ready with notifications on and sees both start: the only
thing that changed is the notification. The cancel test does the same with a
worker that looks for cancel requests every 30 s (``tests/slow_cancel_poll.py``).
Other databases have no notifier and no listener; they only poll.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.tasks import default_task_backend
from django.test import override_settings

from django_jobs import bulk_enqueue, cancel
from django_jobs.checks import backend_checks
from django_jobs.conf import JobsSettings
from django_jobs.core.admission import make_ready
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.db import notify
from django_jobs.db.notify import CANCEL_CHANNEL, Notifier
from django_jobs.models import Job, JobStatus
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.listener import (
    APPLICATION_NAME,
    CHANNEL,
    Listener,
    cancelled_ids,
    connection_params,
    start_listener,
)
from testproject.demo.models import AuditEvent
from tests import control_tasks, tasks
from tests.factories import JobFactory
from tests.harness import REPO_ROOT, database_url, error_paths, job_row, wait_until
from tests.proxy import CuttableProxy

pytestmark = pytest.mark.django_db(transaction=True)

postgres_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'",
    reason="LISTEN/NOTIFY is PostgreSQL's; workers on other databases only poll",
)

LONG_POLL = "30"  # seconds: no wait in these tests comes near it
WAKE = 5.0  # seconds a notified job may take to start, a sixth of LONG_POLL
SENTINEL = "slow"  # the queue of enqueue_sentinel()
OLD_TRIGGER = "django_jobs_ready_notify"  # migration 0004's, dropped by 0006
NOTIFY_MIGRATION = "0006_ready_notify_from_enqueuers"


@pytest.fixture(autouse=True)
def notifier(monkeypatch) -> Iterator[Notifier]:
    """This process's notifier for the test, not started yet, and never stopped by idleness
    (the tests look its connection up); none is left behind holding a connection. Every
    enqueue hands its queues to it: no process is ever quiet enough to notify in the
    enqueue's own statement (the tests of that set ``INLINE_AFTER`` back themselves)."""
    monkeypatch.setattr(notify, "INLINE_AFTER", math.inf)
    notify.stop_all()
    fresh = Notifier(partial(notify.connection_params, "default"), idle_close=60)
    notify.install("default", fresh)
    yield fresh
    notify.stop_all()


# -- Helpers ------------------------------------------------------------------------------


def listeners() -> list[tuple[int, bool, float]]:
    """(backend pid, LISTENing, seconds since its last state change) of each worker listener."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, state = 'idle' AND query = %s, "
            # state_change is NULL while a backend is still starting up: not yet settled.
            "COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - state_change), 0) "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE %s",
            [f"LISTEN {CHANNEL}", f"{APPLICATION_NAME}%"],
        )
        return [(pid, listening, float(age)) for pid, listening, age in cursor.fetchall()]


def settled_listeners(count: int = 1) -> list[int]:
    """The pids of the ``count`` listener backends, once each has been LISTENing for half
    a second: the claim its connection triggers (see ``Listener.run``) is over by then."""

    def settled() -> list[int]:
        current = listeners()
        found = [pid for pid, listening, age in current if listening and age > 0.5]
        return found if len(current) == len(found) == count else []

    return wait_until(settled, what=f"{count} worker(s) LISTENing for half a second")


def settled_listener() -> int:
    return settled_listeners(1)[0]


def notifier_backends(pid: int | None = None) -> list[int]:
    """Backend pids of the notifier connection of process ``pid`` (this one by default)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
            [f"{notify.APPLICATION_NAME} pid={pid or os.getpid()}"],
        )
        return [row[0] for row in cursor.fetchall()]


def backend_pid() -> int:
    """This thread's Django connection's backend: where the enqueuing transactions run."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


@contextlib.contextmanager
def notify_off() -> Iterator[None]:
    """Jobs made ready meanwhile (by this process) notify nobody."""
    with override_settings(DJANGO_JOBS={**settings.DJANGO_JOBS, "listen_notify": False}):
        yield


def holds_for(predicate: Callable[[], Any], seconds: float, what: str) -> None:
    """``predicate`` stays true for the whole of ``seconds`` (checked every 50 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), what
        time.sleep(0.05)


def assert_a_notification_wakes_the_idle_worker() -> None:
    """With the worker idle and its next poll 30 s away: a job made ready without a
    NOTIFY waits; a notified one wakes the worker, which takes both at once."""
    settled_listener()
    with notify_off():
        silent = tasks.add.enqueue(1, 1)
    holds_for(
        lambda: job_row(silent).status == JobStatus.READY,
        2.0,
        "a job made ready without a NOTIFY waits for the next poll",
    )
    notified = tasks.add.enqueue(2, 2)
    wait_until(
        lambda: {job_row(silent).status, job_row(notified).status} == {JobStatus.SUCCEEDED},
        WAKE,
        what="the notification to wake the worker",
    )
    silent, notified = job_row(silent), job_row(notified)
    assert notified.started_at - notified.enqueued_at < timedelta(seconds=WAKE)
    # The waiting job was taken by the claim the notification caused.
    assert silent.started_at >= notified.enqueued_at


@contextlib.contextmanager
def raw_listener(channel: str = CHANNEL) -> Iterator[Any]:
    """A psycopg connection of the test's own, LISTENing on ``channel``."""
    import psycopg

    params = {**connection_params("default"), "application_name": "django-jobs test"}
    with psycopg.connect(**params) as raw:
        raw.execute(f"LISTEN {channel}")
        yield raw


def received_until(raw: Any, sentinel_queue: str = SENTINEL, timeout: float = 10) -> list[Any]:
    """Notifications received, in order, up to and including the first naming
    ``sentinel_queue``; each with its payload parsed (``.queues``)."""
    received: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for notification in raw.notifies(timeout=0.2):
            assert notification.channel == CHANNEL
            queues = json.loads(notification.payload)
            received.append((notification, queues))
            if sentinel_queue in queues:
                return received
    raise AssertionError(f"no notification for {sentinel_queue!r}; got {received}")


def queues_notified(raw: Any) -> set[str]:
    """The queues notified before (or with) the sentinel's, the sentinel's own left out.

    Everything a committed transaction made ready before ``enqueue_sentinel()``
    ran is in it: the notifier sends what it was handed in order, several
    hand-overs sometimes in one notification.
    """
    named = {queue for _, queues in received_until(raw) for queue in queues}
    return named - {SENTINEL}


def running_jobs(count: int) -> list[Job]:
    """``count`` jobs claimed and started by a registered worker process (no thread runs
    them: cancelling one only asks)."""
    worker = register_process("default", "worker")
    for n in range(count):
        tasks.add.enqueue(n, n)
    jobs = claim_jobs("default", worker.pk, QueueSelector(("*",)), count)
    return start_jobs("default", jobs, worker.pk, worker.name)


def cancels_until(raw: Any, sentinel: int, timeout: float = 10) -> list[tuple[Any, list[int]]]:
    """Cancel notifications received, in order, up to the first naming job ``sentinel``."""
    received: list[tuple[Any, list[int]]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for notification in raw.notifies(timeout=0.2):
            assert notification.channel == CANCEL_CHANNEL
            received.append((notification, json.loads(notification.payload)))
            if sentinel in received[-1][1]:
                return received
    raise AssertionError(f"no cancel notification naming job {sentinel}; got {received}")


def enqueue_sentinel() -> None:
    """A committed enqueue in queue 'slow': everything committed before it is notified before
    it or with it."""
    tasks.add.using(queue_name=SENTINEL).enqueue(0, 0)


def in_another_thread(action: Callable[[], Any]) -> None:
    """Run ``action`` on a connection (and so in a transaction) of its own."""

    def run() -> None:
        try:
            action()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)


def triggers_on_ready_table() -> list[tuple[str, ...]]:
    ready_table = Job._meta.apps.get_model("django_jobs", "ReadyExecution")._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
                "WHERE tgrelid = %s::regclass AND NOT tgisinternal",
                [ready_table],
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS "
                "WHERE EVENT_OBJECT_SCHEMA = DATABASE()"
            )
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        return [tuple(row) for row in cursor.fetchall()]


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with the test project's settings and database."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": database_url(),
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("TEST_DATABASE_NAME", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


# -- The migrations: 0004 added a trigger, 0006 drops it ----------------------------------


def test_no_trigger_notifies_and_migration_0006_is_reversible():
    previous = importlib.import_module(f"django_jobs.migrations.{NOTIFY_MIGRATION}")
    before = previous.Migration.dependencies[0][1]
    assert triggers_on_ready_table() == []
    try:
        call_command("migrate", "django_jobs", before, verbosity=0)
        if connection.vendor == "postgresql":
            ((name, definition),) = triggers_on_ready_table()
            assert name == OLD_TRIGGER
            assert "AFTER INSERT" in definition and "FOR EACH STATEMENT" in definition
        else:
            assert triggers_on_ready_table() == []
    finally:
        call_command("migrate", "django_jobs", verbosity=0)
    assert triggers_on_ready_table() == []


# -- The notifier ---------------------------------------------------------------------------


def test_the_payload_names_the_queues_or_any_queue_when_too_long():
    assert json.loads(notify.payload({"emails", "default"})) == ["default", "emails"]
    many = {f"{i:03}-" + "q" * 120 for i in range(70)}  # ~8,800 bytes as JSON
    assert notify.payload(many) == "[]"  # any queue: every worker wakes
    assert json.loads(notify.payload({12, 3})) == [3, 12]  # cancelled job ids
    assert notify.payload(set(range(10**9, 10**9 + 1000))) == "[]"  # every worker looks


def test_a_cancel_payload_names_job_ids_or_asks_to_look_at_every_job():
    assert cancelled_ids("[3,12]") == [3, 12]
    for anything in ("[]", "not json", '{"a": 1}', '["3"]', "[true]", "[1.5]", "null"):
        assert cancelled_ids(anything) is None, anything


@postgres_only
def test_a_cancel_of_a_running_job_is_notified_after_commit_and_never_on_rollback():
    """Only a job that runs somewhere is notified: a waiting one ends in the cancel itself.
    The ids go out on their own channel, from the notifier's connection."""
    kept, rolled_back, sentinel = running_jobs(3)
    waiting = tasks.add.enqueue(9, 9)
    with raw_listener(CANCEL_CHANNEL) as raw:
        canceller = backend_pid()
        with transaction.atomic():
            assert cancel(kept.pk) == "requested"
            assert list(raw.notifies(timeout=0.5)) == [], "notified before the commit"
        ((notification, ids),) = cancels_until(raw, kept.pk)
        assert ids == [kept.pk]
        assert notification.pid in notifier_backends() and notification.pid != canceller

        with contextlib.suppress(ZeroDivisionError), transaction.atomic():
            assert cancel(rolled_back.pk) == "requested"
            1 / 0  # noqa: B018
        assert job_row(rolled_back).cancel_requested_at is None
        assert cancel(waiting.id) == "cancelled"
        assert cancel(sentinel.pk) == "requested"
        assert [ids for _, ids in cancels_until(raw, sentinel.pk)] == [[sentinel.pk]]

        with notify_off():
            assert cancel(rolled_back.pk) == "requested"
        assert cancel(sentinel.pk) == "requested"  # asked again: notified again
        assert [ids for _, ids in cancels_until(raw, sentinel.pk)] == [[sentinel.pk]]


@postgres_only
def test_a_notification_is_sent_after_commit_by_the_notifier_and_never_on_rollback():
    with raw_listener() as raw:
        enqueuer = backend_pid()
        with transaction.atomic():
            tasks.echo.using(queue_name="reports").enqueue("open")
            # Committed meanwhile by another connection: notified while ours is open.
            in_another_thread(lambda: tasks.echo.enqueue("committed"))  # queue "emails"
            in_another_thread(enqueue_sentinel)
            assert queues_notified(raw) == {"emails"}
        enqueue_sentinel()
        received = received_until(raw)
        assert {q for _, queues in received for q in queues} == {"reports", SENTINEL}

        # Sent by the notifier's own connection, never by the enqueuing transaction:
        # that one never takes PostgreSQL's notify lock.
        (notifier,) = notifier_backends()
        assert {n.pid for n, _ in received} == {notifier}
        assert notifier != enqueuer

        with contextlib.suppress(ZeroDivisionError), transaction.atomic():
            tasks.echo.using(queue_name="reports").enqueue("rolled back")
            1 / 0  # noqa: B018
        enqueue_sentinel()
        assert queues_notified(raw) == set()


@postgres_only
def test_a_quiet_process_notifies_in_the_enqueue_itself_at_commit_and_never_on_rollback(
    notifier, monkeypatch
):
    """Every process quiet (``INLINE_AFTER`` 0): each single enqueue notifies in its own
    statement, from the enqueuing connection, at its transaction's commit, never on
    rollback, also under manual transaction management (which the notifier cannot serve);
    the notifier is never needed."""
    monkeypatch.setattr(notify, "INLINE_AFTER", 0.0)
    with raw_listener() as raw:
        enqueuer = backend_pid()
        tasks.echo.using(queue_name="reports").enqueue("autocommit")
        ((sent, queues),) = received_until(raw, "reports")
        assert (sent.pid, queues) == (enqueuer, ["reports"])

        with transaction.atomic():
            tasks.echo.enqueue("open")  # queue "emails"
            in_another_thread(enqueue_sentinel)  # another quiet enqueue, committed now
            assert queues_notified(raw) == set()
        received = received_until(raw, "emails")
        assert [(n.pid, queues) for n, queues in received] == [(enqueuer, ["emails"])]

        with contextlib.suppress(ZeroDivisionError), transaction.atomic():
            tasks.echo.using(queue_name="reports").enqueue("rolled back")
            1 / 0  # noqa: B018
        enqueue_sentinel()
        assert queues_notified(raw) == set()

        transaction.set_autocommit(False)
        try:
            tasks.echo.using(queue_name="reports").enqueue("manual")
            transaction.commit()
        finally:
            transaction.set_autocommit(True)
        ((sent, queues),) = received_until(raw, "reports")
        assert (sent.pid, queues) == (enqueuer, ["reports"])
    assert notifier.thread is None  # nothing was handed over


@postgres_only
def test_only_an_enqueue_after_a_quiet_spell_notifies_by_itself(notifier, monkeypatch):
    """A quiet spell of an hour: the process's first enqueue notifies in its statement; the
    next ones, closer than that to the last, go through the notifier (coalesced there); a
    bulk enqueue always does."""
    monkeypatch.setattr(notify, "INLINE_AFTER", 3600.0)
    with raw_listener() as raw:
        enqueuer = backend_pid()
        tasks.echo.using(queue_name="reports").enqueue("first")
        tasks.echo.enqueue("second")  # queue "emails"
        received = received_until(raw, "emails")
        (sender,) = notifier_backends()
        assert [(n.pid, queues) for n, queues in received] == [
            (enqueuer, ["reports"]),
            (sender, ["emails"]),
        ]
        assert sender != enqueuer
        assert notifier.quiet() is False


@postgres_only
def test_bulk_enqueues_and_promotions_notify_the_queues_they_made_ready():
    with raw_listener() as raw:
        # A bulk enqueue (the one-statement insert, and the ORM's admission for a keyed
        # job in the same transaction) hands its queues over once, at its commit.
        bulk_enqueue(
            [(tasks.add, (i, i), {}) for i in range(30)]
            + [(tasks.echo, (str(i),), {}) for i in range(30)]
            + [(tasks.add.using(queue_name="reports", concurrency_key="bulk"), (1, 1), {})]
        )
        enqueue_sentinel()
        # Its two hand-overs (the plain jobs', the keyed job's) come at the same commit,
        # in one notification or two when the notifier woke between them.
        assert queues_notified(raw) == {"default", "emails", "reports"}

        # Many jobs made ready in one transaction: one hand-over each, all after commit.
        with transaction.atomic():
            for i in range(5):
                tasks.add.enqueue(i, i)
        enqueue_sentinel()
        assert queues_notified(raw) == {"default"}

        # make_ready itself (promotions, retries, hand-backs): too many queues to name
        # in a payload is "[]", any queue.
        jobs = [JobFactory(queue_name=f"{i:03}-" + "q" * 120) for i in range(70)]
        make_ready("default", jobs)
        first = list(raw.notifies(timeout=10, stop_after=1))
        assert [n.payload for n in first] == ["[]"]


@postgres_only
def test_nothing_is_notified_with_listen_notify_off(notifier):
    with raw_listener() as raw:
        with notify_off():
            tasks.echo.enqueue("silent")
            bulk_enqueue([(tasks.echo, ("silent",), {})])
        assert notifier.thread is None  # nothing was handed over: not even started
        enqueue_sentinel()
        assert queues_notified(raw) == set()


@postgres_only
def test_an_idle_notifier_closes_its_connection_and_opens_one_when_needed():
    notifier = Notifier(partial(notify.connection_params, "default"), idle_close=0.3)
    notify.install("default", notifier)
    with raw_listener() as raw:
        enqueue_sentinel()
        ((first, _),) = received_until(raw)
        wait_until(lambda: notifier_backends() == [], what="the idle connection closed")
        assert notifier.thread is not None and notifier.thread.is_alive()
        tasks.echo.enqueue("later")
        ((second, _),) = received_until(raw, "emails")
    assert second.pid != first.pid


@postgres_only
def test_manual_transaction_management_enqueues_without_notifying():
    """on_commit cannot wait for a commit it does not see coming: nothing is sent then
    (workers poll), and the enqueue does not fail."""
    with raw_listener() as raw:
        transaction.set_autocommit(False)
        try:
            result = tasks.echo.using(queue_name="reports").enqueue("manual")
            transaction.commit()
        finally:
            transaction.set_autocommit(True)
        assert job_row(result).status == JobStatus.READY
        enqueue_sentinel()
        assert queues_notified(raw) == set()


@postgres_only
def test_the_notifier_survives_the_termination_of_its_connection(caplog):
    caplog.set_level(logging.DEBUG, logger="django_jobs.notify")
    with raw_listener() as raw:
        enqueue_sentinel()
        received_until(raw)
        (killed,) = notifier_backends()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [killed])
        wait_until(lambda: killed not in notifier_backends(), what="the backend gone")

        tasks.echo.enqueue("after the kill")
        received = received_until(raw, "emails")
        assert {n.pid for n, _ in received} != {killed}
        assert notifier_backends() == [received[-1][0].pid]
    # The notifier logs its recovery just after the NOTIFY commits, and the listener can
    # hear that NOTIFY first: the line is awaited, not expected at once.
    wait_until(
        lambda: "notifying workers of ready jobs again" in caplog.text,
        what="the notifier's recovery logged",
    )
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert warnings[0].getMessage().startswith("not notifying workers of ready jobs (")


@postgres_only
@pytest.mark.parametrize("failure", ["refused", "silent"])
def test_enqueue_neither_fails_nor_waits_when_the_notifier_cannot_connect(failure, caplog):
    """The notifier goes through a proxy that refuses connections, or to a port that
    accepts and never answers (so its connect hangs for a minute): enqueues go on at
    their own pace, every job is committed, the outage is logged once, and the queues
    not notified yet are sent once the notifier gets through."""
    caplog.set_level(logging.DEBUG, logger="django_jobs.notify")
    s = connection.settings_dict
    proxy = CuttableProxy(s.get("HOST") or "127.0.0.1", int(s.get("PORT") or 5432))
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # never accepts
    port = proxy.port if failure == "refused" else silent.getsockname()[1]
    proxy.refusing = True

    def params() -> dict[str, Any]:
        return {**notify.connection_params("default"), "port": port, "connect_timeout": 60}

    notifier = Notifier(params, max_delay=0.5)
    notify.install("default", notifier)
    try:
        with raw_listener() as raw:
            for i in range(10):
                began = time.monotonic()
                tasks.echo.using(queue_name="reports").enqueue(i)
                assert time.monotonic() - began < 5.0, "an enqueue waited for the notifier"
            assert Job.objects.filter(queue_name="reports").count() == 10
            assert notifier.sent == 0
            assert notifier.pending <= {"reports"}  # kept (or in flight)
            if failure == "silent":
                assert list(raw.notifies(timeout=0.5, stop_after=1)) == []
                return
            wait_until(
                lambda: caplog.text.count("still not notifying workers of ready jobs") >= 2,
                what="two retries",
            )
            assert notifier.flush(5.0) is False  # in an outage: no wait
            proxy.restore()
            received_until(raw, "reports")
    finally:
        notifier.stop(0.1)
        silent.close()
        proxy.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "notifying workers of ready jobs again, after" in caplog.text


@postgres_only
def test_a_process_starts_its_notifier_on_its_first_commit_never_at_import_and_anew_after_fork():
    """A web server imports the app, maybe enqueues, then forks its workers: each process
    gets a notifier of its own at its first commit; the parent's keeps working; and a
    process that exits right after enqueuing still sends its notification."""
    code = """
import os, sys, threading
import django
django.setup()
from django.db import connections
from django_jobs import notify
from tests import tasks

notify.INLINE_AFTER = float("inf")  # every enqueue through the notifier, as in the other tests

def notifier_threads():
    return [t for t in threading.enumerate() if t.name == "django-jobs-notifier"]

assert notifier_threads() == [], "a notifier at import"
tasks.add.using(queue_name="reports").enqueue(1, 1)
assert len(notifier_threads()) == 1
connections.close_all()
child = os.fork()
if child == 0:
    assert notify._notifiers == {}, "the parent's notifier in the child"
    tasks.add.using(queue_name="emails").enqueue(2, 2)
    os._exit(0 if notify._notifiers["default"].flush(10) else 3)
_, status = os.waitpid(child, 0)
assert status == 0, status
tasks.add.using(queue_name="slow").enqueue(3, 3)
print(child)
# Exits at once: atexit gives the notifier its second to send "slow".
"""
    with raw_listener() as raw:
        done = run_python(code)
        received = received_until(raw)
    by_queue = {queue: n.pid for n, queues in received for queue in queues}
    assert set(by_queue) == {"reports", "emails", "slow"}, received
    # The child's notification came from a connection of its own.
    assert by_queue["emails"] not in {by_queue["reports"], by_queue["slow"]}
    # The parent's notifier lost nothing to the fork (a child closing the inherited
    # connection would have cut it: the parent would have said so).
    assert "not notifying workers" not in done.stderr, done.stderr
    assert int(done.stdout.strip()) > 0


# -- The listener in a worker process -----------------------------------------------------


def test_a_listener_wakes_its_worker_only_for_queues_it_serves():
    listener = Listener(
        {},
        QueueSelector(("emails", "reports*")),
        Lifecycle(),
        polling_interval=1.0,
        max_delay=1.0,
    )
    assert listener.wanted('["emails"]')
    assert listener.wanted('["default", "reports-daily"]')
    assert not listener.wanted('["default"]')
    assert not listener.wanted('["slow", "default"]')
    assert listener.wanted("[]")  # too many queues to name: any
    assert listener.wanted("not json")  # not ours to judge: wake


@postgres_only
def test_a_listener_hands_cancelled_job_ids_to_the_watchdog():
    """On connecting it asks for a check of every running job (a cancel sent before its
    LISTEN reached nobody), then passes on each cancel notification; ready ones it does
    not."""
    heard: list[list[int] | None] = []
    listener = start_listener(
        JobsSettings.load(), QueueSelector(("*",)), Lifecycle(), on_cancel=heard.append
    )
    assert listener is not None
    try:
        wait_until(lambda: heard == [None], what="the check asked for on connecting")
        settled_listener()
        (job,) = running_jobs(1)
        tasks.add.enqueue(1, 1)  # a ready notification: not the watchdog's business
        assert cancel(job.pk) == "requested"
        wait_until(lambda: heard == [None, [job.pk]], what="the cancelled job's id")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CANCEL_CHANNEL, "garbage"])
        wait_until(lambda: heard == [None, [job.pk], None], what="a check of every job")
    finally:
        listener.stop()


def test_no_listener_on_other_databases_or_when_turned_off():
    lifecycle = Lifecycle()
    selector = QueueSelector(("*",))
    off = JobsSettings.load(listen_notify=False)
    assert start_listener(off, selector, lifecycle) is None
    listener = start_listener(JobsSettings.load(), selector, lifecycle)
    if connection.vendor != "postgresql":
        assert listener is None
        return
    assert listener is not None
    try:
        wait_until(lambda: any(listening for _, listening, _ in listeners()), what="LISTEN")
        # Its first act once listening: wake the worker for what was made ready before.
        wait_until(lifecycle.wake.is_set, what="the wake-up after LISTEN")
    finally:
        listener.stop()
    assert not listener.thread.is_alive()
    wait_until(lambda: listeners() == [], what="its connection closed")


@pytest.mark.parametrize(
    ("value", "valid"),
    [(True, True), (False, True), ("default", None), ("nowhere", False), (1, False)],
)
def test_listen_notify_must_be_a_bool_or_a_postgresql_alias(value, valid):
    if valid is None:  # an alias: valid only if it is PostgreSQL
        valid = connection.vendor == "postgresql"
    with override_settings(DJANGO_JOBS={"listen_notify": value}):
        ids = [error.id for error in backend_checks(default_task_backend)]
    assert ("django_jobs.E021" not in ids) is valid, ids


@postgres_only
@pytest.mark.workers
@pytest.mark.parametrize("mode", [[], ["--single-process"]], ids=["supervisor", "single-process"])
def test_an_idle_worker_wakes_at_once_when_a_job_is_enqueued(run_jobs, mode):
    proc = run_jobs(*mode, "--threads", "2", "--polling-interval", LONG_POLL)
    assert_a_notification_wakes_the_idle_worker()
    proc.wait_for_output("listening for ready jobs (channel django_jobs_ready)")
    assert proc.count("listening for ready jobs (channel django_jobs_ready)") == 1


@postgres_only
@pytest.mark.workers
def test_the_listener_reconnects_after_its_connection_is_killed(run_jobs):
    proc = run_jobs("--threads", "2", "--polling-interval", LONG_POLL)
    killed = settled_listener()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [killed])
    proc.wait_for_output("not listening for ready jobs (")
    proc.wait_for_output("listening for ready jobs again, after")
    assert settled_listener() != killed
    assert proc.count("not listening for ready jobs (") == 1, proc.output()
    # The new connection wakes the worker at once, as the first did.
    assert_a_notification_wakes_the_idle_worker()


@postgres_only
@pytest.mark.workers
def test_without_its_listener_a_worker_polls_and_logs_the_outage_once(run_jobs):
    """The listener goes through a proxy (DJANGO_JOBS['listen_notify'] names a second
    database alias) that refuses new connections while the test says so; the worker's
    own connections go straight to the database."""
    settings = connection.settings_dict
    proxy = CuttableProxy(settings.get("HOST") or "127.0.0.1", int(settings.get("PORT") or 5432))
    try:
        proc = run_jobs(
            "--threads",
            "2",
            "--polling-interval",
            "1",
            env={
                "JOBS_LISTEN_DATABASE_URL": database_url(port=proxy.port),
                "JOBS_LOG_LEVEL": "DEBUG",
            },
        )
        killed = settled_listener()
        proxy.refusing = True
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [killed])
        proc.wait_for_output("not listening for ready jobs (")
        wait_until(lambda: listeners() == [], what="the killed backend gone")

        # Polling alone finds jobs while the listener cannot connect.
        result = tasks.add.enqueue(3, 4)
        wait_until(
            lambda: job_row(result).status == JobStatus.SUCCEEDED, 10, what="a job run by polling"
        )
        assert listeners() == []
        # It kept trying, and said so once (the retries are DEBUG lines).
        wait_until(
            lambda: proc.count("still not listening for ready jobs") >= 2, what="two retries"
        )
        assert proc.count("not listening for ready jobs (") == 1, proc.output()
        assert "listening for ready jobs again" not in proc.output()

        proxy.restore()
        proc.wait_for_output("listening for ready jobs again, after")
        assert settled_listener() != killed
        assert proc.count("not listening for ready jobs (") == 1, proc.output()
    finally:
        proxy.close()


@postgres_only
@pytest.mark.workers
def test_listen_notify_false_starts_no_listener(run_jobs):
    proc = run_jobs("--threads", "2", env={"JOBS_LISTEN_NOTIFY": "false"})
    proc.wait_for_output("not listening for ready jobs (DJANGO_JOBS['listen_notify'] is False)")
    result = tasks.add.enqueue(1, 2)
    wait_until(lambda: job_row(result).status == JobStatus.SUCCEEDED, what="a job run by polling")
    assert listeners() == []
    assert Job.objects.filter(status=JobStatus.READY).count() == 0


@postgres_only
@pytest.mark.workers
def test_a_finish_that_admits_a_blocked_job_wakes_another_worker(run_jobs, tmp_path):
    """Worker A serves 'reports', worker B 'slow', both idle with their next poll 30 s
    away. A runs the job holding key K's only slot; a job of K in 'slow' waits blocked.
    A's finish makes it ready, and the notification from A's process wakes B."""
    run_jobs("--queues", "reports", "--threads", "2", "--polling-interval", LONG_POLL)
    run_jobs("--queues", SENTINEL, "--threads", "2", "--polling-interval", LONG_POLL)
    settled_listeners(2)
    marker = tmp_path / "holder-started"
    keyed = {"concurrency_key": "gate", "concurrency_group": "wake", "concurrency_limit": 1}
    holder = tasks.sleep_then_return.using(queue_name="reports", **keyed).enqueue(1.0, str(marker))
    waiting = tasks.add.using(queue_name=SENTINEL, **keyed).enqueue(1, 2)
    assert job_row(waiting).status == JobStatus.BLOCKED
    wait_until(marker.exists, WAKE, what="the holder to start (woken by its enqueue)")
    wait_until(
        lambda: job_row(waiting).status == JobStatus.SUCCEEDED,
        WAKE + 2,
        what="the promoted job to run in the other worker",
    )
    holder, waiting = job_row(holder), job_row(waiting)
    assert holder.status == JobStatus.SUCCEEDED
    assert waiting.started_at >= holder.finished_at
    assert waiting.started_at - holder.finished_at < timedelta(seconds=WAKE)
    assert waiting.worker_ids != holder.worker_ids


@postgres_only
@pytest.mark.workers
def test_a_cancel_reaches_a_busy_worker_at_once_through_notify(run_jobs):
    """The worker looks for cancel requests every 30 s by itself. A cancel made without a
    NOTIFY waits for that; a notified one stops its job (an async task in
    ``asyncio.sleep(60)``) within a couple of seconds, and the check it causes finds the
    silent one too. The 10 s grace keeps the forced path out of it."""
    proc = run_jobs(
        "--threads",
        "2",
        env={"DJANGO_SETTINGS_MODULE": "tests.slow_cancel_poll", "JOBS_INTERRUPT_GRACE": "10"},
    )
    silent = control_tasks.until_cancelled.enqueue()
    notified = control_tasks.sleeps_async.enqueue()
    for result in (silent, notified):
        wait_until(
            lambda result=result: AuditEvent.objects.filter(job_id=int(result.id)).exists(),
            30,
            what=f"job {result.id} started",
        )
    settled_listener()
    with notify_off():
        assert cancel(silent.id) == "requested"
    holds_for(
        lambda: job_row(silent).status == JobStatus.RUNNING,
        2.0,
        "a cancel without a NOTIFY waits for the worker's 30 s poll",
    )
    began = time.monotonic()
    assert cancel(notified.id) == "requested"
    wait_until(lambda: job_row(notified).status == JobStatus.FAILED, WAKE, what="the NOTIFY")
    took = time.monotonic() - began
    assert took < 2.0, f"{took:.2f}s from cancel() to the job's end"
    wait_until(lambda: job_row(silent).status == JobStatus.FAILED, 2, what="the same check")
    for result in (silent, notified):
        assert (job_row(result).attempts, error_paths(result)) == (
            1,
            ["django_jobs.exceptions.JobCancelled"],
        )
    proc.wait_for_output("and cancel requests (channel django_jobs_cancel)")
