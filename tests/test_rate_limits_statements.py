"""A rate-limited start's statements behind the seam (``Operations.ensure_rate_rows``,
``lock_start_rows``, ``lock_rate_rows``, ``write_rated_starts``): the database's own
statements write what the portable ones write, and on PostgreSQL the locks of its
statements are what keeps a window's last start and a claim's start to one."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_jobs.core import rate_limits, starting
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import Waiting
from django_jobs.core.starting import start_jobs
from django_jobs.db import base, ops
from django_jobs.models import (
    ClaimedExecution,
    Job,
    JobStatus,
    Process,
    RateLimit,
    ReadyExecution,
    ScheduledExecution,
)
from tests import rate_tasks
from tests.batch_tasks import unique_while_waiting
from tests.test_races import Runner, wait_for
from tests.test_rate_limits import by_transaction, race_two_starters

DB = "default"
ALL = QueueSelector(("*",))

postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the statements of db/postgresql/rate_limits.py"
)


# --- the vendor's statements write what the portable ones write ------------------------------


def start_scenario(now) -> dict:
    """One start of seven claimed jobs: a 1/m key's first start and two sent back, two
    starts of a 3/s key, a due job that waited for its planned time (with an attempt
    before), and a job unique until it starts. Everything it wrote, by enqueue order."""
    worker = register_process(DB, "worker")
    enqueued = [
        *(rate_tasks.once_a_minute.enqueue(n) for n in range(3)),
        rate_tasks.call_api.enqueue("a"),
        rate_tasks.call_api.enqueue("a"),
        rate_tasks.call_api.enqueue("b"),
        unique_while_waiting.enqueue(7),
    ]
    ids = [int(result.id) for result in enqueued]
    reserved = now - timedelta(seconds=1)
    Job.objects.filter(pk=ids[5]).update(
        attempts=1,
        worker_ids=["earlier"],
        started_at=now - timedelta(minutes=5),
        rate_reserved_at=reserved,
    )
    RateLimit.objects.create(
        key="tests.rate_tasks.call_api/b",
        limit=3,
        period=1.0,
        starts=[now.timestamp() - 0.5],
        planned=[reserved.timestamp()],
    )
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    assert sorted(job.pk for job in claimed) == ids
    rate_limits.ensure_rate_rows(DB, {job.rate_key for job in claimed if job.rate_key}, now)
    written = starting.start_locked(DB, ids, worker.pk, worker.name, now)
    position = {pk: n for n, pk in enumerate(ids)}
    jobs = {job.pk: job for job in Job.objects.filter(pk__in=ids)}

    def named(worker_ids):  # each run registers a worker of its own name
        return [("this worker" if name == worker.name else name) for name in worker_ids]

    return {
        "written": {
            position[pk]: row
            if isinstance(row, Waiting)
            else row._replace(worker_ids=named(row.worker_ids))
            for pk, row in written.items()
        },
        "jobs": [
            (
                position[pk],
                job.status,
                job.attempts,
                named(job.worker_ids),
                job.started_at,
                job.last_attempted_at,
                job.rate_reserved_at,
                job.unique_lock,
            )
            for pk, job in sorted(jobs.items())
        ],
        "executions": sorted(
            [
                (position[pk], "claimed")
                for pk in ClaimedExecution.objects.values_list("pk", flat=True)
            ]
            + [
                (position[pk], "scheduled")
                for pk in ScheduledExecution.objects.values_list("pk", flat=True)
            ]
        ),
        "windows": sorted(
            RateLimit.objects.values_list(
                "key", "limit", "period", "starts", "planned", "updated_at"
            )
        ),
    }


def clear() -> None:
    for model in (ClaimedExecution, ReadyExecution, ScheduledExecution, Job, RateLimit, Process):
        model.objects.all().delete()


@pytest.mark.django_db(transaction=True)
def test_the_databases_statements_write_a_start_as_the_portable_ones_do(monkeypatch):
    now = timezone.now()
    vendor = start_scenario(now)
    clear()
    portable = base.Operations()
    for module in (starting, rate_limits):
        monkeypatch.setattr(module, "ops", lambda db: portable)
    assert start_scenario(now) == vendor
    # And what they wrote is the start the window decided.
    started = [row for row in vendor["jobs"] if row[1] == JobStatus.RUNNING]
    assert [row[0] for row in started] == [0, 3, 4, 5, 6]
    assert [row[0] for row in vendor["jobs"] if row[1] == JobStatus.SCHEDULED] == [1, 2]
    due = vendor["jobs"][5]
    assert due[2:] == (2, ["earlier", "this worker"], now - timedelta(minutes=5), now, None, None)
    assert vendor["jobs"][6][7] is None  # unique until its start: the key let go
    assert vendor["executions"] == [(0, "claimed"), (1, "scheduled"), (2, "scheduled")] + [
        (n, "claimed") for n in (3, 4, 5, 6)
    ]
    windows = {key: (starts, planned) for key, _, _, starts, planned, _ in vendor["windows"]}
    assert windows["tests.rate_tasks.call_api/b"] == (
        [now.timestamp() - 0.5, now.timestamp()],
        [now.timestamp()],
    )
    assert len(windows["tests.rate_tasks.call_api/a"][0]) == 2
    # 1/m: one start, and the last of the plan (now, a minute later, two minutes later).
    assert windows["tests.rate_tasks.once_a_minute"] == ([now.timestamp()], [now.timestamp() + 120])


@pytest.mark.django_db(transaction=True)
def test_ensuring_rows_creates_only_the_missing_ones_and_keeps_the_others():
    now = timezone.now()
    RateLimit.objects.create(key="kept", limit=4, period=2.0, starts=[1.0], planned=[1.0])
    ops(DB).ensure_rate_rows(DB, {"kept", "new-a", "new-b"}, now)
    ops(DB).ensure_rate_rows(DB, {"new-a"}, now)
    ops(DB).ensure_rate_rows(DB, set(), now)
    rows = RateLimit.objects.order_by("key").values_list(
        "key", "limit", "period", "starts", "planned"
    )
    assert list(rows) == [
        ("kept", 4, 2.0, [1.0], [1.0]),
        ("new-a", 1, 1.0, [], []),
        ("new-b", 1, 1.0, [], []),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_key_known_to_the_connection_whose_row_is_gone_is_made_sure_of_and_started(
    monkeypatch,
):
    """A start by the transaction skips making sure of rows its connection has seen; one
    pruned since (or flushed) sends the start back to make sure of it and start again,
    not its job to wait a second as for a row pruned between the two. (PostgreSQL's one
    statement makes sure of no row first: tests/test_rate_limits_one_statement.py.)"""
    from django_jobs.core.rate_limits import known_keys

    by_transaction(monkeypatch)
    worker = register_process(DB, "worker")
    first, second = (int(rate_tasks.call_api.enqueue("a").id) for _ in range(2))
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert [j.pk for j in start_jobs(DB, [job], worker.pk, worker.name)] == [first]
    assert "tests.rate_tasks.call_api/a" in known_keys(DB)
    RateLimit.objects.all().delete()  # pruned (its start long past), or a test's flush
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert [j.pk for j in start_jobs(DB, [job], worker.pk, worker.name)] == [second]
    row = RateLimit.objects.get()
    assert (row.key, len(row.starts)) == ("tests.rate_tasks.call_api/a", 1)
    assert Job.objects.get(pk=second).last_attempted_at.timestamp() == row.starts[0]


# --- PostgreSQL: the locks of its statements ---------------------------------------------------


def race_through_the_rate_lock(monkeypatch) -> int:
    """Two workers start one job each of a 1/m key; the first is paused right after the
    PostgreSQL statement that locks the key's row (``lock_rate_rows``) returned."""
    from django_jobs.db.postgresql import rate_limits as pg

    return race_two_starters(monkeypatch, pause_after=(pg, "lock_rate_rows"))


@postgresql
@pytest.mark.django_db(transaction=True)
def test_postgresql_rate_row_lock_lets_one_of_two_starts_take_the_last_start(monkeypatch):
    assert race_through_the_rate_lock(monkeypatch) == 1
    assert Job.objects.filter(status=JobStatus.RUNNING).count() == 1
    assert Job.objects.filter(status=JobStatus.SCHEDULED, attempts=0).count() == 1


@postgresql
@pytest.mark.django_db(transaction=True)
def test_postgresql_rate_rows_read_without_their_lock_let_both_start(monkeypatch):
    """The twin: the same statement without ``FOR UPDATE``."""
    from django_jobs.db.postgresql import rate_limits as pg

    unlocked = pg.lock_rate_statement(DB).replace(" FOR UPDATE", "")
    monkeypatch.setattr(pg, "lock_rate_statement", lambda db: unlocked)
    assert race_through_the_rate_lock(monkeypatch) == 2


def race_with_a_recovery(monkeypatch) -> list[Job]:
    """A start of a rate-limited job whose claim another transaction (a recovery) has
    locked and deleted, not yet committed; returns what the start started (by the one
    statement on PostgreSQL, unless the test took it away)."""
    rate_tasks.once_a_minute.enqueue(1)
    worker = register_process(DB, "worker")
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    deleted, done = threading.Event(), threading.Event()

    def recover() -> None:
        with transaction.atomic():
            claims = ClaimedExecution.objects.select_for_update().filter(job_id=job.pk)
            assert [claim.pk for claim in claims] == [job.pk]
            ClaimedExecution.objects.filter(job_id=job.pk).delete()
            deleted.set()
            assert done.wait(15)

    recovery = Runner(recover)
    recovery.start()
    assert deleted.wait(10)
    start = Runner(lambda: start_jobs(DB, [job], worker.pk, worker.name))
    start.start()
    wait_for(start.blocked_or_done, "the start")
    done.set()
    recovery.finish()
    return start.finish()


@postgresql
@pytest.mark.parametrize("path", ["one statement", "transaction"])
@pytest.mark.django_db(transaction=True)
def test_postgresql_start_waits_for_a_claims_lock_and_skips_a_claim_deleted_meanwhile(
    monkeypatch, path
):
    if path == "transaction":
        by_transaction(monkeypatch)
    assert race_with_a_recovery(monkeypatch) == []
    job = Job.objects.get()
    assert (job.status, job.attempts) == (JobStatus.CLAIMED, 0)


@postgresql
@pytest.mark.parametrize("path", ["one statement", "transaction"])
@pytest.mark.django_db(transaction=True)
def test_postgresql_claims_read_without_their_lock_start_a_job_being_recovered(monkeypatch, path):
    """The twin: the claims read without ``FOR UPDATE`` (in the one statement, or in the
    transaction's first statement) starts a job whose claim is being deleted."""
    from django_jobs.db.postgresql import rate_limits as pg

    if path == "transaction":
        by_transaction(monkeypatch)
        unlocked = pg.lock_start_statement(DB).replace(" FOR UPDATE", "")
        monkeypatch.setattr(pg, "lock_start_statement", lambda db: unlocked)
    else:
        one = pg.start_rated_statement(DB)
        unlocked = one.replace("ORDER BY job_id FOR UPDATE", "ORDER BY job_id")
        assert unlocked != one
        monkeypatch.setattr(pg, "start_rated_statement", lambda db: unlocked)
    assert len(race_with_a_recovery(monkeypatch)) == 1
    assert Job.objects.get().status == JobStatus.RUNNING
    assert not ClaimedExecution.objects.exists()


@postgresql
@pytest.mark.django_db(transaction=True)
def test_postgresql_rated_starts_prepared_decide_as_unprepared():
    """Bound on the server like the worker's other hot statements, so prepared where
    ``prepare_threshold`` allows: three rounds of a 3/s key's starts, prepared from the
    first use, each deciding on the window the round before wrote."""
    connection.ensure_connection()
    raw = connection.connection
    before = raw.prepare_threshold
    raw.prepare_threshold = 0
    try:
        worker = register_process(DB, "worker")
        ids = [int(rate_tasks.call_api.enqueue("a").id) for _ in range(5)]
        started = []
        for _ in range(3):
            claimed = claim_jobs(DB, worker.pk, ALL, 2)
            started += [job.pk for job in start_jobs(DB, claimed, worker.pk, worker.name)]
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements")
            prepared = [row[0] for row in cursor.fetchall()]
    finally:
        raw.prepare_threshold = before
    assert started == ids[:3]
    assert Job.objects.filter(pk__in=ids[3:4], status=JobStatus.SCHEDULED, attempts=0).count() == 1
    assert len(RateLimit.objects.get(key="tests.rate_tasks.call_api/a").starts) == 3
    # The first round by the one statement, the others (a job over the rate) by the
    # transaction's three.
    for opening in ("INSERT INTO", "WITH h AS", "WITH held AS", "SELECT", "WITH windows AS"):
        assert any(sql.startswith(opening) for sql in prepared), (opening, prepared)
