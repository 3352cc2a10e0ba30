"""LISTEN/NOTIFY on PostgreSQL: an idle worker wakes at once when a job becomes ready.

The process tests run workers whose polling interval (30 s) is far longer than
any wait here, so a job they start within seconds was found because of a
notification. To prove it, each of them first makes a job ready with the
trigger disabled (no NOTIFY) and sees it stay ready, then makes another ready
with the trigger on and sees both start: the only thing that changed is the
notification. Other databases have no trigger and no listener; they only poll.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.tasks import default_task_backend
from django.test import override_settings

from django_jobs import bulk_enqueue
from django_jobs.checks import backend_checks
from django_jobs.conf import JobsSettings
from django_jobs.models import Job, JobStatus, ReadyExecution
from django_jobs.queues import QueueSelector
from django_jobs.runner.lifecycle import Lifecycle
from django_jobs.runner.listener import (
    APPLICATION_NAME,
    CHANNEL,
    Listener,
    connection_params,
    start_listener,
)
from tests import tasks
from tests.factories import JobFactory
from tests.harness import database_url, job_row, wait_until
from tests.proxy import CuttableProxy

pytestmark = pytest.mark.django_db(transaction=True)

postgres_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'",
    reason="LISTEN/NOTIFY is PostgreSQL's; workers on other databases only poll",
)

READY_TABLE = ReadyExecution._meta.db_table
TRIGGER = "django_jobs_ready_notify"
LONG_POLL = "30"  # seconds: no wait in these tests comes near it
WAKE = 5.0  # seconds a notified job may take to start, a sixth of LONG_POLL


# -- Helpers ------------------------------------------------------------------------------


def listeners() -> list[tuple[int, bool, float]]:
    """(backend pid, LISTENing, seconds since its last state change) of each worker listener."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, state = 'idle' AND query = %s, "
            "EXTRACT(EPOCH FROM clock_timestamp() - state_change) "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE %s",
            [f"LISTEN {CHANNEL}", f"{APPLICATION_NAME}%"],
        )
        return [(pid, listening, float(age)) for pid, listening, age in cursor.fetchall()]


def settled_listener() -> int:
    """The pid of the one listener backend, once it has been LISTENing for half a second:
    the claim its connection triggers (see ``Listener.run``) is over by then."""
    found = wait_until(
        lambda: [pid for pid, listening, age in listeners() if listening and age > 0.5],
        what="a worker LISTENing for half a second",
    )
    assert len(found) == 1, listeners()
    return found[0]


@contextlib.contextmanager
def trigger_disabled() -> Iterator[None]:
    """Ready rows inserted meanwhile send no NOTIFY (docs/running.md's off switch)."""
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {READY_TABLE} DISABLE TRIGGER {TRIGGER}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {READY_TABLE} ENABLE TRIGGER {TRIGGER}")


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
    with trigger_disabled():
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
def raw_listener() -> Iterator[Any]:
    """A psycopg connection of the test's own, LISTENing on the channel."""
    import psycopg

    params = {**connection_params("default"), "application_name": "django-jobs test"}
    with psycopg.connect(**params) as raw:
        raw.execute(f"LISTEN {CHANNEL}")
        yield raw


def notifications_until(raw: Any, sentinel_queue: str) -> list[list[str]]:
    """Payloads received, in commit order, up to the first that names ``sentinel_queue``."""
    import json

    received: list[list[str]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for notify in raw.notifies(timeout=0.2):
            assert notify.channel == CHANNEL
            received.append(json.loads(notify.payload))
            if sentinel_queue in received[-1]:
                return received[:-1]
    raise AssertionError(f"no notification for {sentinel_queue!r}; got {received}")


def enqueue_sentinel() -> None:
    """A committed enqueue in queue 'slow': everything committed before it is notified before it."""
    tasks.add.using(queue_name="slow").enqueue(0, 0)


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
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
                "WHERE tgrelid = %s::regclass AND NOT tgisinternal",
                [READY_TABLE],
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS "
                "WHERE EVENT_OBJECT_SCHEMA = DATABASE()"
            )
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        return [tuple(row) for row in cursor.fetchall()]


# -- The migration and the trigger --------------------------------------------------------


def test_the_migration_adds_the_trigger_on_postgresql_only_and_is_reversible():
    def assert_installed() -> None:
        if connection.vendor == "postgresql":
            ((name, definition),) = triggers_on_ready_table()
            assert name == TRIGGER
            assert "AFTER INSERT" in definition and "FOR EACH STATEMENT" in definition
            assert "REFERENCING NEW TABLE AS new_rows" in definition
        else:
            assert triggers_on_ready_table() == []

    assert_installed()
    try:
        call_command("migrate", "django_jobs", "0003_batches_unique_recurring", verbosity=0)
        assert triggers_on_ready_table() == []
    finally:
        call_command("migrate", "django_jobs", verbosity=0)
    assert_installed()


@postgres_only
def test_a_notification_is_delivered_when_its_transaction_commits_and_never_on_rollback():
    with raw_listener() as raw:
        with transaction.atomic():
            tasks.echo.using(queue_name="reports").enqueue("open")
            # Committed meanwhile by another connection: notified while ours is open.
            in_another_thread(lambda: tasks.echo.enqueue("committed"))  # queue "emails"
            in_another_thread(enqueue_sentinel)
            # Notifications come in commit order: one from the open transaction would
            # come before the others.
            assert notifications_until(raw, "slow") == [["emails"]]
        enqueue_sentinel()
        assert notifications_until(raw, "slow") == [["reports"]]

        with contextlib.suppress(ZeroDivisionError), transaction.atomic():
            tasks.echo.using(queue_name="reports").enqueue("rolled back")
            1 / 0  # noqa: B018
        enqueue_sentinel()
        assert notifications_until(raw, "slow") == []


@postgres_only
def test_one_notification_per_statement_naming_its_queues():
    with raw_listener() as raw:
        # A bulk enqueue inserts its ready rows in one statement: one notification.
        bulk_enqueue(
            [(tasks.add, (i, i), {}) for i in range(30)]
            + [(tasks.echo, (str(i),), {}) for i in range(30)]
        )
        enqueue_sentinel()
        assert notifications_until(raw, "slow") == [["default", "emails"]]

        # PostgreSQL folds identical notifications of one transaction into one.
        with transaction.atomic():
            for i in range(5):
                tasks.add.enqueue(i, i)
        enqueue_sentinel()
        assert notifications_until(raw, "slow") == [["default"]]

        # Too many queues for a payload (8000 bytes): "[]", any queue.
        jobs = [JobFactory(queue_name=f"{i:03}-" + "q" * 120) for i in range(70)]
        ReadyExecution.objects.bulk_create(
            [ReadyExecution(job=job, queue_name=job.queue_name) for job in jobs]
        )
        enqueue_sentinel()
        assert notifications_until(raw, "slow") == [[]]


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
