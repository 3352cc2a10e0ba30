"""The single enqueue on PostgreSQL is sent with server-side binding, so psycopg prepares it
when the connection allows it (``OPTIONS["prepare_threshold"]``), and never when it does not
(Django's default, which transaction-mode poolers need). Either way the rows it writes are
those the ORM would have written."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from django.db import connection, transaction

from django_jobs.core.claimed import finish_jobs
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.models import Job, JobStatus, ReadyExecution
from tests import tasks
from tests import transition_tasks as tt

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="psycopg's prepared statements are PostgreSQL's"
    ),
]

DB = "default"
ALL = QueueSelector(("*",))
INSERT_PREFIX = 'WITH new_jobs AS (INSERT INTO "django_jobs_job"'


def prepared_inserts() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
            [INSERT_PREFIX.replace("_", r"\_") + "%"],
        )
        return cursor.fetchone()[0]


@pytest.fixture
def threshold() -> Iterator[Callable[[int | None], None]]:
    """Set the open connection's ``prepare_threshold`` as ``OPTIONS`` would; put it back."""
    connection.ensure_connection()
    raw = connection.connection
    before = raw.prepare_threshold

    def set_to(value: int | None) -> None:
        raw.prepare_threshold = value

    yield set_to
    raw.prepare_threshold = before


def test_prepared_when_the_connection_allows_it(threshold):
    threshold(0)  # prepare on first use
    results = [
        tasks.add.enqueue(1, 2),
        tasks.add.enqueue(3, 4),
        tasks.echo.enqueue({"nested": ["value", None, 1.5]}),
        tasks.add.using(priority=-3).enqueue(5, 6),
    ]
    with transaction.atomic():
        results.append(tasks.add.enqueue(7, 8))
    # Two shapes: add/echo set the same columns; the priority differs in value only.
    assert prepared_inserts() >= 1
    jobs = {job.pk: job for job in Job.objects.all()}
    ids = [int(result.id) for result in results]
    assert sorted(jobs) == sorted(ids)
    assert [jobs[pk].args for pk in ids] == [
        [1, 2],
        [3, 4],
        [{"nested": ["value", None, 1.5]}],
        [5, 6],
        [7, 8],
    ]
    assert jobs[ids[2]].queue_name == "emails" and jobs[ids[2]].priority == 5
    assert jobs[ids[3]].priority == -3
    ready = {row.job_id: row for row in ReadyExecution.objects.all()}
    assert sorted(ready) == sorted(jobs)
    for job in jobs.values():
        assert job.status == JobStatus.READY
        assert ready[job.pk].queue_name == job.queue_name
        assert ready[job.pk].priority == job.priority
        assert abs(ready[job.pk].created_at - job.enqueued_at) < timedelta(microseconds=1)


def test_nothing_prepared_by_default(threshold):
    threshold(None)  # Django's default: transaction-mode poolers lose named statements
    for n in range(10):
        tasks.add.enqueue(n, n)
    assert prepared_inserts() == 0
    assert ReadyExecution.objects.count() == Job.objects.count() == 10


def test_claim_start_and_finish_prepared_when_the_connection_allows_it(threshold):
    """The worker's hot statements go the same way: bound on the server, prepared on
    their first use here, with the same outcome as unprepared."""
    threshold(0)
    worker = register_process(DB, "worker")
    keyed = [tt.two_at_a_time.enqueue("k", n) for n in range(2)]
    plain = [tasks.add.enqueue(n, 1) for n in range(3)]
    rounds = 0
    while claimed := claim_jobs(DB, worker.pk, ALL, 2):  # from round 2, prepared ones
        started = start_jobs(DB, claimed, worker.pk, worker.name)
        finished = finish_jobs(DB, worker.pk, {job.pk: job.pk * 10 for job in started}, started)
        assert finished == {job.pk for job in started} == {job.pk for job in claimed}
        rounds += 1
    assert rounds == 3
    assert {job.pk: (job.status, job.return_value, job.attempts) for job in Job.objects.all()} == {
        int(result.id): (JobStatus.SUCCEEDED, int(result.id) * 10, 1) for result in keyed + plain
    }
    assert not ReadyExecution.objects.exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    # The claim is never prepared (cursors.unprepared_cursor); the start and finish are.
    assert not any(sql.startswith("WITH picked AS") for sql in prepared), prepared
    assert any(sql.startswith('UPDATE "django_jobs_job"') for sql in prepared), prepared


def rows_read_whole(tables: tuple[str, ...]) -> int:
    """Rows the server has read from ``tables`` by sequential scans, this session's
    reads included: its pending counts are flushed at the end of the first statement,
    read by the second."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT COALESCE(sum(seq_tup_read), 0) FROM pg_stat_user_tables "
            "WHERE relname = ANY(%s)",
            [list(tables)],
        )
        return int(cursor.fetchone()[0])


def test_statements_first_run_on_empty_tables_still_read_a_backlog_by_key(threshold):
    """A worker claims while its queue is idle, long before a backlog comes. Had the
    claim been prepared then, its generic plan, made for near-empty tables, would read
    the ready and job tables whole at every claim once they fill up (measured: 3.7 to
    4.1 ms a claim at 10,000 ready jobs instead of 0.7 to 0.9). Here the claims on
    empty tables come first, on a connection that prepares at once, and a dozen jobs
    go through the start and finish (prepared, planned for a job table of a dozen
    rows); then a backlog of 10,000, and none of the three may read a table whole
    (with the claim prepared, it read 20,003 rows)."""
    if connection.pg_version < 150000:
        pytest.skip("pg_stat_force_next_flush() came with PostgreSQL 15")
    threshold(0)
    worker = register_process(DB, "worker")
    for _ in range(12):  # past the five custom plans after which the server goes generic
        assert claim_jobs(DB, worker.pk, ALL, 8) == []
    for n in range(12):
        tasks.add.enqueue(n, n)
        run_through(worker, 1)
    tasks.add.get_backend().bulk_enqueue([(tasks.add, (n, n), {}) for n in range(10000)])
    tables = (Job._meta.db_table, ReadyExecution._meta.db_table, "django_jobs_claimedexecution")
    read = [rows_read_whole(tables)]
    run_through(worker, 8, then=lambda: read.append(rows_read_whole(tables)))
    read.append(rows_read_whole(tables))
    claim, start, finish = (after - before for before, after in itertools.pairwise(read))
    assert (claim < 100, start < 100, finish < 100) == (True, True, True), (claim, start, finish)


def run_through(worker, count: int, then=lambda: None) -> None:
    """Claim ``count`` jobs, start and finish them; ``then`` runs after each step but
    the last."""
    claimed = claim_jobs(DB, worker.pk, ALL, count)
    assert len(claimed) == count
    then()
    started = start_jobs(DB, claimed, worker.pk, worker.name)
    then()
    finished = finish_jobs(DB, worker.pk, {job.pk: 1 for job in started}, started)
    assert finished == {job.pk for job in claimed}
