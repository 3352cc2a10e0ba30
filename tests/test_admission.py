"""Admission through a key's semaphore, in-process, on the real database.

A smoke level of the concurrency protocol (docs/design.md section 4): N slots admit
N, a finish promotes exactly one in its own transaction, the free count never
passes the limit, drift is repaired; and the enqueue/finish race (Solid Queue
#456 / PR #712) forced with two connections.
"""

from __future__ import annotations

import threading

import pytest
from django.db import OperationalError, connection, transaction

from django_jobs import bulk_enqueue
from django_jobs.core import admission
from django_jobs.core.admission import reconcile_key, release_slot
from django_jobs.core.claimed import finish_job, finish_jobs
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_job
from django_jobs.db.postgresql import admission as pg_admission
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    Semaphore,
)
from tests import transition_tasks as tt
from tests.factories import (
    BlockedExecutionFactory,
    ClaimedExecutionFactory,
    JobFactory,
    SemaphoreFactory,
)
from tests.transition_tasks import (
    DB,
    TIMEOUT,
    InThread,
    backend_id,
    has_row_locks,
    is_waiting_for_row_lock,
    vendor,
    wait_until,
)

ALL = QueueSelector(("*",))


@pytest.fixture
def worker(db):
    return register_process(DB, "worker")


def enqueue(task, *args) -> int:
    return int(task.enqueue(*args).id)


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


def statuses(job_ids) -> list[str]:
    return [status(job_id) for job_id in job_ids]


def semaphore(key: str) -> tuple[int, int]:
    row = Semaphore.objects.get(key=key)
    return row.limit, row.value


def holders(key: str) -> int:
    return (
        ReadyExecution.objects.filter(concurrency_key=key).count()
        + ClaimedExecution.objects.filter(concurrency_key=key).count()
    )


def run_next(worker) -> Job:
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert start_job(DB, job, worker.pk, worker.name)
    return job


R, B = JobStatus.READY, JobStatus.BLOCKED


@pytest.mark.django_db
class TestAdmit:
    def test_a_limit_of_n_admits_the_first_n_and_blocks_the_rest(self):
        jobs = [enqueue(tt.two_at_a_time, "x", n) for n in range(5)]
        assert statuses(jobs) == [R, R, B, B, B]
        assert semaphore("two/x") == (2, 0)
        assert BlockedExecution.objects.filter(concurrency_key="two/x").count() == 3
        assert holders("two/x") == 2

    def test_a_bulk_enqueue_admits_the_highest_priorities(self):
        results = bulk_enqueue(
            [(tt.two_at_a_time.using(priority=p), ["x"], {}) for p in (1, 5, 3, 9, 0)]
        )
        jobs = [int(r.id) for r in results]
        assert statuses(jobs) == [B, R, B, R, B]  # priorities 5 and 9 hold the slots
        assert semaphore("two/x") == (2, 0)

    def test_each_key_has_its_own_slots(self):
        x1, x2 = enqueue(tt.one_at_a_time, "x"), enqueue(tt.one_at_a_time, "x")
        y1 = enqueue(tt.one_at_a_time, "y")
        keyless = enqueue(tt.noop)
        assert statuses([x1, x2, y1, keyless]) == [R, B, R, R]
        assert semaphore("one/x") == (1, 0) and semaphore("one/y") == (1, 0)

    def test_a_raised_limit_promotes_the_blocked_jobs_first(self):
        """A new declaration raises the limit 1 -> 3: the job already blocked takes one
        of the new slots (never left behind a free slot), the new job the other."""
        a = enqueue(tt.one_at_a_time, "x")
        b = enqueue(tt.one_at_a_time, "x")
        assert statuses([a, b]) == [R, B]
        c = enqueue(tt.one_at_a_time.using(concurrency_limit=3), "x")
        assert statuses([a, b, c]) == [R, R, R]
        assert semaphore("one/x") == (3, 0)
        d = enqueue(tt.one_at_a_time.using(concurrency_limit=3), "x")
        assert status(d) == B

    def test_a_lowered_limit_blocks_until_holders_drop_below_it(self, worker):
        a, b = enqueue(tt.two_at_a_time, "x"), enqueue(tt.two_at_a_time, "x")
        c = enqueue(tt.two_at_a_time.using(concurrency_limit=1), "x")
        assert statuses([a, b, c]) == [R, R, B]
        assert semaphore("two/x") == (1, -1)
        run_next(worker)
        assert finish_job(DB, a, worker.pk, None)
        assert status(c) == B  # B still holds the one slot
        run_next(worker)
        assert finish_job(DB, b, worker.pk, None)
        assert status(c) == R
        assert semaphore("two/x") == (1, 0)


@pytest.mark.django_db
class TestFinishPromotes:
    def test_a_finish_promotes_exactly_one_blocked_job(self, worker):
        jobs = [enqueue(tt.two_at_a_time, "x", n) for n in range(5)]
        first = run_next(worker)
        assert finish_job(DB, first.pk, worker.pk, None)
        assert statuses(jobs) == [JobStatus.SUCCEEDED, R, R, B, B]
        assert semaphore("two/x") == (2, 0)

    def test_the_next_is_chosen_by_priority_then_age(self, worker):
        a = enqueue(tt.one_at_a_time, "x")
        low = enqueue(tt.one_at_a_time.using(priority=1), "x")
        high_old = enqueue(tt.one_at_a_time.using(priority=5), "x")
        high_new = enqueue(tt.one_at_a_time.using(priority=5), "x")
        order = []
        for _ in range(4):
            job = run_next(worker)
            order.append(job.pk)
            assert holders("one/x") == 1
            assert finish_job(DB, job.pk, worker.pk, None)
        assert order == [a, high_old, high_new, low]
        assert semaphore("one/x") == (1, 1)
        assert not BlockedExecution.objects.exists()

    def test_draining_a_key_never_holds_more_than_the_limit(self, worker):
        jobs = [enqueue(tt.two_at_a_time, "x", n) for n in range(7)]
        while claimed := claim_jobs(DB, worker.pk, ALL, 10):
            assert len(claimed) <= 2 and holders("two/x") <= 2
            for job in claimed:
                start_job(DB, job, worker.pk, worker.name)
                assert finish_job(DB, job.pk, worker.pk, None)
        assert set(statuses(jobs)) == {JobStatus.SUCCEEDED}
        assert semaphore("two/x") == (2, 2)

    def test_the_finish_and_the_promotion_are_one_transaction(self, worker, monkeypatch):
        """Solid Queue #689 item 5: a crash between the finish and the promotion must
        roll the finish back too, leaving the claim for recovery, not a freed slot
        with the next job still blocked."""
        a = enqueue(tt.one_at_a_time, "x")
        run_next(worker)
        b = enqueue(tt.one_at_a_time, "x")

        def crash(*args, **kwargs):
            raise RuntimeError("killed between finish and promotion")

        # The promotion: the ORM's writes, or PostgreSQL's one statement
        # (db/postgresql/admission.py).
        monkeypatch.setattr(admission, "make_ready", crash)
        monkeypatch.setattr(pg_admission, "recount_and_promote", crash)
        with pytest.raises(RuntimeError):
            finish_job(DB, a, worker.pk, "done")
        monkeypatch.undo()
        job = Job.objects.get(pk=a)
        assert (job.status, job.return_value, job.finished_at) == (JobStatus.RUNNING, None, None)
        assert ClaimedExecution.objects.filter(job_id=a, process_id=worker.pk).exists()
        assert status(b) == B and semaphore("one/x") == (1, 0)
        # Nothing was lost: the finish can still happen, once.
        assert finish_job(DB, a, worker.pk, "done")
        assert status(a) == JobStatus.SUCCEEDED and status(b) == R


@pytest.mark.django_db(transaction=True)
def test_the_one_message_keyed_finish_is_all_or_nothing(worker):
    """PostgreSQL sends a keyed finish, its semaphores' lock and the promotion as three
    statements in one message (db/postgresql/claims.py, finish_keyed): the server must run them as
    one transaction, so a promotion that fails takes the finish back too. Sent as
    three transactions, the finish would stay and the blocked job would be stranded."""
    if vendor() != "postgresql":
        pytest.skip("the one-message finish is PostgreSQL's")
    a = enqueue(tt.one_at_a_time, "x")
    job = run_next(worker)
    known = [job]  # the worker's copy: a key, no batch
    b = enqueue(tt.one_at_a_time, "x")
    assert status(b) == B
    held, release = threading.Event(), threading.Event()

    def hold_the_blocked_row() -> None:
        # The promotion deletes this row: it waits for this lock, then gives up.
        with transaction.atomic():
            assert list(BlockedExecution.objects.select_for_update().filter(job_id=b))
            held.set()
            release.wait(TIMEOUT)

    holder = InThread(hold_the_blocked_row)
    assert held.wait(TIMEOUT)
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '300ms'")
    try:
        with pytest.raises(OperationalError, match="lock timeout"):
            finish_jobs(DB, worker.pk, {a: "done"}, known)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
        release.set()
        holder.join()
    row = Job.objects.get(pk=a)
    assert (row.status, row.return_value, row.finished_at) == (JobStatus.RUNNING, None, None)
    assert ClaimedExecution.objects.filter(job_id=a, process_id=worker.pk).exists()
    assert status(b) == B and semaphore("one/x") == (1, 0)
    # Once the row is free, the same call does all three, once.
    assert finish_jobs(DB, worker.pk, {a: "done"}, known) == {a}
    assert status(a) == JobStatus.SUCCEEDED and status(b) == R
    assert semaphore("one/x") == (1, 0)


@pytest.mark.django_db
class TestSlotCount:
    def test_repeated_releases_never_raise_the_free_count_above_the_limit(self, worker):
        a = enqueue(tt.two_at_a_time, "x")
        for _ in range(5):
            with transaction.atomic():
                release_slot(DB, "two/x")
        assert semaphore("two/x") == (2, 1)  # A still holds one of the two
        run_next(worker)
        assert finish_job(DB, a, worker.pk, None)
        for _ in range(5):
            with transaction.atomic():
                release_slot(DB, "two/x")
        assert semaphore("two/x") == (2, 2)

    def test_repeated_releases_promote_no_more_than_the_free_slots(self):
        jobs = [enqueue(tt.one_at_a_time, "x", n) for n in range(4)]
        for _ in range(5):
            with transaction.atomic():
                release_slot(DB, "one/x")
        assert statuses(jobs) == [R, B, B, B]
        assert semaphore("one/x") == (1, 0)

    def test_reconcile_repairs_a_semaphore_that_says_too_few_free(self):
        a = enqueue(tt.two_at_a_time.using(concurrency_limit=3), "x")
        blocked = [
            BlockedExecutionFactory(job__concurrency_key="two/x", concurrency_key="two/x").job_id
            for _ in range(4)
        ]
        Semaphore.objects.filter(key="two/x").update(value=0)  # drifted: 2 are free
        with transaction.atomic():
            assert reconcile_key(DB, "two/x") == 2
        assert status(a) == R
        assert statuses(blocked) == [R, R, B, B]
        assert semaphore("two/x") == (3, 0)

    def test_reconcile_repairs_a_semaphore_that_says_too_many_free(self):
        SemaphoreFactory(key="k", limit=1, value=5)
        ClaimedExecutionFactory(job=JobFactory(status=JobStatus.RUNNING, concurrency_key="k"))
        blocked = BlockedExecutionFactory(job__concurrency_key="k", concurrency_key="k").job_id
        with transaction.atomic():
            assert reconcile_key(DB, "k") == 0
        assert status(blocked) == B
        assert semaphore("k") == (1, 0)

    def test_reconcile_of_an_unknown_key_does_nothing(self):
        with transaction.atomic():
            assert reconcile_key(DB, "nobody") == 0
        assert not Semaphore.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_first_enqueues_of_a_new_key_at_once_create_one_semaphore():
    """Six connections enqueue the first jobs of a fresh key together, five times
    over: one semaphore row per key, exactly two admitted, and no deadlock (on
    MariaDB, INSERT IGNORE of the new semaphore row deadlocked here)."""
    threads = 6
    for round_ in range(5):
        name = f"fresh{round_}"
        barrier = threading.Barrier(threads, timeout=20)

        def enqueue_together(n: int, name: str = name, barrier=barrier) -> int:
            barrier.wait()
            return enqueue(tt.two_at_a_time, name, n)

        runners = [InThread(enqueue_together, n) for n in range(threads)]
        job_ids = [runner.join() for runner in runners]
        assert Semaphore.objects.filter(key=f"two/{name}").count() == 1
        assert sorted(statuses(job_ids)) == [B] * (threads - 2) + [R, R]
        assert semaphore(f"two/{name}") == (2, 0)


pause_here = threading.local()


@pytest.mark.django_db(transaction=True)
def test_enqueue_racing_a_finish_never_strands_the_blocked_job(monkeypatch):
    """Solid Queue #456 / PR #712, forced on two connections.

    A holds the only slot of key one/r and is running. B's enqueue locks the
    semaphore, reads "no slot free", and is paused right there, before it
    inserts its blocked row. A's finish runs on another connection, then B
    commits. B must end up ready: no job may stay blocked behind a free slot.

    The protection is the ``select_for_update()`` in
    ``django_jobs.core.admission.lock_semaphore`` (``semaphores =
    Semaphore.objects.using(db).select_for_update()``): A's finish must lock
    the same semaphore row to free the slot, so it waits until B commits and
    then sees B's blocked row and promotes it. Without that lock A frees the
    slot, finds nothing blocked and commits; B then writes its stale "0 free"
    and inserts its blocked row: stranded (verified by removing it).

    PostgreSQL/MariaDB: B is released only once the database reports A waiting
    for a row lock (or A finished: the unprotected order). SQLite has no row
    locks; B's BEGIN IMMEDIATE transaction makes A's wait at its BEGIN, which
    serialises the two the same way.
    """
    worker = register_process(DB, "worker")
    a = enqueue(tt.one_at_a_time, "r")
    run_next(worker)
    b_locked, go_b = threading.Event(), threading.Event()
    real_lock = admission.lock_semaphore

    def lock_then_pause(db, key, limit):
        locked = real_lock(db, key, limit)
        if getattr(pause_here, "active", False):
            b_locked.set()
            assert go_b.wait(30)
        return locked

    monkeypatch.setattr(admission, "lock_semaphore", lock_then_pause)

    def enqueue_b() -> int:
        pause_here.active = True
        return enqueue(tt.one_at_a_time, "r")

    session: list[int] = []
    a_about_to_finish = threading.Event()

    def finish_a() -> bool:
        if has_row_locks():
            session.append(backend_id())
        a_about_to_finish.set()
        return finish_job(DB, a, worker.pk, "done")

    enqueuer = InThread(enqueue_b)
    finisher = None
    try:
        assert b_locked.wait(20)
        finisher = InThread(finish_a)
        assert a_about_to_finish.wait(20)
        if has_row_locks():
            assert wait_until(
                lambda: finisher.done.is_set() or is_waiting_for_row_lock(session[0])
            ), "A's finish neither finished nor waited for the semaphore lock"
    finally:
        go_b.set()
    b = enqueuer.join()
    assert finisher.join()
    assert status(a) == JobStatus.SUCCEEDED
    assert status(b) == R, "B was left blocked behind a free slot"
    assert not BlockedExecution.objects.exists()
    assert semaphore("one/r") == (1, 0)
    assert holders("one/r") == 1
