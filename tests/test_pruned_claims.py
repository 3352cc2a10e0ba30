"""A process pruned as dead claims nothing more, so no outcome of its lands on a later attempt.

A worker pruned while it still runs (a long pause, a clock jump: docs/design.md section 5)
goes on claiming until its next heartbeat finds its row gone. Before, its claims were
written under its old process id whatever the registry said, and the prune recovered a
process's claims before deleting its row: the recovery could put a job back to ready, the
same worker claim it again (attempt 2) under the same id, and attempt 1's late outcome then
found "its" claim (``lock_own_claim`` matches job and process) and ended attempt 2 with it.
With a concurrency key that frees the slot while attempt 2 still runs: two jobs of a key of
limit 1 running at once, the over-admission the limits exist to prevent.

Now the prune deletes the row first and recovers after (``core.processes``), and every claim
path checks its process row before it takes a ready row: locked on the statements' path
(``Operations.lock_own_process``) and in the claim procedure of MySQL/MariaDB, so that a claim
either commits before the delete, and the recovery that follows sees it, or claims nothing;
read in the snapshot of PostgreSQL's one statement, which never shows both the row and a job
the prune recovered (``db/postgresql/claims.py``).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from django_jobs.core.claimed import fail_job, finish_job, snooze_job
from django_jobs.core.lanes import Lane
from django_jobs.core.processes import prune_dead_processes, register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.db import ops
from django_jobs.models import ClaimedExecution, Job, JobStatus, Process, Semaphore
from tests import transition_tasks as tt
from tests.transition_tasks import DB, InThread, backend_id, is_waiting_for_row_lock, wait_until

ALL = QueueSelector(("*",))
NAMED = QueueSelector(("default",))
ALIVE_THRESHOLD = 60.0
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")

# Every way a worker claims: the one statement (PostgreSQL) or procedure (MySQL/MariaDB) of
# the usual claim, a lane's claim and a capped queue's (the statements' path everywhere but
# PostgreSQL's lane), for named queues and for "*".
CLAIMS = {
    "every-queue": dict(selector=ALL),
    "named-queue": dict(selector=NAMED),
    "lane": dict(selector=ALL, lane=Lane.SYNC),
    "capped": dict(selector=ALL, caps={"default": 100}),
}


def claim_as(process_id: int, way: str, limit: int = 10) -> list[Job]:
    options = dict(CLAIMS[way])
    selector = options.pop("selector")
    return claim_jobs(DB, process_id, selector, limit, worker_id=f"w{process_id}", **options)


def make_stale(process: Process) -> None:
    """Its heartbeat as old as a dead process's: the next prune takes it."""
    Process.objects.filter(pk=process.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=10 * ALIVE_THRESHOLD)
    )


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


@pytest.fixture
def worker(db) -> Process:
    return register_process(DB, Process.Kind.WORKER)


@pytest.mark.django_db
@pytest.mark.parametrize("way", sorted(CLAIMS))
def test_a_process_whose_row_is_gone_claims_nothing(worker, way):
    made = [int(tt.noop.enqueue(n).id) for n in range(3)]
    Process.objects.filter(pk=worker.pk).delete()
    assert claim_as(worker.pk, way) == []
    assert not ClaimedExecution.objects.exists()
    assert [status(pk) for pk in made] == [JobStatus.READY] * 3
    # The same claim by a live process takes them: the claim was refused for its process.
    alive = register_process(DB, Process.Kind.WORKER)
    assert sorted(job.pk for job in claim_as(alive.pk, way)) == made


@pytest.mark.django_db
@pytest.mark.parametrize("way", sorted(CLAIMS))
def test_a_late_outcome_of_a_falsely_pruned_worker_never_ends_its_next_attempt(worker, way):
    """The whole story: attempt 1 runs in ``worker``, which is pruned while it runs; it
    claims again before its heartbeat notices; attempt 2 runs elsewhere; attempt 1's late
    outcome must end nothing, and its key's one slot stay taken by attempt 2."""
    first = int(tt.one_at_a_time_retried.enqueue("x").id)  # limit 1, 3 attempts, backoff 0
    (job,) = claim_as(worker.pk, way)
    assert (job.pk, job.status, job.attempts) == (first, JobStatus.RUNNING, 1)

    make_stale(worker)
    assert prune_dead_processes(DB, ALIVE_THRESHOLD) == {first: "retried"}
    assert status(first) == JobStatus.READY
    # The pruned worker's claim loop, before its heartbeat finds the row gone.
    assert claim_as(worker.pk, way) == []

    other = register_process(DB, Process.Kind.WORKER)
    (again,) = claim_as(other.pk, way)
    assert (again.pk, again.attempts) == (first, 2)

    # Attempt 1 ends late, whichever way it ends: none of them lands.
    assert not finish_job(DB, first, worker.pk, "attempt 1")
    assert fail_job(DB, first, worker.pk, BOOM) is None
    assert snooze_job(DB, first, worker.pk, 0) is None
    assert ClaimedExecution.objects.get(job_id=first).process_id == other.pk
    row = Job.objects.get(pk=first)
    assert (row.status, row.attempts, row.return_value) == (JobStatus.RUNNING, 2, None)
    # Attempt 2 still holds the key's one slot.
    second = int(tt.one_at_a_time.enqueue("x").id)
    assert status(second) == JobStatus.BLOCKED
    assert Semaphore.objects.get(key="one/x").value == 0

    assert finish_job(DB, first, other.pk, "attempt 2")
    assert Job.objects.get(pk=first).return_value == "attempt 2"
    assert status(second) == JobStatus.READY


def prune_recovering_first(db: str, alive_threshold: float, *, meanwhile) -> None:
    """The twin's prune, the order this project had: each stale process's claims recovered,
    ``meanwhile()`` (the pruned worker's claim loop), then its row deleted."""
    cutoff = timezone.now() - timedelta(seconds=alive_threshold)
    for process in Process.objects.filter(last_heartbeat_at__lt=cutoff):
        recover_process_claims(db, process.pk, "stopped heartbeating")
        meanwhile()
        Process.objects.filter(pk=process.pk, last_heartbeat_at__lt=cutoff).delete()


@pytest.mark.django_db
def test_twin_recovering_before_the_delete_lets_the_late_outcome_end_the_next_attempt(worker):
    """The twin of the test above with the old order of the prune: the recovered job is
    claimed again by the pruned worker, under its old id; attempt 1's outcome then ends
    attempt 2 and frees the key's slot while attempt 2 runs, and attempt 2's is lost."""
    first = int(tt.one_at_a_time_retried.enqueue("x").id)
    claim_as(worker.pk, "every-queue")
    make_stale(worker)
    reclaimed: list[Job] = []
    prune_recovering_first(
        DB, ALIVE_THRESHOLD, meanwhile=lambda: reclaimed.extend(claim_as(worker.pk, "every-queue"))
    )
    assert [(job.pk, job.attempts) for job in reclaimed] == [(first, 2)]
    assert finish_job(DB, first, worker.pk, "attempt 1")  # ends attempt 2
    second = int(tt.one_at_a_time.enqueue("x").id)
    assert status(second) == JobStatus.READY  # beside attempt 2: limit 1 over-admitted
    assert not finish_job(DB, first, worker.pk, "attempt 2")
    assert Job.objects.get(pk=first).return_value == "attempt 1"


def delete_held_open(process_id: int, deleted: threading.Event, release: threading.Event) -> None:
    """The prune's delete of ``process_id``'s row, in a transaction held open (its row lock
    with it) until ``release``; then, committed, the recovery of the process's claims, as
    ``prune_dead_processes`` does them."""
    with transaction.atomic(using=DB):
        assert Process.objects.filter(pk=process_id).delete()[0] == 1
        deleted.set()
        assert release.wait(tt.TIMEOUT), "the test never released the delete"
    recover_process_claims(DB, process_id, "no longer exists")


row_locks = pytest.mark.skipif(
    not tt.has_row_locks(), reason="SQLite runs one write transaction at a time: no race"
)
# The claims that lock their process row: every one on MySQL/MariaDB (the procedure and the
# statements), the statements' (a capped queue's) on PostgreSQL, whose one statement only
# reads it in its snapshot (db/postgresql/claims.py says why that is enough, and what a
# claim racing the delete leaves: test_a_one_statement_claim_racing_the_delete_...).
LOCKING = sorted(CLAIMS) if tt.vendor() != "postgresql" else ["capped"]


@row_locks
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("way", LOCKING)
def test_a_claim_racing_the_delete_of_its_process_row_waits_then_claims_nothing(worker, way):
    made = [int(tt.noop.enqueue(n).id) for n in range(3)]
    deleted, release = threading.Event(), threading.Event()
    pruner = InThread(delete_held_open, worker.pk, deleted, release)
    assert deleted.wait(tt.TIMEOUT)
    session: dict[str, int] = {}

    def claim() -> list[Job]:
        session["id"] = backend_id()
        return claim_as(worker.pk, way)

    claimer = InThread(claim)
    waited = wait_until(lambda: "id" in session and is_waiting_for_row_lock(session["id"]))
    release.set()
    pruner.join()
    assert waited, "the claim never waited for its process row"
    assert claimer.join() == []
    assert not ClaimedExecution.objects.exists()
    assert [status(pk) for pk in made] == [JobStatus.READY] * 3


@row_locks
@pytest.mark.django_db(transaction=True)
def test_twin_a_claim_that_reads_its_process_row_unlocked_leaves_claims_nobody_recovers(
    worker, monkeypatch
):
    """The twin: a claim that only reads its process row (no lock) sees it while the
    prune's delete is uncommitted, and commits its claims after the prune's recovery has
    come and gone: claims of a process that no longer exists, left until the next prune
    (and the zombie worker runs them meanwhile)."""
    made = [int(tt.noop.enqueue(n).id) for n in range(3)]
    checked, recovered = threading.Event(), threading.Event()
    seam = type(ops(DB))

    def read_unlocked(self, db: str, process_id: int) -> bool:
        found = Process.objects.using(db).filter(pk=process_id).exists()
        checked.set()
        assert recovered.wait(tt.TIMEOUT), "the prune never ended"
        return found

    monkeypatch.setattr(seam, "lock_own_process", read_unlocked)
    deleted, release = threading.Event(), threading.Event()
    pruner = InThread(delete_held_open, worker.pk, deleted, release)
    assert deleted.wait(tt.TIMEOUT)
    claimer = InThread(claim_as, worker.pk, "capped")
    assert checked.wait(tt.TIMEOUT)
    release.set()
    pruner.join()
    recovered.set()
    assert sorted(job.pk for job in claimer.join()) == made
    assert not Process.objects.filter(pk=worker.pk).exists()
    assert ClaimedExecution.objects.filter(process_id=worker.pk).count() == 3


@pytest.mark.skipif(tt.vendor() != "postgresql", reason="PostgreSQL's one-statement claim")
@pytest.mark.django_db(transaction=True)
def test_a_one_statement_claim_racing_the_delete_is_recovered_with_the_rest(worker):
    """PostgreSQL's one statement reads its process row in its snapshot, unlocked: run while
    the prune's delete is uncommitted, it does not wait, sees the row and claims; the
    prune's recovery, once the delete has committed, finds those claims. (One that
    committed after that recovery, which no test can order inside one statement, is the
    next prune's: its sweep of claims without a process; the last assertion is that sweep
    finding nothing left.)"""
    made = [int(tt.noop.enqueue(n).id) for n in range(3)]
    deleted, release = threading.Event(), threading.Event()
    pruner = InThread(delete_held_open, worker.pk, deleted, release)
    assert deleted.wait(tt.TIMEOUT)
    claimed = InThread(claim_as, worker.pk, "every-queue").join()  # it does not wait
    assert sorted(job.pk for job in claimed) == made
    release.set()
    pruner.join()
    prune_dead_processes(DB, ALIVE_THRESHOLD)
    assert not ClaimedExecution.objects.exists()
    assert {status(pk) for pk in made} == {JobStatus.FAILED}  # started at claim, 1 attempt
