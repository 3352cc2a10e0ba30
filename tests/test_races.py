"""The races other queues shipped, forced with two real connections in two threads.

Each test pauses one transaction at the dangerous point (a wrapper around the
real function that waits on an event), runs the other path, and then lets the
first one finish. Where a row lock is the protection, the second path blocks
on it: the test waits until the database reports that lock wait (or until the
second path finished, which is the buggy order), so nothing depends on
timing. Tests named ``..._unprotected`` remove the protection and assert the
bug appears: proof that the protected test would catch it.

SQLite has no row locks (BEGIN IMMEDIATE serialises whole transactions), so
the interleavings cannot be forced there; these run on PostgreSQL and MariaDB.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import InterfaceError, OperationalError, connection, connections, transaction
from django.utils import timezone

from django_jobs import task as jobs_task
from django_jobs.core import admission, claimed, ready
from django_jobs.core import recovery as recovery_module
from django_jobs.core.claimed import finish_job, release_job
from django_jobs.core.maintenance import reconcile_blocked_keys
from django_jobs.core.operator import discard_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_job
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    Semaphore,
)
from tests import tasks
from tests.row_lock_waits import is_waiting_for_a_row_lock

DB = "default"
ALL = QueueSelector(("*",))

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
    ),
]

one_at_a_time = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_limit=1)
two_at_a_time = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_limit=2)
KEY = "tests.tasks.echo/acct:1"
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


def session_id() -> int:
    """This thread's database session (backend pid / connection id)."""
    with connections[DB].cursor() as cursor:
        cursor.execute(
            "SELECT pg_backend_pid()"
            if connection.vendor == "postgresql"
            else "SELECT CONNECTION_ID()"
        )
        return cursor.fetchone()[0]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Paused:
    """Wraps ``module.name`` so the first call, after it returns, waits for ``resume``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module, name: str, before=False) -> None:
        self.reached = threading.Event()
        self.resume = threading.Event()
        original = getattr(module, name)
        self.thread_id: int | None = None

        def wrapper(*args, **kwargs):
            first = not self.reached.is_set() and threading.get_ident() == self.thread_id
            if first and before:
                self.reached.set()
                assert self.resume.wait(15), "never resumed"
            result = original(*args, **kwargs)
            if first and not before:
                self.reached.set()
                assert self.resume.wait(15), "never resumed"
            return result

        monkeypatch.setattr(module, name, wrapper)


class Runner(threading.Thread):
    """Runs ``target`` in a thread with its own connection; keeps its result or error."""

    def __init__(self, target: Callable[[], object], paused: Paused | None = None) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.paused = paused
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.session: int | None = None

    def run(self) -> None:
        if self.paused is not None:
            self.paused.thread_id = threading.get_ident()
        try:
            self.session = session_id()
            self.result = self.target()
        except BaseException as exc:  # reported by finish()
            self.error = exc
        finally:
            self.done.set()
            connections.close_all()

    def blocked_or_done(self) -> bool:
        """Done (the unprotected order), or waiting on a lock (the protection holding)."""
        if self.done.is_set():
            return True
        return self.session is not None and is_waiting_for_a_row_lock(self.session, DB)

    def finish(self) -> object:
        self.join(20)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def started_job(task, value, worker):
    """Enqueue, claim and start one job of ``task``; return it."""
    job_id = int(task.enqueue(value).id)
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    assert job.pk == job_id
    assert start_job(DB, job, worker.pk, worker.name)
    return job


def holders(key: str = KEY) -> int:
    return (
        ReadyExecution.objects.filter(concurrency_key=key).count()
        + ClaimedExecution.objects.filter(concurrency_key=key).count()
    )


def stranded(key: str = KEY) -> bool:
    """A blocked job of ``key`` while the key has a free slot."""
    semaphore = Semaphore.objects.get(key=key)
    return BlockedExecution.objects.filter(concurrency_key=key).exists() and (
        holders(key) < semaphore.limit
    )


@pytest.fixture
def worker():
    return register_process(DB, "worker")


# --- a. enqueue checks the semaphore while a finish looks for blocked jobs -------------


def race_enqueue_against_finish(monkeypatch, worker):
    first = started_job(one_at_a_time, 1, worker)
    paused = Paused(monkeypatch, admission, "lock_semaphore")
    enqueue = Runner(lambda: int(one_at_a_time.enqueue(1).id), paused)
    enqueue.start()
    assert paused.reached.wait(10)  # B has read the semaphore: full
    finish = Runner(lambda: finish_job(DB, first.pk, worker.pk, None))
    finish.start()
    wait_for(finish.blocked_or_done, "the finish to block or end")
    paused.resume.set()
    second = enqueue.finish()
    assert finish.finish() is True
    return second


def test_a_enqueue_and_finish_never_strand_a_blocked_job(monkeypatch, worker):
    """Solid Queue #456 / PR #712. Protection: select_for_update in admission.lock_semaphore."""
    second = race_enqueue_against_finish(monkeypatch, worker)
    assert Job.objects.get(pk=second).status == JobStatus.READY
    assert not stranded()
    assert Semaphore.objects.get(key=KEY).value == 0


def test_a_unprotected_the_race_strands_the_job(monkeypatch, worker):
    def unlocked(db, key, limit):
        found = Semaphore.objects.using(db).filter(key=key).first()
        if found is None:
            Semaphore.objects.using(db).bulk_create(
                [Semaphore(key=key, limit=limit, value=limit)], ignore_conflicts=True
            )
            found = Semaphore.objects.using(db).get(key=key)
        return found

    monkeypatch.setattr(admission, "lock_semaphore", unlocked)
    second = race_enqueue_against_finish(monkeypatch, worker)
    assert Job.objects.get(pk=second).status == JobStatus.BLOCKED
    assert stranded()


# --- b. a holder running long, without and with a lease --------------------------------


def test_b_without_a_lease_no_blocked_job_starts_while_the_holder_runs(worker):
    """Solid Queue PR #689 item 1: time alone never frees a live holder's slot."""
    holder = started_job(one_at_a_time, 1, worker)
    blocked = int(one_at_a_time.enqueue(1).id)
    long_ago = timezone.now() - timedelta(days=2)
    ClaimedExecution.objects.update(created_at=long_ago)
    Semaphore.objects.update(updated_at=long_ago)
    assert reconcile_blocked_keys(DB) == 0
    assert Job.objects.get(pk=blocked).status == JobStatus.BLOCKED
    assert finish_job(DB, holder.pk, worker.pk, None)
    assert Job.objects.get(pk=blocked).status == JobStatus.READY


def test_b_with_a_lease_the_next_job_starts_after_it_and_no_third(worker):
    """With concurrency_duration the key admits the next job once the lease ran out."""
    leased = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_duration=30)
    holder = started_job(leased, 1, worker)
    claim = ClaimedExecution.objects.get(job_id=holder.pk)
    assert claim.lease_expires_at is not None
    second, third = (int(leased.enqueue(1).id) for _ in range(2))
    assert reconcile_blocked_keys(DB) == 0  # lease still running
    ClaimedExecution.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert reconcile_blocked_keys(DB) == 1
    assert Job.objects.get(pk=second).status == JobStatus.READY
    # The expired holder finishing gives back nothing: it no longer held a slot.
    assert finish_job(DB, holder.pk, worker.pk, None)
    assert Job.objects.get(pk=third).status == JobStatus.BLOCKED
    assert Semaphore.objects.get(key=KEY).value == 0


# --- c. graceful release while another holder runs -------------------------------------


def test_c_release_during_a_finish_keeps_the_limit_and_the_count(monkeypatch, worker):
    """Solid Queue PR #689 items 3 and 6: a hand-back goes through the limit."""
    running = started_job(two_at_a_time, 1, worker)
    two_at_a_time.enqueue(1)
    (handed_back,) = claim_jobs(DB, worker.pk, ALL, 1)  # claimed, never started
    waiting = int(two_at_a_time.enqueue(1).id)
    assert Job.objects.get(pk=waiting).status == JobStatus.BLOCKED
    paused = Paused(monkeypatch, claimed, "hand_back_to_key")
    release = Runner(lambda: release_job(DB, handed_back.pk, worker.pk), paused)
    release.start()
    assert paused.reached.wait(10)
    finish = Runner(lambda: finish_job(DB, running.pk, worker.pk, None))
    finish.start()
    wait_for(finish.blocked_or_done, "the finish to block or end")
    paused.resume.set()
    assert release.finish() is True and finish.finish() is True
    # Two slots, two waiting jobs, the runner gone: both ready, none over the limit.
    assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == {
        handed_back.pk,
        waiting,
    }
    assert holders() == 2 and Semaphore.objects.get(key=KEY).value == 0
    assert Job.objects.get(pk=handed_back.pk).attempts == 0


# --- d. bulk discard and releases never raise free slots above the limit ---------------


def test_d_concurrent_discards_and_releases_never_exceed_the_limit(worker):
    """Solid Queue PR #689 item 4: the free count is recounted, never incremented blindly."""
    ids = [int(two_at_a_time.enqueue(1).id) for _ in range(8)]
    barrier = threading.Barrier(2, timeout=10)

    def discard_all():
        barrier.wait()
        return sum(discard_job(DB, job_id) for job_id in ids)

    def release_many():
        barrier.wait()
        for _ in range(20):
            with transaction.atomic():
                admission.release_slot(DB, KEY)

    a, b = Runner(discard_all), Runner(release_many)
    a.start()
    b.start()
    assert a.finish() == 8
    b.finish()
    semaphore = Semaphore.objects.get(key=KEY)
    assert (semaphore.value, semaphore.limit, holders()) == (2, 2, 0)


# --- e. a process dies inside the finish transaction -----------------------------------


def test_e_death_inside_finish_rolls_back_and_recovery_frees_one_slot(monkeypatch, worker):
    """Solid Queue PR #689 item 5: finish and unblock are one transaction."""
    holder = started_job(one_at_a_time, 1, worker)
    blocked = [int(one_at_a_time.enqueue(1).id) for _ in range(2)]
    paused = Paused(monkeypatch, claimed, "release_slots", before=True)
    victim_connection: dict[str, int] = {}

    def finish():
        with connections[DB].cursor() as cursor:
            cursor.execute(
                "SELECT pg_backend_pid()"
                if connection.vendor == "postgresql"
                else "SELECT CONNECTION_ID()"
            )
            victim_connection["id"] = cursor.fetchone()[0]
        return finish_job(DB, holder.pk, worker.pk, None)

    dying = Runner(finish, paused)
    dying.start()
    assert paused.reached.wait(10)  # claim deleted, job marked succeeded, not committed
    with connections[DB].cursor() as cursor:  # the process dies: its connection is cut
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s)", [victim_connection["id"]])
        else:
            cursor.execute(f"KILL {int(victim_connection['id'])}")
    paused.resume.set()
    dying.join(20)
    assert isinstance(dying.error, OperationalError | InterfaceError), dying.error
    # Everything rolled back: the claim is still there for recovery.
    assert ClaimedExecution.objects.filter(job_id=holder.pk).exists()
    assert Job.objects.get(pk=holder.pk).status == JobStatus.RUNNING
    assert recover_process_claims(DB, worker.pk, "died") == {holder.pk: "failed"}
    statuses = [Job.objects.get(pk=job_id).status for job_id in blocked]
    assert statuses == [JobStatus.READY, JobStatus.BLOCKED]
    assert Semaphore.objects.get(key=KEY).value == 0


# --- f. two claimers on a queue with max_concurrency=N ---------------------------------


def race_two_claimers(monkeypatch, cap: int) -> int:
    for i in range(cap * 3):
        tasks.add.enqueue(i, i)
    first_worker, second_worker = register_process(DB, "worker"), register_process(DB, "worker")
    caps = {"default": cap}
    paused = Paused(monkeypatch, ready, "lock_queue_caps")
    first = Runner(lambda: claim_jobs(DB, first_worker.pk, ALL, 10, caps), paused)
    first.start()
    assert paused.reached.wait(10)  # counted the running jobs, not yet claimed
    second = Runner(lambda: claim_jobs(DB, second_worker.pk, ALL, 10, caps))
    second.start()
    wait_for(second.blocked_or_done, "the second claim")
    paused.resume.set()
    return len(first.finish()) + len(second.finish())


@pytest.mark.parametrize("cap", [1, 2])
def test_f_a_queue_cap_of_n_runs_exactly_n(monkeypatch, cap):
    """taskito PR #104: the cap is checked under a lock, in the claim's transaction."""
    assert race_two_claimers(monkeypatch, cap) == cap
    assert ClaimedExecution.objects.count() == cap


def test_f_unprotected_two_claimers_exceed_the_cap(monkeypatch):
    def no_lock(db, selector, caps, paused):
        running = ClaimedExecution.objects.using(db).filter(queue_name="default").count()
        return {"default": caps["default"] - running}

    monkeypatch.setattr(ready, "lock_queue_caps", no_lock)
    assert race_two_claimers(monkeypatch, 1) == 2


# --- g. blocked, promoted, handed back many times: still max_attempts runs ------------


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


def test_g_cycling_through_the_limit_never_burns_an_attempt(worker):
    """pg-boss PR #759: being blocked, promoted or handed back is not an attempt."""
    retried = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", max_attempts=2, backoff=0)
    holder = started_job(retried, 1, worker)
    job_id = int(retried.enqueue(1).id)
    for _ in range(5):
        assert status(job_id) == JobStatus.BLOCKED
        assert finish_job(DB, holder.pk, worker.pk, None)  # promotes job_id
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert job.pk == job_id
        assert release_job(DB, job_id, worker.pk)  # handed back, keeps its turn
        urgent = int(retried.using(priority=10).enqueue(1).id)  # blocked, but outranks it
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert job.pk == job_id
        assert release_job(DB, job_id, worker.pk)  # this time the slot goes to urgent
        assert (status(urgent), status(job_id)) == (JobStatus.READY, JobStatus.BLOCKED)
        (holder,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert holder.pk == urgent and start_job(DB, holder, worker.pk, worker.name)
    assert Job.objects.get(pk=job_id).attempts == 0
    assert finish_job(DB, holder.pk, worker.pk, None)
    for _ in range(2):
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert job.pk == job_id and start_job(DB, job, worker.pk, worker.name)
        claimed.fail_job(DB, job_id, worker.pk, BOOM, worker_id=worker.name)
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts, len(job.worker_ids)) == (JobStatus.FAILED, 2, 2)
    assert FailedExecution.objects.filter(job_id=job_id).count() == 2


# --- h. a worker wrongly pruned, then finishing its job --------------------------------


def test_h_a_false_prune_and_a_late_finish_free_the_slot_once(monkeypatch):
    """Solid Queue #761: recovery and the late finish race; one wins, one slot is freed."""
    slow, other = register_process(DB, "worker"), register_process(DB, "worker")
    late = started_job(two_at_a_time, 1, slow)
    started_job(two_at_a_time, 1, other)
    next_up, last = (int(two_at_a_time.enqueue(1).id) for _ in range(2))
    paused = Paused(monkeypatch, recovery_module, "lock_own_claim")
    recovery = Runner(lambda: recover_process_claims(DB, slow.pk, "heartbeat late"), paused)
    recovery.start()
    assert paused.reached.wait(10)  # recovery holds the claim's row lock
    finish = Runner(lambda: finish_job(DB, late.pk, slow.pk, "late result"))
    finish.start()
    wait_for(finish.blocked_or_done, "the late finish")
    paused.resume.set()
    assert recovery.finish() == {late.pk: "failed"}
    assert finish.finish() is False  # the claim was gone: nothing written
    assert Job.objects.get(pk=late.pk).return_value is None
    assert (status(next_up), status(last)) == (JobStatus.READY, JobStatus.BLOCKED)
    assert holders() == 2 and Semaphore.objects.get(key=KEY).value == 0
    assert FailedExecution.objects.filter(job_id=late.pk).count() == 1
