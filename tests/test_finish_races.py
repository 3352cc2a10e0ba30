"""Two workers writing batches at once, forced: no deadlock (docs/design.md invariant 6).

The cycle that made ebdd9c5 give each keyed success a transaction of its own
was not in the semaphores. It was in ``DELETE ... WHERE job_id IN (...)``: on
InnoDB that statement runs as a full scan of a small table (a few workers'
claims; the tail of a drained ready table), and a DELETE gets no
semi-consistent read in READ COMMITTED, so it waits for the lock of every row
it reads. Two finishing workers, each holding its own claims (locked by the
finish's first statement), each scan into the other's: deadlock (MariaDB's
log, 2026-11-23: two ``DELETE FROM django_jobs_claimedexecution WHERE job_id
IN (...)`` of interleaved ids, each waiting for a record the other held; the
same between two claimers deleting the ready rows they had picked). Single
keyed finishes deleted one row by its primary key, a point lookup, which is
why they never met it. ``deletion.delete_executions`` now deletes row by row
on MariaDB. Each test here holds two real connections, lets both lock their
own rows, then releases both into the delete at once with a barrier.
"""

from __future__ import annotations

import threading

import pytest
from django.db import OperationalError, connection, connections  # noqa: F401 (skipif strings)

from django_jobs.core.claimed import finish_jobs
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.db import ops
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    Semaphore,
)
from tests.test_races import ALL, DB, Runner, one_at_a_time

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
    ),
]
only_innodb = pytest.mark.skipif(
    "connection.vendor != 'mysql'",
    reason="only InnoDB's DELETE waits for rows it does not delete",
)
KEYS = 8


def in_one_statement(db, model, job_ids):
    """The delete as it was: one ``IN`` list (the unprotected twin), run as the full scan
    InnoDB chose for it on a small table. ``job_id + 0`` makes that plan certain: left to
    the planner, table statistics decided between the scan and point lookups, and the
    twin deadlocked in some runs only."""
    ids = list(job_ids)
    table = connections[db].ops.quote_name(model._meta.db_table)
    marks = ", ".join(["%s"] * len(ids))
    with connections[db].cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE job_id + 0 IN ({marks})", ids)
        return cursor.rowcount


def both_at_the_delete_of(monkeypatch, model, delete=None):
    """Make the first delete of ``model`` in each of two threads wait for the other."""
    barrier = threading.Barrier(2, timeout=10)
    seam = ops(DB)
    original = delete or seam.delete_executions

    def meet_then_delete(db, target, job_ids):
        if target is model:
            barrier.wait()
        return original(db, target, job_ids)

    monkeypatch.setattr(seam, "delete_executions", meet_then_delete)


def run_both(targets: dict, succeeded) -> dict[str, Exception]:
    """Run each target in a thread of its own; the database errors they raised, by name.

    A target that ends without an error must have done what ``succeeded`` says."""
    runners = {name: Runner(target) for name, target in targets.items()}
    for runner in runners.values():
        runner.start()
    errors: dict[str, Exception] = {}
    for name, runner in runners.items():
        try:
            assert succeeded(name, runner.finish())
        except OperationalError as exc:
            errors[str(name)] = exc
    return errors


def two_workers_finishing_interleaved_jobs(monkeypatch, delete=None) -> dict[str, Exception]:
    """Each of KEYS keys has a running holder and a blocked follower; the holders'
    claims alternate between two workers, so their ids interleave."""
    for value in range(KEYS):
        one_at_a_time.enqueue(value)
    for value in range(KEYS):
        one_at_a_time.enqueue(value)  # blocked behind its key's holder
    workers = [register_process(DB, "worker"), register_process(DB, "worker")]
    held: dict[int, dict[int, None]] = {worker.pk: {} for worker in workers}
    for turn in range(KEYS):
        worker = workers[turn % 2]
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert start_jobs(DB, [job], worker.pk, worker.name)
        held[worker.pk][job.pk] = None
    both_at_the_delete_of(monkeypatch, ClaimedExecution, delete)
    return run_both(
        {
            worker.pk: lambda worker=worker: finish_jobs(DB, worker.pk, held[worker.pk])
            for worker in workers
        },
        lambda worker_id, done: done == set(held[worker_id]),
    )


def test_two_finish_batches_of_interleaved_claims_do_not_deadlock(monkeypatch):
    assert two_workers_finishing_interleaved_jobs(monkeypatch) == {}
    assert Job.objects.filter(status=JobStatus.SUCCEEDED).count() == KEYS
    # Every key's follower was promoted in the same transactions; no slot leaked.
    assert ReadyExecution.objects.count() == KEYS
    assert not BlockedExecution.objects.exists()
    assert not ClaimedExecution.objects.exists()
    assert set(Semaphore.objects.values_list("value", flat=True)) == {0}


@only_innodb
def test_unprotected_finish_batches_deleting_in_one_statement_deadlock(monkeypatch):
    errors = two_workers_finishing_interleaved_jobs(monkeypatch, in_one_statement)
    assert len(errors) == 1, errors
    assert "deadlock" in str(next(iter(errors.values()))).lower()


def two_claimers_at_the_tail_of_the_queue(monkeypatch, delete=None) -> dict[str, Exception]:
    """Two workers each pick half of a few ready jobs, then delete the rows they picked."""
    for value in range(KEYS):
        one_at_a_time.enqueue(value)
    workers = [register_process(DB, "worker"), register_process(DB, "worker")]
    both_at_the_delete_of(monkeypatch, ReadyExecution, delete)
    # Queue caps take the ORM path on every database (PostgreSQL's one statement
    # has no delete of its own); a cap on a queue these workers do not serve locks
    # nothing and changes nothing else.
    caps = {"unused": 1}
    default = QueueSelector(("default",))
    return run_both(
        {
            worker.pk: lambda worker=worker: claim_jobs(DB, worker.pk, default, KEYS // 2, caps)
            for worker in workers
        },
        lambda worker_id, claimed: len(claimed) == KEYS // 2,
    )


def test_two_claimers_deleting_their_ready_rows_do_not_deadlock(monkeypatch):
    assert two_claimers_at_the_tail_of_the_queue(monkeypatch) == {}
    assert ClaimedExecution.objects.count() == KEYS
    assert not ReadyExecution.objects.exists()


@only_innodb
def test_unprotected_claimers_deleting_in_one_statement_deadlock(monkeypatch):
    errors = two_claimers_at_the_tail_of_the_queue(monkeypatch, in_one_statement)
    assert len(errors) == 1, errors
    assert "deadlock" in str(next(iter(errors.values()))).lower()
