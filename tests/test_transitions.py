"""Every state transition of a job, in-process, on the real database.

The claim/finish/fail/release/recover functions are what the worker calls;
here they are driven directly so each guarantee is pinned down on its own.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_jobs import bulk_enqueue
from django_jobs import task as jobs_task
from django_jobs.core.admission import release_slot
from django_jobs.core.claimed import fail_job, finish_job, release_job
from django_jobs.core.operator import discard_job
from django_jobs.core.processes import prune_dead_processes, register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)
from tests import tasks

DB = "default"
ALL = QueueSelector(("*",))
BOOM = ErrorInfo("builtins.ValueError", "boom", "Traceback ... ValueError: boom")

limited = jobs_task(tasks.echo.func, concurrency_key="k:{value}", concurrency_limit=1)


@pytest.fixture
def worker(db):
    return register_process(DB, "worker")


def ids(jobs) -> list[int]:
    return [job.pk for job in jobs]


def enqueue_ids(*calls) -> list[int]:
    return [int(r.id) for r in bulk_enqueue(calls)]


@pytest.mark.django_db
class TestClaim:
    def test_priority_then_age_within_a_pattern(self, worker):
        low, high, high2 = enqueue_ids(
            (tasks.add.using(priority=-5), [1, 1], {}),
            (tasks.add.using(priority=9), [1, 1], {}),
            (tasks.add.using(priority=9), [1, 1], {}),
        )
        assert ids(claim_jobs(DB, worker.pk, ALL, 10)) == [high, high2, low]

    def test_queue_order_before_priority_and_wildcards(self, worker):
        default, email, report = enqueue_ids(
            (tasks.add.using(priority=100), [1, 1], {}),
            (tasks.echo.using(priority=-100), ["e"], {}),
            (tasks.add.using(queue_name="reports-daily"), [1, 1], {}),
        )
        claimed = claim_jobs(DB, worker.pk, QueueSelector(("emails", "reports*", "*")), 10)
        assert ids(claimed) == [email, report, default]

    def test_never_more_than_the_limit_and_never_twice(self, worker):
        enqueue_ids(*[(tasks.echo, [i], {}) for i in range(5)])
        first = claim_jobs(DB, worker.pk, QueueSelector(("emails", "*")), 3)
        second = claim_jobs(DB, worker.pk, QueueSelector(("emails", "*")), 3)
        assert len(first) == 3 and len(second) == 2
        assert not set(ids(first)) & set(ids(second))
        assert ClaimedExecution.objects.count() == 5 and ReadyExecution.objects.count() == 0
        assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.CLAIMED}

    def test_paused_queues_are_skipped(self, worker):
        (email,) = enqueue_ids((tasks.echo, ["e"], {}))
        Pause.objects.create(queue_name="emails")
        assert claim_jobs(DB, worker.pk, ALL, 5) == []
        Pause.objects.all().delete()
        assert ids(claim_jobs(DB, worker.pk, ALL, 5)) == [email]


@pytest.mark.django_db(transaction=True)
def test_claim_skips_rows_locked_by_another_transaction(worker):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises writers; there are no row locks to skip")
    first, second = enqueue_ids((tasks.add, [1, 1], {}), (tasks.add, [2, 2], {}))
    locked, release = threading.Event(), threading.Event()

    def hold_first_row():
        try:
            with transaction.atomic():
                list(ReadyExecution.objects.select_for_update().filter(job_id=first))
                locked.set()
                release.wait(10)
        finally:
            connections[DB].close()

    holder = threading.Thread(target=hold_first_row)
    holder.start()
    try:
        assert locked.wait(10)
        assert ids(claim_jobs(DB, worker.pk, ALL, 5)) == [second]
    finally:
        release.set()
        holder.join(10)
    assert ids(claim_jobs(DB, worker.pk, ALL, 5)) == [first]


@pytest.mark.django_db
class TestFinalisation:
    def claimed(self, worker, task=tasks.add, args=(1, 1)):
        task.enqueue(*args)
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        return job

    def test_start_counts_an_attempt_only_for_the_owner(self, worker):
        job = self.claimed(worker)
        other = register_process(DB, "worker")
        assert not start_job(DB, job, other.pk, other.name)
        assert Job.objects.get(pk=job.pk).attempts == 0
        assert start_job(DB, job, worker.pk, worker.name)
        stored = Job.objects.get(pk=job.pk)
        assert (stored.status, stored.attempts, stored.worker_ids) == (
            JobStatus.RUNNING,
            1,
            [worker.name],
        )

    def test_finish_is_exactly_once(self, worker):
        job = self.claimed(worker)
        start_job(DB, job, worker.pk, worker.name)
        assert finish_job(DB, job.pk, worker.pk, 2)
        assert not finish_job(DB, job.pk, worker.pk, 3)
        assert fail_job(DB, job.pk, worker.pk, BOOM) is None
        assert not release_job(DB, job.pk, worker.pk)
        stored = Job.objects.get(pk=job.pk)
        assert (stored.status, stored.return_value) == (JobStatus.SUCCEEDED, 2)
        assert FailedExecution.objects.count() == 0

    def test_a_falsely_pruned_worker_finishing_late_writes_nothing(self, worker):
        """Solid Queue #761: recovery took the job; the old owner's finish must be a no-op."""
        job = self.claimed(worker, limited, ("a",))
        start_job(DB, job, worker.pk, worker.name)
        recover_process_claims(DB, worker.pk, "declared dead")
        assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED
        semaphore = Semaphore.objects.get(key="tests.tasks.echo/k:a")
        assert semaphore.value == 1
        assert not finish_job(DB, job.pk, worker.pk, "late")
        assert Semaphore.objects.get(key="tests.tasks.echo/k:a").value == 1
        assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED

    def test_fail_retries_with_backoff_then_fails_for_good(self, worker):
        tasks.add.using(max_attempts=2, backoff=30).enqueue(1, 1)
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        start_job(DB, job, worker.pk, worker.name)
        before = timezone.now()
        outcome = fail_job(DB, job.pk, worker.pk, BOOM, worker_id=worker.name)
        assert outcome.will_retry
        scheduled = ScheduledExecution.objects.get(job_id=job.pk)
        assert before + timedelta(seconds=29) < scheduled.scheduled_at
        assert scheduled.scheduled_at < before + timedelta(seconds=31)
        ScheduledExecution.objects.update(scheduled_at=timezone.now())
        assert promote_due_jobs(DB, 10) == 1
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        start_job(DB, job, worker.pk, worker.name)
        assert not fail_job(DB, job.pk, worker.pk, BOOM, worker_id=worker.name).will_retry
        stored = Job.objects.get(pk=job.pk)
        assert (stored.status, stored.attempts) == (JobStatus.FAILED, 2)
        assert stored.finished_at is not None
        failures = list(FailedExecution.objects.order_by("attempt"))
        assert [(f.attempt, f.exception_class_path) for f in failures] == [
            (1, "builtins.ValueError"),
            (2, "builtins.ValueError"),
        ]
        assert "ValueError: boom" in failures[0].traceback

    def test_zero_backoff_is_ready_at_once(self, worker):
        tasks.add.using(max_attempts=2, backoff=0).enqueue(1, 1)
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        start_job(DB, job, worker.pk, worker.name)
        fail_job(DB, job.pk, worker.pk, BOOM)
        assert ReadyExecution.objects.filter(job_id=job.pk).exists()

    def test_hand_backs_never_cost_an_attempt(self, worker):
        """pg-boss #759: released five times, then run: one attempt, not six."""
        job = self.claimed(worker)
        for _ in range(5):
            assert release_job(DB, job.pk, worker.pk)
            assert Job.objects.get(pk=job.pk).status == JobStatus.READY
            (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        start_job(DB, job, worker.pk, worker.name)
        finish_job(DB, job.pk, worker.pk, 2)
        assert Job.objects.get(pk=job.pk).attempts == 1

    def test_release_goes_back_through_the_limit(self, worker):
        """Solid Queue #689 items 3 and 6: a hand-back never bypasses the limit."""
        first, second = (int(limited.enqueue("x").id) for _ in range(2))
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert job.pk == first
        assert BlockedExecution.objects.filter(job_id=second).exists()
        assert release_job(DB, first, worker.pk)
        # Both compete for the one slot in (priority, age) order: the first wins again.
        assert ReadyExecution.objects.filter(job_id=first).exists()
        assert BlockedExecution.objects.filter(job_id=second).exists()
        assert Semaphore.objects.get(key="tests.tasks.echo/k:x").value == 0


@pytest.mark.django_db
class TestRecovery:
    def test_unstarted_claims_are_handed_back_started_ones_fail(self, worker):
        tasks.add.enqueue(1, 1)
        tasks.add.using(max_attempts=2, backoff=0).enqueue(2, 2)
        tasks.add.enqueue(3, 3)
        unstarted, retried, failed = claim_jobs(DB, worker.pk, ALL, 3)
        start_job(DB, retried, worker.pk, worker.name)
        start_job(DB, failed, worker.pk, worker.name)
        outcomes = recover_process_claims(DB, worker.pk, "gone")
        assert outcomes == {unstarted.pk: "released", retried.pk: "retried", failed.pk: "failed"}
        assert Job.objects.get(pk=unstarted.pk).attempts == 0
        assert recover_process_claims(DB, worker.pk, "gone again") == {}
        assert (
            list(FailedExecution.objects.values_list("exception_class_path", flat=True))
            == ["django_jobs.exceptions.ProcessDied"] * 2
        )

    def test_prune_takes_only_the_dead_and_settles_orphans(self, worker):
        tasks.add.enqueue(1, 1)
        tasks.add.enqueue(2, 2)
        alive = register_process(DB, "worker")
        (mine,) = claim_jobs(DB, worker.pk, ALL, 1)
        (theirs,) = claim_jobs(DB, alive.pk, ALL, 1)
        Process.objects.filter(pk=worker.pk).update(
            last_heartbeat_at=timezone.now() - timedelta(minutes=10)
        )
        assert prune_dead_processes(DB, 60) == {mine.pk: "released"}
        assert not Process.objects.filter(pk=worker.pk).exists()
        assert ClaimedExecution.objects.filter(job_id=theirs.pk, process_id=alive.pk).exists()
        Process.objects.filter(pk=alive.pk).delete()  # gone without a trace
        assert prune_dead_processes(DB, 60) == {theirs.pk: "released"}


@pytest.mark.django_db(transaction=True)
def test_two_recoverers_settle_each_claim_once(worker):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises writers; the race needs row locks")
    tasks.add.using(max_attempts=3, backoff=0).enqueue(1, 1)
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    start_job(DB, job, worker.pk, worker.name)
    barrier = threading.Barrier(2, timeout=10)
    outcomes: list[dict] = []

    def recover():
        try:
            barrier.wait()
            outcomes.append(recover_process_claims(DB, worker.pk, "dead"))
        finally:
            connections[DB].close()

    threads = [threading.Thread(target=recover) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert sorted(len(o) for o in outcomes) == [0, 1]  # both ran; one found the claim
    assert FailedExecution.objects.filter(job_id=job.pk).count() == 1
    assert ReadyExecution.objects.filter(job_id=job.pk).count() == 1


@pytest.mark.django_db
class TestAdmission:
    def test_limit_n_admits_n_and_blocks_the_rest(self, worker):
        two = jobs_task(tasks.echo.func, concurrency_key="two", concurrency_limit=2)
        results = [int(two.enqueue(i).id) for i in range(4)]
        assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == set(results[:2])
        assert set(BlockedExecution.objects.values_list("job_id", flat=True)) == set(results[2:])
        (job, _) = claim_jobs(DB, worker.pk, ALL, 2)
        start_job(DB, job, worker.pk, worker.name)
        finish_job(DB, job.pk, worker.pk, None)
        # The finish promoted exactly one blocked job, in its own transaction.
        assert ReadyExecution.objects.filter(job_id=results[2]).exists()
        assert BlockedExecution.objects.filter(job_id=results[3]).exists()
        assert Semaphore.objects.get(key="tests.tasks.echo/two").value == 0

    def test_repeated_releases_never_free_a_held_slot_nor_exceed_the_limit(self):
        """Solid Queue PR #689 item 4 and #761: a release recounts, it never just adds one."""
        key = "tests.tasks.echo/k:z"
        holder = int(limited.enqueue("z").id)
        waiting = int(limited.enqueue("z").id)
        for _ in range(5):
            with transaction.atomic():
                release_slot(DB, key)
        assert Semaphore.objects.get(key=key).value == 0
        assert BlockedExecution.objects.filter(job_id=waiting).exists()
        assert discard_job(DB, holder)
        assert ReadyExecution.objects.filter(job_id=waiting).exists()
        assert discard_job(DB, waiting)
        for _ in range(5):
            with transaction.atomic():
                release_slot(DB, key)
        assert Semaphore.objects.get(key=key).value == 1

    def test_scheduled_keyed_jobs_are_admitted_through_the_semaphore(self):
        later = timezone.now() + timedelta(minutes=1)
        limited.enqueue("s")
        limited.using(run_after=later).enqueue("s")
        ScheduledExecution.objects.update(scheduled_at=timezone.now())
        assert promote_due_jobs(DB, 10) == 1
        assert BlockedExecution.objects.count() == 1 and ReadyExecution.objects.count() == 1
