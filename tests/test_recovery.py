"""Recovering the claims of dead processes, in-process, on the real database."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from django_jobs.core import recovery
from django_jobs.core.claimed import finish_job
from django_jobs.core.processes import prune_dead_processes, register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.starting import start_job
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)
from tests import transition_tasks as tt
from tests.transition_tasks import DB, InThread

ALL = QueueSelector(("*",))
PROCESS_DIED = "django_jobs.exceptions.ProcessDied"


@pytest.fixture
def worker(db):
    return register_process(DB, "worker")


def enqueue(task, *args) -> int:
    return int(task.enqueue(*args).id)


def claim(process, n: int = 1) -> list[Job]:
    jobs = claim_jobs(DB, process.pk, ALL, n)
    assert len(jobs) == n
    return jobs


def start(process, job: Job) -> Job:
    assert start_job(DB, job, process.pk, process.name)
    return job


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


def make_dead(process, seconds: float = 600) -> None:
    Process.objects.filter(pk=process.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=seconds)
    )


@pytest.mark.django_db
class TestRecoverProcessClaims:
    def test_a_claim_that_never_started_is_handed_back_free(self, worker):
        job_id = enqueue(tt.noop)
        claim(worker)
        assert recover_process_claims(DB, worker.pk, "gone") == {job_id: "released"}
        job = Job.objects.get(pk=job_id)
        assert (job.status, job.attempts, job.worker_ids) == (JobStatus.READY, 0, [])
        assert ReadyExecution.objects.filter(job_id=job_id).exists()
        assert not ClaimedExecution.objects.exists()
        assert not FailedExecution.objects.exists()

    def test_a_started_job_with_attempts_left_is_retried_with_a_process_died_error(self, worker):
        job_id = enqueue(tt.retried_at_once)  # max_attempts=3, backoff=0
        start(worker, *claim(worker))
        reason = "worker w (pid 1) stopped heartbeating"
        assert recover_process_claims(DB, worker.pk, reason) == {job_id: "retried"}
        job = Job.objects.get(pk=job_id)
        assert (job.status, job.attempts, job.finished_at) == (JobStatus.READY, 1, None)
        failure = FailedExecution.objects.get(job_id=job_id)
        assert (failure.attempt, failure.exception_class_path, failure.message) == (
            1,
            PROCESS_DIED,
            reason,
        )
        assert reason in failure.traceback

    def test_a_started_job_with_a_backoff_is_scheduled(self, worker):
        job_id = enqueue(tt.retried_later)  # backoff=30
        start(worker, *claim(worker))
        before = timezone.now()
        assert recover_process_claims(DB, worker.pk, "gone") == {job_id: "retried"}
        scheduled = ScheduledExecution.objects.get(job_id=job_id)
        assert scheduled.scheduled_at >= before + timedelta(seconds=30)
        assert status(job_id) == JobStatus.SCHEDULED

    def test_a_started_job_on_its_last_attempt_fails_for_good(self, worker):
        job_id = enqueue(tt.noop)  # max_attempts=1
        start(worker, *claim(worker))
        assert recover_process_claims(DB, worker.pk, "gone") == {job_id: "failed"}
        job = Job.objects.get(pk=job_id)
        assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
        assert job.finished_at is not None
        assert FailedExecution.objects.get(job_id=job_id).exception_class_path == PROCESS_DIED

    def test_a_mixed_set_is_settled_claim_by_claim(self, worker):
        unstarted = enqueue(tt.noop)
        retried = enqueue(tt.retried_at_once)
        failed = enqueue(tt.noop)
        jobs = claim(worker, 3)
        start(worker, jobs[1])
        start(worker, jobs[2])
        assert recover_process_claims(DB, worker.pk, "gone") == {
            unstarted: "released",
            retried: "retried",
            failed: "failed",
        }
        assert not ClaimedExecution.objects.exists()

    def test_only_the_named_process_is_recovered(self, worker):
        alive = register_process(DB, "worker")
        mine = enqueue(tt.noop)
        claim(worker)
        theirs = enqueue(tt.noop)
        claim(alive)
        assert recover_process_claims(DB, worker.pk, "gone") == {mine: "released"}
        assert ClaimedExecution.objects.get(job_id=theirs).process_id == alive.pk

    def test_recovering_twice_recovers_each_claim_once(self, worker):
        a = enqueue(tt.one_at_a_time, "x")
        start(worker, *claim(worker))
        b = enqueue(tt.one_at_a_time, "x")
        c = enqueue(tt.one_at_a_time, "x")
        assert recover_process_claims(DB, worker.pk, "gone") == {a: "failed"}
        assert recover_process_claims(DB, worker.pk, "gone again") == {}
        assert FailedExecution.objects.filter(job_id=a).count() == 1
        # The slot was freed once: B got it, C still waits.
        assert status(b) == JobStatus.READY and status(c) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="one/x").value == 0

    def test_a_keyed_unstarted_claim_goes_back_through_the_semaphore(self, worker):
        a = enqueue(tt.one_at_a_time, "x")
        claim(worker)
        b = enqueue(tt.one_at_a_time.using(priority=3), "x")
        assert recover_process_claims(DB, worker.pk, "gone") == {a: "released"}
        # B outranks A for the one slot: A is blocked again, not ready beside B.
        assert status(b) == JobStatus.READY and status(a) == JobStatus.BLOCKED
        assert Job.objects.get(pk=a).attempts == 0
        assert Semaphore.objects.get(key="one/x").value == 0

    def test_a_keyed_started_claim_frees_its_slot_for_the_next(self, worker):
        a = enqueue(tt.one_at_a_time_retried, "x")  # group one, max_attempts 3, backoff 0
        start(worker, *claim(worker))
        b = enqueue(tt.one_at_a_time, "x")
        assert recover_process_claims(DB, worker.pk, "gone") == {a: "retried"}
        assert status(b) == JobStatus.READY and status(a) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="one/x").value == 0
        assert ReadyExecution.objects.count() == 1

    def test_the_late_owner_cannot_finish_a_recovered_job(self, worker):
        job_id = enqueue(tt.retried_at_once)
        job = start(worker, *claim(worker))
        recover_process_claims(DB, worker.pk, "gone")
        assert not finish_job(DB, job.pk, worker.pk, "late")
        assert status(job_id) == JobStatus.READY
        assert Job.objects.get(pk=job_id).return_value is None


@pytest.mark.django_db(transaction=True)
def test_two_recoverers_at_once_settle_each_claim_exactly_once(worker, monkeypatch):
    """Two dispatchers recover the same dead worker on two connections at the same time.

    Both list the claims before either settles one (a barrier inside the
    per-claim step forces that), so both try every claim; the claim's row lock
    lets one of them settle it and the other find it gone. On SQLite the
    IMMEDIATE transactions serialise the two instead, with the same outcome.
    """
    started = [enqueue(tt.retried_at_once) for _ in range(2)]
    keyed = enqueue(tt.one_at_a_time, "x")
    for job in claim(worker, 3):
        if job.pk != keyed:
            start(worker, job)
    waiting = enqueue(tt.one_at_a_time, "x")
    unstarted = enqueue(tt.noop)
    claim(worker)
    barrier = threading.Barrier(2, timeout=20)
    waited: set[int] = set()
    real = recovery.recover_claim

    def recover_claim_together(db, job_id, process_id, reason):
        if threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait()  # each recoverer's first claim: both have listed them all
        return real(db, job_id, process_id, reason)

    monkeypatch.setattr(recovery, "recover_claim", recover_claim_together)
    runners = [InThread(recover_process_claims, DB, worker.pk, "dead") for _ in range(2)]
    results = [runner.join() for runner in runners]
    merged: dict[int, str] = {}
    for result in results:
        assert not set(result) & set(merged), "a claim was recovered twice"
        merged.update(result)
    assert merged == {
        started[0]: "retried",
        started[1]: "retried",
        keyed: "released",
        unstarted: "released",
    }
    assert not ClaimedExecution.objects.exists()
    for job_id in started:
        assert FailedExecution.objects.filter(job_id=job_id).count() == 1
        assert ReadyExecution.objects.filter(job_id=job_id).count() == 1
        assert Job.objects.get(pk=job_id).attempts == 1
    # The keyed holder's slot went around once: the older job (the released holder)
    # holds it again and the other still waits.
    assert status(keyed) == JobStatus.READY and status(waiting) == JobStatus.BLOCKED
    assert Semaphore.objects.get(key="one/x").value == 0


@pytest.mark.django_db
class TestPrune:
    def test_only_processes_past_the_threshold_are_pruned(self, worker):
        fresh = register_process(DB, "worker")
        recent = register_process(DB, "dispatcher")
        make_dead(worker, 120)
        make_dead(recent, 30)
        dead_job = enqueue(tt.noop)
        claim(worker)
        fresh_job = enqueue(tt.noop)
        claim(fresh)
        recent_job = enqueue(tt.noop)
        claim(recent)
        assert prune_dead_processes(DB, 60) == {dead_job: "released"}
        assert set(Process.objects.values_list("pk", flat=True)) == {fresh.pk, recent.pk}
        assert ClaimedExecution.objects.get(job_id=fresh_job).process_id == fresh.pk
        assert ClaimedExecution.objects.get(job_id=recent_job).process_id == recent.pk
        assert status(dead_job) == JobStatus.READY

    def test_a_dead_process_with_no_claims_is_just_removed(self, worker):
        make_dead(worker)
        assert prune_dead_processes(DB, 60) == {}
        assert not Process.objects.exists()

    def test_a_started_job_of_a_dead_process_gets_a_failed_attempt(self, worker):
        job_id = enqueue(tt.retried_at_once)
        start(worker, *claim(worker))
        make_dead(worker)
        assert prune_dead_processes(DB, 60) == {job_id: "retried"}
        failure = FailedExecution.objects.get(job_id=job_id)
        assert failure.exception_class_path == PROCESS_DIED
        assert worker.name in failure.message and "stopped heartbeating" in failure.message

    def test_orphaned_claims_of_a_vanished_process_are_settled(self, worker):
        started = enqueue(tt.noop)
        unstarted = enqueue(tt.noop)
        jobs = claim(worker, 2)
        start(worker, jobs[0])
        Process.objects.filter(pk=worker.pk).delete()  # crash between recovery and delete
        assert prune_dead_processes(DB, 60) == {started: "failed", unstarted: "released"}
        assert not ClaimedExecution.objects.exists()
        assert prune_dead_processes(DB, 60) == {}

    def test_a_claim_with_no_process_at_all_is_settled(self, worker):
        job_id = enqueue(tt.noop)
        claim(worker)
        ClaimedExecution.objects.filter(job_id=job_id).update(process=None)
        assert prune_dead_processes(DB, 60) == {job_id: "released"}
        assert status(job_id) == JobStatus.READY

    def test_pruning_twice_changes_nothing_more(self, worker):
        a = enqueue(tt.one_at_a_time, "x")
        start(worker, *claim(worker))
        b = enqueue(tt.one_at_a_time, "x")
        c = enqueue(tt.one_at_a_time, "x")
        make_dead(worker)
        assert prune_dead_processes(DB, 60) == {a: "failed"}
        assert prune_dead_processes(DB, 60) == {}
        assert status(b) == JobStatus.READY and status(c) == JobStatus.BLOCKED
        assert BlockedExecution.objects.count() == 1
        assert Semaphore.objects.get(key="one/x").value == 0


@pytest.mark.django_db(transaction=True)
def test_two_dispatchers_pruning_at_once_settle_each_claim_once(worker):
    job_ids = [enqueue(tt.retried_at_once) for _ in range(3)]
    for job in claim(worker, 3):
        start(worker, job)
    make_dead(worker)
    barrier = threading.Barrier(2, timeout=20)

    def prune():
        barrier.wait()
        return prune_dead_processes(DB, 60)

    runners = [InThread(prune), InThread(prune)]
    results = [runner.join() for runner in runners]
    assert sum(len(result) for result in results) == 3
    assert {k: v for result in results for k, v in result.items()} == dict.fromkeys(
        job_ids, "retried"
    )
    assert FailedExecution.objects.count() == 3
    assert ReadyExecution.objects.count() == 3
    assert not Process.objects.exists()
