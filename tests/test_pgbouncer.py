"""Behind a real PgBouncer in transaction pooling mode (issue 15 item 6).

A session fixture starts Debian's ``pgbouncer`` (``tests/pgbouncer.py``) with
``pool_mode = transaction`` and a pool of 5 server connections for the test
database. The setup is the one docs/deployment.md#pgbouncer describes: the jobs'
alias goes through PgBouncer with ``DISABLE_SERVER_SIDE_CURSORS``, Django's default
of no prepared statements kept, and ``DJANGO_JOBS["listen_notify"]`` names a second
alias straight to PostgreSQL, used by the workers' listeners only.

In this process, the ``default`` alias is pointed at PgBouncer for a test
(:func:`through_pgbouncer`): enqueues, the test's own reads and the admin's
requests (Django's test client) all go through it. ``run_jobs`` subprocesses get a
``DATABASE_URL`` with PgBouncer's port and a ``JOBS_LISTEN_DATABASE_URL`` with
PostgreSQL's.

Nothing here takes PgBouncer's presence on trust: each test checks it on
PgBouncer's admin console (``SHOW CLIENTS`` lists the connection the test used;
``SHOW STATS`` counts the transactions), and the worker test reads from ``/proc``
which TCP peers each ``run_jobs`` process talks to: PgBouncer, except for one
connection per worker straight to PostgreSQL, which is that worker's listener.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from importlib.util import find_spec
from typing import Any

import pytest
from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_jobs import bulk_enqueue, enqueue_batch, enqueue_on_commit
from django_jobs import task as jobs_task
from django_jobs.db import notify
from django_jobs.models import (
    FINISHED_STATUSES,
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)
from django_jobs.runtime.listener import APPLICATION_NAME as LISTENER_NAME
from django_jobs.runtime.listener import CHANNEL
from testproject.demo.models import AuditEvent
from tests import batch_tasks, tasks
from tests.factories import (
    FailedExecutionFactory,
    JobFactory,
    ProcessFactory,
    ScheduledExecutionFactory,
)
from tests.harness import job_row, max_overlap, wait_until
from tests.pgbouncer import PgBouncer, Upstream, binary, local_port, tcp_connections
from tests.stress_tasks import audited

# PostgreSQL's driver: installed in the PostgreSQL environments only, where these run.
psycopg = pytest.importorskip("psycopg", reason="PgBouncer fronts PostgreSQL: no psycopg here")

pytestmark = [
    pytest.mark.skipif(
        "connection.vendor != 'postgresql'",
        reason="PgBouncer pools PostgreSQL connections; other databases have no such pooler",
    ),
    pytest.mark.django_db(transaction=True),
]

LONG_POLL = "30"  # seconds: a worker polling this rarely starts a job at once only if notified
WAKE = 5.0  # seconds a notified job may take to start
one_at_a_time = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_limit=1)
unique_add = jobs_task(tasks.add.func, unique_key="sum:{a}")
KEYED = "tests.stress_tasks.audited/stress:one"  # the drain's key, limit 1


@pytest.fixture(scope="session")
def pgbouncer(django_db_setup) -> Iterator[PgBouncer]:
    """PgBouncer for the test database, for the whole session; stopped before the test
    database is dropped (this fixture depends on ``django_db_setup``)."""
    if binary() is None:
        message = (
            "the pgbouncer binary is not installed (Debian: apt-get install pgbouncer; "
            "elsewhere set JOBS_PGBOUNCER to its path)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{message}: CI must run the PgBouncer tests, never skip them")
        pytest.skip(message)
    s = connections["default"].settings_dict
    bouncer = PgBouncer(
        Upstream(
            host=s["HOST"] or "127.0.0.1",
            port=int(s["PORT"] or 5432),
            dbname=s["NAME"],  # the test database, created by django_db_setup
            user=s["USER"] or getpass.getuser(),
            password=s["PASSWORD"] or "",
        )
    )
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.cleanup()


@pytest.fixture(autouse=True)
def no_server_connections_left(request) -> Iterator[None]:
    """After each test, PgBouncer holds no connection to PostgreSQL (see close_servers)."""
    yield
    if "pgbouncer" in request.fixturenames:
        request.getfixturevalue("pgbouncer").close_servers()


@pytest.fixture
def through_pgbouncer(pgbouncer, transactional_db) -> Iterator[PgBouncer]:
    """This process's ``default`` alias through PgBouncer for the test, set as
    docs/deployment.md says; back to PostgreSQL itself afterwards."""
    conn = connections["default"]
    notify.stop_all()  # a notifier started earlier would still hold a direct connection
    conn.close()
    keys = ("HOST", "PORT", "DISABLE_SERVER_SIDE_CURSORS")
    saved = {key: conn.settings_dict.get(key) for key in keys}
    conn.settings_dict.update(
        HOST="127.0.0.1", PORT=str(pgbouncer.port), DISABLE_SERVER_SIDE_CURSORS=True
    )
    try:
        yield pgbouncer
    finally:
        notify.stop_all()
        conn.close()
        conn.settings_dict.update(saved)


@pytest.fixture
def workers_through_pgbouncer(pgbouncer, run_jobs):
    """``run_jobs`` with its jobs' alias through PgBouncer and LISTEN straight to PostgreSQL."""

    def start(*args: str, env: dict[str, str] | None = None):
        return run_jobs(
            *args,
            env={
                "DATABASE_URL": pgbouncer.url(),
                "DISABLE_SERVER_SIDE_CURSORS": "true",
                "JOBS_LISTEN_DATABASE_URL": pgbouncer.upstream.url(),
                **(env or {}),
            },
        )

    return start


# -- Helpers ------------------------------------------------------------------------------


def direct(bouncer: PgBouncer) -> psycopg.Connection:
    """A connection of the test's own straight to PostgreSQL (never through PgBouncer)."""
    return psycopg.connect(**bouncer.upstream.params())


def upstream_port(bouncer: PgBouncer) -> int:
    return bouncer.upstream.port


def assert_through_pgbouncer(bouncer: PgBouncer) -> None:
    """This thread's ``default`` connection is one of PgBouncer's clients, in a pool in
    transaction mode, and PostgreSQL is not what it is connected to."""
    conn = connections["default"]
    conn.ensure_connection()
    assert conn.connection.info.port == bouncer.port != upstream_port(bouncer)
    port = local_port(conn.connection)
    assert port in {client["port"] for client in bouncer.clients()}, bouncer.clients()
    assert bouncer.pool()["pool_mode"] == "transaction"


def listener_ports(bouncer: PgBouncer, pid: int) -> list[int]:
    """``client_port`` of the backends of process ``pid``'s listener, from PostgreSQL."""
    with direct(bouncer) as raw:
        rows = raw.execute(
            "SELECT client_port FROM pg_stat_activity WHERE application_name = %s",
            [f"{LISTENER_NAME} pid={pid}"],
        ).fetchall()
    return [port for (port,) in rows]


def listening_workers(bouncer: PgBouncer) -> int:
    """Worker listeners that have been LISTENing for half a second (their start-up claim,
    see ``Listener.run``, is over by then)."""
    with direct(bouncer) as raw:
        (count,) = raw.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE %s AND state = 'idle' AND query = %s "
            "AND clock_timestamp() - state_change > interval '0.5 seconds'",
            [f"{LISTENER_NAME}%", f"LISTEN {CHANNEL}"],
        ).fetchone()
    return count


@contextlib.contextmanager
def notify_off() -> Iterator[None]:
    """Jobs made ready meanwhile (by this process) notify nobody."""
    with override_settings(DJANGO_JOBS={**settings.DJANGO_JOBS, "listen_notify": False}):
        yield


def holds_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), what
        time.sleep(0.05)


# -- Tests --------------------------------------------------------------------------------


def test_listen_through_pgbouncer_in_transaction_mode_hears_nothing(pgbouncer):
    """Why ``listen_notify`` names a direct alias: PgBouncer hands the server connection
    that ran LISTEN to other clients, and drops what PostgreSQL sends it meanwhile."""
    with (
        psycopg.connect(**pgbouncer.client_params()) as pooled,
        direct(pgbouncer) as straight,
        direct(pgbouncer) as sender,
    ):
        pooled.execute("LISTEN pgbouncer_test")  # PgBouncer says OK ...
        straight.execute("LISTEN pgbouncer_test")
        sender.execute("SELECT pg_notify('pgbouncer_test', 'hello')")
        assert [n.payload for n in straight.notifies(timeout=5, stop_after=1)] == ["hello"]
        assert list(pooled.notifies(timeout=1)) == []  # ... and the listener never hears


def test_enqueue_one_bulk_unique_batch_and_on_commit_through_pgbouncer(through_pgbouncer):
    bouncer = through_pgbouncer
    assert_through_pgbouncer(bouncer)
    # Django's psycopg 3 backend prepares no statements unless OPTIONS ask for it (a
    # named prepared statement lives on one server connection); our own connections
    # (the notifier's, the listener's) take the alias's parameters, so none either.
    assert connections["default"].connection.prepare_threshold is None
    notifier_params = notify.connection_params("default")
    assert notifier_params["prepare_threshold"] is None
    assert notifier_params["port"] == str(bouncer.port)
    before = bouncer.transactions()

    single = tasks.add.enqueue(1, 2)
    bulk = bulk_enqueue([(tasks.add, [n, n], {}) for n in range(50)])
    keyed = [one_at_a_time.enqueue(7) for _ in range(3)]
    first, duplicate = unique_add.enqueue(5, 1), unique_add.enqueue(5, 2)
    batch = enqueue_batch(
        [(batch_tasks.item, [n], {}) for n in range(5)], on_finish=batch_tasks.callback
    )
    with transaction.atomic():
        in_atomic = tasks.add.enqueue(3, 4)
        enqueue_on_commit(tasks.echo, "after commit")
    with contextlib.suppress(RuntimeError), transaction.atomic():
        tasks.add.enqueue(0, 0)
        raise RuntimeError("roll back")

    assert_through_pgbouncer(bouncer)
    assert bouncer.transactions() - before >= 8
    # Read back straight from PostgreSQL, not through the pooler that wrote them.
    with direct(bouncer) as raw:
        statuses = dict(raw.execute("SELECT id, status FROM django_jobs_job").fetchall())
        blocked = raw.execute("SELECT count(*) FROM django_jobs_blockedexecution").fetchone()
        echoes = raw.execute(
            "SELECT count(*) FROM django_jobs_job WHERE task_path = 'tests.tasks.echo' "
            "AND args = %s",
            [json.dumps(["after commit"])],
        ).fetchone()
    ready = [single, *bulk, keyed[0], first, in_atomic]
    assert {statuses[int(r.id)] for r in ready} == {JobStatus.READY}
    assert [statuses[int(r.id)] for r in keyed[1:]] == [JobStatus.BLOCKED] * 2
    assert blocked == (2,)
    assert duplicate.id == first.id  # one job per unique key
    assert echoes == (1,)
    assert {statuses[int(r.id)] for r in batch.results} == {JobStatus.READY}
    # 1 + 50 + 3 + 1 + 5 items + 1 + 1, and nothing of the rolled-back transaction.
    assert len(statuses) == 62


@contextlib.contextmanager
def one_server_left(bouncer: PgBouncer) -> Iterator[list[psycopg.Connection]]:
    """Clients of PgBouncer holding all of the pool's server connections but one, each
    in a transaction: whoever runs a statement next runs it on that one. Closing one
    of them frees another server connection."""
    holders: list[psycopg.Connection] = []
    try:
        for _ in range(bouncer.pool_size - 1):
            holder = psycopg.connect(**{**bouncer.client_params(), "autocommit": False})
            holders.append(holder)
            holder.execute("SELECT 1")
        yield holders
    finally:
        for holder in holders:
            holder.close()


def test_session_state_under_transaction_pooling(through_pgbouncer):
    """What transaction pooling does to session state, and the settings that answer it.

    PgBouncer gives a client's next transaction whichever server connection is free.
    Holding all of the pool's connections but one decides which, so each step here
    runs where the test says, whatever PgBouncer's order of choice."""
    bouncer = through_pgbouncer
    conn = connections["default"]
    conn.ensure_connection()
    JobFactory.create_batch(3)

    # Django's one session setting, SET TIME ZONE at connect (USE_TZ: 'UTC', not the
    # server's 'Etc/UTC'), is one PgBouncer tracks and sets again for each client: here
    # on the server connection another client just left in Tokyo time.
    with one_server_left(bouncer), psycopg.connect(**bouncer.client_params()) as tokyo:
        tokyo.execute("SET TIME ZONE 'Asia/Tokyo'")
        (left_in_tokyo,) = tokyo.execute("SELECT pg_backend_pid()").fetchone()
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid(), current_setting('TimeZone')")
            assert cursor.fetchone() == (left_in_tokyo, "UTC")

    # A server-side cursor is not: Django declares it WITH HOLD outside a transaction,
    # and the next chunk's FETCH runs on a server connection without it.
    conn.settings_dict["DISABLE_SERVER_SIDE_CURSORS"] = False
    with (
        one_server_left(bouncer) as holders,
        psycopg.connect(**{**bouncer.client_params(), "autocommit": False}) as other,
    ):
        rows = Job.objects.order_by("pk").iterator(chunk_size=1)
        next(rows)  # DECLARE and the first FETCH, on the one free server connection
        other.execute("SELECT 1")  # which another client now holds
        holders[0].close()  # the next FETCH runs on the connection this frees
        # (Django's error, then psycopg's from the CLOSE of that cursor in Django's finally.)
        with pytest.raises((DatabaseError, psycopg.Error), match="does not exist"):
            list(rows)

    # DISABLE_SERVER_SIDE_CURSORS=True (docs/deployment.md): the same steps work.
    conn.settings_dict["DISABLE_SERVER_SIDE_CURSORS"] = True
    with (
        one_server_left(bouncer) as holders,
        psycopg.connect(**{**bouncer.client_params(), "autocommit": False}) as other,
    ):
        rows = Job.objects.order_by("pk").iterator(chunk_size=1)
        next(rows)
        other.execute("SELECT 1")
        holders[0].close()
        assert len(list(rows)) == 2
    assert_through_pgbouncer(bouncer)


@pytest.mark.workers
def test_run_jobs_drains_a_concurrency_limited_key_through_pgbouncer(
    through_pgbouncer, workers_through_pgbouncer, figure
):
    bouncer = through_pgbouncer
    plain = bulk_enqueue([(tasks.add, [n, 1], {}) for n in range(200)])
    keyed = bulk_enqueue(
        [
            (
                audited.using(concurrency_limit=1),
                [],
                # Every fifth fails once: its retry goes back through the semaphore.
                {"key": "one", "limit": 1, "duration": 0.01, "fail_attempts": int(n % 5 == 0)},
            )
            for n in range(60)
        ]
    )
    batch = enqueue_batch(
        [(batch_tasks.item, [n], {}) for n in range(20)], on_finish=batch_tasks.callback
    )
    assert BlockedExecution.objects.filter(concurrency_key=KEYED).count() == 59
    total = Job.objects.count()
    before = bouncer.stats()
    began = time.monotonic()

    proc = workers_through_pgbouncer("--processes", "2", "--threads", "4")
    wait_until(
        lambda: not Job.objects.exclude(status__in=FINISHED_STATUSES).exists(),
        60,
        interval=0.2,
        what="every job finished",
    )
    drained = time.monotonic() - began

    # Where each process's connections go, while they are all still up.
    pids = dict(Process.objects.values_list("pid", "kind"))
    assert sorted(pids.values()) == ["dispatcher", "supervisor", "worker", "worker"]
    seen = {pid: tcp_connections(pid) for pid in pids}
    clients = {client["port"] for client in bouncer.clients()}
    still = {pid: tcp_connections(pid) for pid in pids}
    for pid, kind in pids.items():
        stable = set(seen[pid]) & set(still[pid])  # open before and after SHOW CLIENTS
        pooled = {local for local, remote in stable if remote == bouncer.port}
        straight = {local for local, remote in stable if remote == upstream_port(bouncer)}
        others = {remote for _, remote in stable} - {bouncer.port, upstream_port(bouncer)}
        assert pooled and pooled <= clients, (kind, pid, seen[pid], clients)
        assert not others, (kind, pid, seen[pid])
        if kind == "worker":
            # Exactly one connection past PgBouncer: this worker's listener.
            assert sorted(straight) == listener_ports(bouncer, pid), (pid, seen[pid])
            assert len(straight) == 1
        else:
            assert not straight, (kind, pid, seen[pid])
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    output = proc.output()

    jobs = {job.pk: job for job in Job.objects.all()}
    assert len(jobs) == total + 1 == 200 + 60 + 20 + 1  # and the batch's callback
    assert {job.status for job in jobs.values()} == {JobStatus.SUCCEEDED}, output[-3000:]
    assert [jobs[int(r.id)].return_value for r in plain] == [n + 1 for n in range(200)]
    assert [jobs[int(r.id)].attempts for r in keyed] == [1 + (n % 5 == 0) for n in range(60)]
    callback = Job.objects.get(task_path="tests.batch_tasks.callback")
    assert callback.return_value == {"batch_id": batch.id, "succeeded": 20, "failed": 0}
    # Never over-admitted: the audit the jobs wrote, not the queue's bookkeeping.
    runs = [(e.started, e.ended) for e in AuditEvent.objects.filter(key="one")]
    assert len(runs) == 60 + 12 and all(end is not None for _, end in runs)
    assert max_overlap(runs) == 1
    # Nothing left behind, every slot back.
    leftovers = [
        model.objects.count()
        for model in (ReadyExecution, ScheduledExecution, ClaimedExecution, BlockedExecution)
    ]
    assert leftovers == [0, 0, 0, 0]
    assert [(s.value, s.limit) for s in Semaphore.objects.all()] == [(1, 1)]
    # Every start, retry and finish went through PgBouncer.
    after = bouncer.stats()
    transactions = after["total_xact_count"] - before["total_xact_count"]
    assert transactions >= total
    for problem in ("deadlock", "does not exist", "Traceback", "database unavailable"):
        assert problem not in output, output[-3000:]
    connections_of = {
        kind: sorted(
            (sum(remote == bouncer.port for _, remote in seen[pid]), len(seen[pid]))
            for pid in pids
            if pids[pid] == kind
        )
        for kind in sorted(set(pids.values()))
    }
    figure(
        f"pgbouncer drain: {total} jobs in {drained:.1f}s, {transactions} transactions "
        f"through a pool of {bouncer.pool_size}, clients waited "
        f"{int(after['total_wait_time'] - before['total_wait_time']) / 1e6:.2f}s in all; "
        f"connections per process (to PgBouncer, in all): {connections_of}"
    )


@pytest.mark.workers
@pytest.mark.parametrize("sender", ["notifier", "enqueue"])
def test_a_job_enqueued_through_pgbouncer_wakes_an_idle_worker_listening_directly(
    sender, through_pgbouncer, workers_through_pgbouncer, monkeypatch
):
    """Polling every 30 s, a worker starts a job within seconds only if notified: the
    NOTIFY went through PgBouncer (from the enqueuing process's notifier, or from the
    enqueue's own statement in a quiet process), the LISTEN straight to PostgreSQL."""
    monkeypatch.setattr(notify, "INLINE_AFTER", math.inf if sender == "notifier" else 0.0)
    bouncer = through_pgbouncer
    proc = workers_through_pgbouncer(
        "--processes", "1", "--threads", "2", env={"JOBS_POLLING_INTERVAL": LONG_POLL}
    )
    wait_until(lambda: listening_workers(bouncer) == 1, 20, what="the worker LISTENing")
    worker = Process.objects.get(kind="worker")
    clients = bouncer.clients()
    assert not [c for c in clients if c["application_name"].startswith(LISTENER_NAME)]
    servers = {server["local_port"] for server in bouncer.show("SERVERS")}
    (listener_port,) = listener_ports(bouncer, worker.pid)
    assert listener_port not in servers  # not one of PgBouncer's server connections

    with notify_off():
        silent = tasks.add.enqueue(1, 1)
    holds_for(
        lambda: job_row(silent).status == JobStatus.READY,
        1.5,
        "a job made ready without a NOTIFY waits for the next poll, 30 s away",
    )
    notified = tasks.add.enqueue(2, 2)
    me = f"{notify.APPLICATION_NAME} pid={os.getpid()}"
    if sender == "notifier":
        wait_until(
            lambda: any(c["application_name"] == me for c in bouncer.clients()),
            5,
            what="this process's notifier connected through PgBouncer",
        )
    wait_until(
        lambda: {job_row(silent).status, job_row(notified).status} == {JobStatus.SUCCEEDED},
        WAKE,
        what="the notification to wake the worker",
    )
    notified = job_row(notified)
    assert (notified.started_at - notified.enqueued_at).total_seconds() < WAKE
    assert_through_pgbouncer(bouncer)
    if sender == "enqueue":
        assert notify.notifier_for("default").thread is None  # never needed
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]


def test_the_admin_works_through_pgbouncer(through_pgbouncer, admin_client, settings):
    """Every page (and the metrics) answers 200 and the operator's actions take effect,
    with every query of the requests (Django's test client, in this thread) going through
    PgBouncer."""
    bouncer = through_pgbouncer
    settings.DJANGO_JOBS = {
        **settings.DJANGO_JOBS,
        "recurring": {"nightly": {"task": "tests.tasks.add", "schedule": "0 3 * * *"}},
    }
    now = timezone.now()
    failed = FailedExecutionFactory(job__finished_at=now).job
    worker = ProcessFactory(metadata={"queues": ["*"], "threads": 1})
    running = JobFactory(status=JobStatus.RUNNING, started_at=now, last_attempted_at=now)
    ClaimedExecution.objects.create(job=running, process=worker, lease_expires_at=now)
    scheduled = ScheduledExecutionFactory(scheduled_at=now - timedelta(hours=2)).job_id
    holder, blocked, blocked_too = (int(one_at_a_time.enqueue(1).id) for _ in range(3))
    batch = enqueue_batch([(tasks.add, [1, 2], {})], description="b")
    before = bouncer.transactions()

    pages = [
        reverse("admin:app_list", args=["django_jobs"]),
        *(
            reverse(f"admin:django_jobs_{name}_changelist")
            for name in ("dashboard", "job", "blockedkey", "stuckjob", "process")
        ),
        reverse("admin:django_jobs_recurringtask_changelist"),
        reverse("admin:django_jobs_batch_changelist"),
        reverse("admin:django_jobs_job_changelist") + "?status__exact=failed",
        reverse("admin:django_jobs_job_changelist") + "?q=tests.tasks",
        *(
            reverse("admin:django_jobs_job_change", args=[pk])
            for pk in (failed.pk, running.pk, scheduled, holder, blocked)
        ),
        reverse("admin:django_jobs_process_change", args=[worker.pk]),
        reverse("admin:django_jobs_batch_change", args=[batch.id]),
    ]
    for url in pages:
        assert admin_client.get(url).status_code == 200, url
    if find_spec("prometheus_client") is not None:  # the metrics, read at scrape time
        metrics = admin_client.get("/jobs/metrics")
        assert metrics.status_code == 200 and b"django_jobs_" in metrics.content
    assert_through_pgbouncer(bouncer)

    def post(url: str, data: dict[str, Any] | None = None) -> None:
        assert admin_client.post(url, data or {}, follow=True).status_code == 200, url

    post(reverse("admin:django_jobs_job_retry", args=[failed.pk]))
    post(reverse("admin:django_jobs_job_discard", args=[blocked_too]))
    post(reverse("admin:django_jobs_dashboard_pause"), {"queue": "emails"})
    assert Pause.objects.filter(queue_name="emails").exists()
    post(reverse("admin:django_jobs_dashboard_resume"), {"queue": "emails"})
    # Drift on the key (its holder vanished without its slot), repaired by reconcile.
    ReadyExecution.objects.filter(job_id=holder).delete()
    Job.objects.filter(pk=holder).update(status=JobStatus.DISCARDED)
    post(reverse("admin:django_jobs_blockedkey_reconcile"), {"key": "tests.tasks.echo/acct:1"})

    assert job_row(failed.pk).status == JobStatus.READY
    assert job_row(blocked_too).status == JobStatus.DISCARDED
    assert job_row(blocked).status == JobStatus.READY
    assert not Pause.objects.exists()
    assert_through_pgbouncer(bouncer)
    assert bouncer.transactions() - before >= len(pages) + 5
    # And this test's queries never went to PostgreSQL directly.
    assert connection.settings_dict["PORT"] == str(bouncer.port)
