"""Claiming and finalising jobs, in-process, on the real database.

``claim_jobs``, ``start_job``, ``finish_job``, ``fail_job`` and ``release_job``
are what a worker calls; each guarantee is pinned down here on its own.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_jobs import bulk_enqueue
from django_jobs.conf import parse_queue_list
from django_jobs.core.claimed import fail_job, finish_job, finish_jobs, release_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_claim, recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_job, start_jobs
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)
from tests import transition_tasks as tt
from tests.factories import ReadyExecutionFactory
from tests.transition_tasks import DB, InThread, has_row_locks, vendor

ALL = QueueSelector(("*",))
BOOM = ErrorInfo(
    "builtins.ValueError", "boom", "Traceback (most recent call last):\nValueError: boom"
)


@pytest.fixture
def worker(db):
    return register_process(DB, "worker")


@pytest.fixture
def other(db):
    return register_process(DB, "worker")


def ready(queue: str = "default", priority: int = 0) -> int:
    """A ready job planted directly (any queue name, no backend validation)."""
    return ReadyExecutionFactory(job__queue_name=queue, job__priority=priority).job_id


def plant(queue: str, count: int) -> None:
    """``count`` ready jobs of ``queue`` in two statements."""
    jobs = Job.objects.bulk_create(
        [Job(task_path="tests.tasks.add", queue_name=queue) for _ in range(count)]
    )
    ReadyExecution.objects.bulk_create(
        [ReadyExecution(job_id=job.pk, queue_name=queue) for job in jobs]
    )


def ids(jobs) -> list[int]:
    return [job.pk for job in jobs]


def enqueue(task, *args) -> int:
    return int(task.enqueue(*args).id)


def claim_one(worker) -> Job:
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    return job


def run_one(worker) -> Job:
    """Claim the next job and start it (its attempt is counted)."""
    job = claim_one(worker)
    assert start_job(DB, job, worker.pk, worker.name)
    return job


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


def execution_rows(job_id: int) -> dict[str, int]:
    return {
        table.__name__: table.objects.filter(job_id=job_id).count()
        for table in (ReadyExecution, ScheduledExecution, BlockedExecution, ClaimedExecution)
    }


@pytest.mark.django_db
class TestClaimOrder:
    def test_claims_at_most_the_limit(self, worker):
        made = [ready() for _ in range(5)]
        first = claim_jobs(DB, worker.pk, ALL, 2)
        assert ids(first) == made[:2]
        assert ClaimedExecution.objects.count() == 2 and ReadyExecution.objects.count() == 3
        assert claim_jobs(DB, worker.pk, ALL, 0) == []
        assert ids(claim_jobs(DB, worker.pk, ALL, 10)) == made[2:]
        assert claim_jobs(DB, worker.pk, ALL, 10) == []

    def test_a_claim_moves_ready_to_claimed_and_records_the_owner(self, worker):
        job_id = ready("a", 3)
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        assert job.pk == job_id and job.status == JobStatus.CLAIMED
        assert status(job_id) == JobStatus.CLAIMED
        claim = ClaimedExecution.objects.get(job_id=job_id)
        assert (claim.process_id, claim.queue_name) == (worker.pk, "a")
        assert execution_rows(job_id) == {
            "ReadyExecution": 0,
            "ScheduledExecution": 0,
            "BlockedExecution": 0,
            "ClaimedExecution": 1,
        }
        assert Job.objects.get(pk=job_id).attempts == 0  # claimed is not started

    def test_priority_descending_then_id_within_a_pattern(self, worker):
        low = ready(priority=-5)
        high = ready(priority=7)
        mid = ready(priority=0)
        high2 = ready(priority=7)
        assert ids(claim_jobs(DB, worker.pk, ALL, 10)) == [high, high2, mid, low]

    def test_queue_order_comes_before_priority(self, worker):
        b_high = ready("b", 100)
        a_low = ready("a", -100)
        a_mid = ready("a", 0)
        selector = QueueSelector(("a", "b"))
        assert ids(claim_jobs(DB, worker.pk, selector, 2)) == [a_mid, a_low]
        assert ids(claim_jobs(DB, worker.pk, selector, 2)) == [b_high]

    def test_a_limit_spanning_patterns_takes_the_rest_from_the_next(self, worker):
        a1, a2 = ready("a"), ready("a")
        b1, _b2 = ready("b", 5), ready("b")
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("a", "b")), 3)) == [a1, a2, b1]

    def test_unlisted_queues_are_not_claimed(self, worker):
        ready("c")
        assert claim_jobs(DB, worker.pk, QueueSelector(("a", "b")), 5) == []
        assert ReadyExecution.objects.count() == 1

    def test_star_matches_every_queue(self, worker):
        made = [ready(queue) for queue in ("a", "reports", "x-y", "default")]
        assert sorted(ids(claim_jobs(DB, worker.pk, ALL, 10))) == made

    def test_prefix_wildcard_matches_only_the_prefix(self, worker):
        reports = ready("reports", 1)
        daily = ready("reports-daily", 9)
        ready("default", 50)
        ready("myreports", 50)
        ready("report", 50)
        claimed = claim_jobs(DB, worker.pk, QueueSelector(("reports*",)), 10)
        assert ids(claimed) == [daily, reports]
        assert ReadyExecution.objects.count() == 3

    @pytest.mark.skipif("connection.vendor != 'mysql'", reason="InnoDB's locking reads")
    @pytest.mark.django_db(transaction=True)  # ANALYZE TABLE commits on MySQL
    def test_a_prefix_claim_locks_only_what_it_takes_past_another_backlog(self, worker):
        """A LIKE read walked the claim-order index through every other queue's
        backlog, locking each row (0.29 of '*' with 10,000 of them, in the bench)."""
        plant("default", 3000)
        plant("reports", 1000)
        plant("reports-daily", 1000)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE TABLE django_jobs_readyexecution")
        wanted = list(
            ReadyExecution.objects.filter(queue_name__startswith="reports")
            .order_by("job_id")
            .values_list("job_id", flat=True)[:2]
        )
        with transaction.atomic():
            claimed = claim_jobs(DB, worker.pk, QueueSelector(("reports*",)), 2)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT trx_rows_locked FROM information_schema.INNODB_TRX "
                    "WHERE trx_mysql_thread_id = CONNECTION_ID()"
                )
                (locked,) = cursor.fetchone()
        assert ids(claimed) == wanted[:2]
        # The two ready rows, their claimed rows and jobs: none of the 3,000 older rows of
        # "default", nor all 2,000 matching ones (which a sort would lock).
        assert locked < 50, locked

    def test_a_queue_new_to_a_prefix_is_claimed_at_once_when_the_known_ones_are_empty(self, worker):
        first = ready("reports")
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("reports*",)), 5)) == [first]
        newcomer = ready("reports-weekly")
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("reports*",)), 5)) == [newcomer]

    def test_prefix_wildcard_takes_like_characters_literally(self, worker):
        literal = ready("a_b%c")
        ready("axbyc")  # would match an unescaped LIKE 'a_b%'
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("a_b%*",)), 10)) == [literal]

    def test_paused_queues_are_skipped_by_name_and_by_wildcard(self, worker):
        a = ready("a")
        b = ready("b", 10)
        Pause.objects.create(queue_name="b")
        assert claim_jobs(DB, worker.pk, QueueSelector(("b",)), 5) == []
        assert ids(claim_jobs(DB, worker.pk, ALL, 5)) == [a]
        assert ReadyExecution.objects.filter(job_id=b).exists()
        Pause.objects.all().delete()
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("b*",)), 5)) == [b]

    @pytest.mark.parametrize("limit", [2, 4, 10])
    def test_overlapping_patterns_never_claim_a_row_twice(self, worker, limit):
        a = [ready("a", 0) for _ in range(3)]
        b = [ready("b", 9) for _ in range(2)]
        selector = QueueSelector(parse_queue_list("a,*"))
        claimed = ids(claim_jobs(DB, worker.pk, selector, limit))
        assert claimed == [*a, *b][:limit]
        assert len(set(claimed)) == len(claimed)
        assert ClaimedExecution.objects.count() == len(claimed)
        rest = ids(claim_jobs(DB, worker.pk, selector, 10))
        assert not set(rest) & set(claimed)
        assert sorted(claimed + rest) == sorted(a + b)


HOLDERS = ["another claim"] + (["select_for_update"] if has_row_locks() else [])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("holder_kind", HOLDERS)
def test_a_claim_skips_rows_another_transaction_holds_and_does_not_wait(worker, holder_kind):
    """A second connection holds the two best ready rows; the claim takes the others.

    PostgreSQL and MariaDB: the holder keeps its transaction open with the rows
    locked, either by ``SELECT ... FOR UPDATE`` (one row at a time, by primary
    key) or by being a ``claim_jobs`` itself; the claim (SKIP LOCKED) must return
    the other rows while the holder still holds them, without waiting for it.
    SQLite has no row locks: a claim in an open (IMMEDIATE) transaction
    serialises the other, which must then not take what the first one took.
    """
    held = [ready(priority=9), ready(priority=9)]
    free = [ready(priority=1), ready(priority=0)]
    locked, release = threading.Event(), threading.Event()

    def hold() -> list[int]:
        with transaction.atomic(using=DB):
            if holder_kind == "select_for_update":
                got = [
                    ReadyExecution.objects.select_for_update().get(job_id=job_id).job_id
                    for job_id in held
                ]
            else:
                got = ids(claim_jobs(DB, worker.pk, ALL, 2))
            locked.set()
            assert release.wait(30)
        return got

    holder = InThread(hold)
    try:
        assert locked.wait(20)
        claimer = InThread(lambda: ids(claim_jobs(DB, worker.pk, ALL, 10)))
        if has_row_locks():
            # Joined while the holder still holds its locks: a claim that waited for
            # them would time out here.
            got = claimer.join(20)
            assert not holder.done.is_set()
            if holder_kind == "another claim" and vendor() == "mysql":
                # MariaDB sorts the "*" scan (filesort) and so locks every ready row it
                # read, not only the two it returned: the second claimer skips them
                # all. It must still neither wait nor take a held row.
                assert set(got) <= set(free)
            else:
                assert got == free
        else:
            release.set()
            assert claimer.join(40) == free
    finally:
        release.set()
    assert holder.join() == held
    if holder_kind == "select_for_update":
        # The locks are gone; the rows were never taken, so the next claim gets them.
        assert ids(claim_jobs(DB, worker.pk, ALL, 10)) == held
    claim_jobs(DB, worker.pk, ALL, 10)
    assert ClaimedExecution.objects.count() == 4
    assert ReadyExecution.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_split_the_rows_and_never_share_one(worker, other):
    made = [ready(queue=("a" if n % 2 else "b"), priority=n % 3) for n in range(12)]
    barrier = threading.Barrier(3, timeout=20)

    def claimer(process) -> list[int]:
        barrier.wait()
        got: list[int] = []
        while batch := ids(claim_jobs(DB, process.pk, QueueSelector(("a", "*")), 3)):
            got += batch
        return got

    third = register_process(DB, "worker")
    runners = [InThread(claimer, p) for p in (worker, other, third)]
    results = [runner.join(60) for runner in runners]
    flat = [job_id for result in results for job_id in result]
    assert sorted(flat) == sorted(made)  # every row once, none twice
    owners = dict(ClaimedExecution.objects.values_list("job_id", "process_id"))
    for process, result in zip((worker, other, third), results, strict=True):
        assert all(owners[job_id] == process.pk for job_id in result)


@pytest.mark.django_db
class TestStart:
    def test_start_counts_an_attempt_and_appends_the_worker(self, worker):
        job_id = enqueue(tt.noop)
        job = claim_one(worker)
        before = timezone.now()
        assert start_job(DB, job, worker.pk, "w-1")
        stored = Job.objects.get(pk=job_id)
        assert (stored.status, stored.attempts, stored.worker_ids) == (
            JobStatus.RUNNING,
            1,
            ["w-1"],
        )
        assert stored.started_at >= before and stored.last_attempted_at == stored.started_at
        assert (job.attempts, job.worker_ids, job.status) == (1, ["w-1"], JobStatus.RUNNING)

    def test_a_second_attempt_appends_and_keeps_the_first_start(self, worker):
        job_id = enqueue(tt.retried_at_once)
        first = run_one(worker)
        started_at = Job.objects.get(pk=job_id).started_at
        assert fail_job(DB, job_id, worker.pk, BOOM).will_retry
        second = claim_one(worker)
        assert start_job(DB, second, worker.pk, "w-2")
        stored = Job.objects.get(pk=job_id)
        assert (stored.attempts, stored.worker_ids) == (2, [first.worker_ids[0], "w-2"])
        assert stored.started_at == started_at
        assert stored.last_attempted_at > started_at

    def test_attempts_come_from_the_row_not_a_stale_copy_of_the_job(self, worker):
        job_id = enqueue(tt.retried_at_once)
        stale = Job.objects.get(pk=job_id)  # read before any attempt
        run_one(worker)
        fail_job(DB, job_id, worker.pk, BOOM)
        claim_one(worker)
        assert start_job(DB, stale, worker.pk, "w-2")
        stored = Job.objects.get(pk=job_id)
        assert (stored.attempts, len(stored.worker_ids)) == (2, 2)
        assert stale.attempts == 2

    def test_another_process_cannot_start_it_and_counts_nothing(self, worker, other):
        job_id = enqueue(tt.noop)
        job = claim_one(worker)
        assert not start_job(DB, job, other.pk, other.name)
        stored = Job.objects.get(pk=job_id)
        assert (stored.status, stored.attempts, stored.worker_ids) == (JobStatus.CLAIMED, 0, [])

    def test_a_claim_that_is_gone_cannot_be_started(self, worker, other):
        job_id = enqueue(tt.noop)
        job = claim_one(worker)
        # Declared dead and recovered before it started: handed back, claimed by another.
        assert recover_process_claims(DB, worker.pk, "dead") == {job_id: "released"}
        assert not start_job(DB, job, worker.pk, worker.name)
        theirs = claim_one(other)
        assert not start_job(DB, job, worker.pk, worker.name)
        assert Job.objects.get(pk=job_id).attempts == 0
        assert start_job(DB, theirs, other.pk, other.name)
        assert Job.objects.get(pk=job_id).worker_ids == [other.name]

    def test_a_finished_job_cannot_be_started_again(self, worker):
        enqueue(tt.noop)
        job = run_one(worker)
        assert finish_job(DB, job.pk, worker.pk, 1)
        assert not start_job(DB, job, worker.pk, worker.name)
        stored = Job.objects.get(pk=job.pk)
        assert (stored.status, stored.attempts) == (JobStatus.SUCCEEDED, 1)


@pytest.mark.django_db
class TestExactlyOnce:
    """Every ending of a claim happens once; a non-owner (or a second call) writes nothing."""

    def keyed_trio(self, worker) -> tuple[Job, int, int]:
        """A runs (holding key one/x), B and C are blocked behind it."""
        a = enqueue(tt.one_at_a_time, "x")
        b = enqueue(tt.one_at_a_time, "x")
        c = enqueue(tt.one_at_a_time, "x")
        job = run_one(worker)
        assert job.pk == a
        return job, b, c

    def assert_only_b_promoted(self, b: int, c: int) -> None:
        assert status(b) == JobStatus.READY and status(c) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="one/x").value == 0

    def snapshot(self, job_id: int) -> tuple:
        job = Job.objects.get(pk=job_id)
        return (
            job.status,
            job.attempts,
            job.return_value,
            job.finished_at,
            FailedExecution.objects.filter(job_id=job_id).count(),
            execution_rows(job_id),
        )

    def test_finish_once(self, worker):
        job, b, c = self.keyed_trio(worker)
        assert finish_job(DB, job.pk, worker.pk, {"ok": 1})
        self.assert_only_b_promoted(b, c)
        done = self.snapshot(job.pk)
        assert done[:3] == (JobStatus.SUCCEEDED, 1, {"ok": 1}) and done[3] is not None
        assert not finish_job(DB, job.pk, worker.pk, "again")
        assert fail_job(DB, job.pk, worker.pk, BOOM) is None
        assert not release_job(DB, job.pk, worker.pk)
        assert self.snapshot(job.pk) == done
        self.assert_only_b_promoted(b, c)  # the slot was freed once, not three times

    def test_fail_once(self, worker):
        job, b, c = self.keyed_trio(worker)
        assert not fail_job(DB, job.pk, worker.pk, BOOM).will_retry
        self.assert_only_b_promoted(b, c)
        done = self.snapshot(job.pk)
        assert fail_job(DB, job.pk, worker.pk, BOOM) is None
        assert not finish_job(DB, job.pk, worker.pk, 1)
        assert not release_job(DB, job.pk, worker.pk)
        assert self.snapshot(job.pk) == done
        self.assert_only_b_promoted(b, c)

    def test_release_once(self, worker):
        a = enqueue(tt.noop)
        job = claim_one(worker)
        assert release_job(DB, a, worker.pk)
        released = self.snapshot(a)
        assert not release_job(DB, a, worker.pk)
        assert not finish_job(DB, a, worker.pk, 1)
        assert fail_job(DB, a, worker.pk, BOOM) is None
        assert not start_job(DB, job, worker.pk, worker.name)
        assert self.snapshot(a) == released
        assert released[0] == JobStatus.READY and released[1] == 0

    def test_a_process_that_does_not_own_the_claim_writes_nothing(self, worker, other):
        job, b, c = self.keyed_trio(worker)
        running = self.snapshot(job.pk)
        assert not finish_job(DB, job.pk, other.pk, "stolen")
        assert fail_job(DB, job.pk, other.pk, BOOM) is None
        assert not release_job(DB, job.pk, other.pk)
        assert self.snapshot(job.pk) == running
        assert ClaimedExecution.objects.get(job_id=job.pk).process_id == worker.pk
        assert status(b) == status(c) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="one/x").value == 0

    def test_a_falsely_pruned_worker_finishing_late_changes_nothing(self, worker, other):
        """Solid Queue #761: the job was recovered (and the slot passed on) while the
        "dead" worker still ran it; its late finish/fail/release must write nothing,
        above all not free the key's slot a second time."""
        job, b, c = self.keyed_trio(worker)
        assert recover_process_claims(DB, worker.pk, "missed heartbeats") == {job.pk: "failed"}
        self.assert_only_b_promoted(b, c)
        b_job = run_one(other)
        assert b_job.pk == b
        after_recovery = self.snapshot(job.pk)
        assert not finish_job(DB, job.pk, worker.pk, "late")
        assert fail_job(DB, job.pk, worker.pk, BOOM) is None
        assert not release_job(DB, job.pk, worker.pk)
        assert self.snapshot(job.pk) == after_recovery
        assert after_recovery[0] == JobStatus.FAILED
        # B still holds the one slot, C still waits: nothing was over-admitted.
        assert status(b) == JobStatus.RUNNING and status(c) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="one/x").value == 0


@pytest.mark.django_db
class TestFail:
    def test_fixed_backoff_schedules_the_retry_then_fails_for_good(self, worker):
        job_id = enqueue(tt.retried_later)  # max_attempts=3, backoff=30
        for attempt in (1, 2):
            run_one(worker)
            before = timezone.now()
            outcome = fail_job(DB, job_id, worker.pk, BOOM, worker_id=f"w-{attempt}")
            after = timezone.now()
            assert outcome.will_retry
            assert before + timedelta(seconds=30) <= outcome.retry_at
            assert outcome.retry_at <= after + timedelta(seconds=30)
            scheduled = ScheduledExecution.objects.get(job_id=job_id)
            assert scheduled.scheduled_at == outcome.retry_at
            stored = Job.objects.get(pk=job_id)
            assert (stored.status, stored.attempts, stored.finished_at) == (
                JobStatus.SCHEDULED,
                attempt,
                None,
            )
            assert execution_rows(job_id)["ClaimedExecution"] == 0
            assert claim_jobs(DB, worker.pk, ALL, 1) == []  # not before it is due
            ScheduledExecution.objects.update(scheduled_at=timezone.now())
            assert promote_due_jobs(DB, 10) == 1
        run_one(worker)
        outcome = fail_job(DB, job_id, worker.pk, BOOM, worker_id="w-3")
        assert not outcome.will_retry and outcome.retry_at is None
        stored = Job.objects.get(pk=job_id)
        assert (stored.status, stored.attempts) == (JobStatus.FAILED, 3)
        assert stored.finished_at is not None
        assert sum(execution_rows(job_id).values()) == 0
        failures = list(FailedExecution.objects.filter(job_id=job_id).order_by("attempt"))
        assert [(f.attempt, f.worker_id, f.exception_class_path) for f in failures] == [
            (1, "w-1", "builtins.ValueError"),
            (2, "w-2", "builtins.ValueError"),
            (3, "w-3", "builtins.ValueError"),
        ]
        assert all(f.message == "boom" and f.traceback == BOOM.traceback for f in failures)

    def test_zero_backoff_is_ready_again_at_once(self, worker):
        job_id = enqueue(tt.retried_at_once)
        run_one(worker)
        outcome = fail_job(DB, job_id, worker.pk, BOOM)
        assert outcome.will_retry
        assert execution_rows(job_id)["ReadyExecution"] == 1
        assert not ScheduledExecution.objects.exists()
        assert status(job_id) == JobStatus.READY
        assert ids(claim_jobs(DB, worker.pk, ALL, 1)) == [job_id]

    def test_one_attempt_fails_for_good_at_once(self, worker):
        job_id = enqueue(tt.noop)  # max_attempts=1
        run_one(worker)
        assert not fail_job(DB, job_id, worker.pk, BOOM).will_retry
        assert status(job_id) == JobStatus.FAILED
        assert FailedExecution.objects.get(job_id=job_id).attempt == 1

    def test_retry_false_fails_for_good_with_attempts_left(self, worker):
        job_id = enqueue(tt.retried_at_once)
        run_one(worker)
        assert not fail_job(DB, job_id, worker.pk, BOOM, retry=False).will_retry
        stored = Job.objects.get(pk=job_id)
        assert (stored.status, stored.attempts) == (JobStatus.FAILED, 1)
        assert sum(execution_rows(job_id).values()) == 0

    def test_a_long_exception_path_is_cut_to_the_column(self, worker):
        job_id = enqueue(tt.noop)
        run_one(worker)
        fail_job(DB, job_id, worker.pk, ErrorInfo("x." * 200, "m", "t"))
        assert len(FailedExecution.objects.get(job_id=job_id).exception_class_path) == 255

    def test_a_keyed_retry_later_frees_the_slot_and_readmits_through_it(self, worker):
        a = enqueue(tt.one_at_a_time_retried, "x")  # group "one", backoff 0
        run_one(worker)
        b = enqueue(tt.one_at_a_time, "x")
        assert status(b) == JobStatus.BLOCKED
        # Retried at once: the freed slot goes to B (already waiting); A waits behind it.
        assert fail_job(DB, a, worker.pk, BOOM).will_retry
        assert status(b) == JobStatus.READY and status(a) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="one/x").value == 0
        assert Job.objects.get(pk=a).attempts == 1

    def test_a_keyed_retry_with_backoff_gives_the_slot_to_the_next(self, worker):
        a = enqueue(tt.one_at_a_time.using(max_attempts=2, backoff=60), "x")
        run_one(worker)
        b = enqueue(tt.one_at_a_time, "x")
        assert fail_job(DB, a, worker.pk, BOOM).will_retry
        assert status(a) == JobStatus.SCHEDULED and status(b) == JobStatus.READY
        ScheduledExecution.objects.update(scheduled_at=timezone.now())
        assert promote_due_jobs(DB, 10) == 1
        assert status(a) == JobStatus.BLOCKED  # B holds the slot
        assert Semaphore.objects.get(key="one/x").value == 0


@pytest.mark.django_db
class TestRelease:
    def test_handing_back_five_times_costs_no_attempt(self, worker, other):
        """pg-boss #759: claimed and handed back 5 times, then run: 1 attempt, not 6."""
        job_id = enqueue(tt.noop)
        for n in range(5):
            owner = (worker, other)[n % 2]
            job = claim_one(owner)
            assert release_job(DB, job_id, owner.pk)
            stored = Job.objects.get(pk=job_id)
            assert (stored.status, stored.attempts, stored.worker_ids) == (JobStatus.READY, 0, [])
            assert execution_rows(job_id)["ReadyExecution"] == 1
        job = run_one(worker)
        assert finish_job(DB, job.pk, worker.pk, None)
        stored = Job.objects.get(pk=job_id)
        assert (stored.status, stored.attempts, stored.worker_ids) == (
            JobStatus.SUCCEEDED,
            1,
            [worker.name],
        )
        assert not FailedExecution.objects.exists()

    def test_a_keyed_release_with_a_free_slot_is_ready_again(self, worker):
        a = enqueue(tt.two_at_a_time, "x")
        claim_one(worker)
        assert release_job(DB, a, worker.pk)
        assert status(a) == JobStatus.READY
        assert Semaphore.objects.get(key="two/x").value == 1

    def test_a_keyed_release_competes_again_and_can_lose_its_slot(self, worker):
        """Solid Queue #689 items 3 and 6: a hand-back goes back through the limit.

        B (priority 5) waits for the only slot; A hands it back: B takes it and A is
        blocked, not ready beside it.
        """
        a = enqueue(tt.one_at_a_time, "x")
        claim_one(worker)
        b = enqueue(tt.one_at_a_time.using(priority=5), "x")
        assert status(b) == JobStatus.BLOCKED
        assert release_job(DB, a, worker.pk)
        assert status(a) == JobStatus.BLOCKED and status(b) == JobStatus.READY
        assert execution_rows(a)["BlockedExecution"] == 1
        assert Semaphore.objects.get(key="one/x").value == 0
        assert Job.objects.get(pk=a).attempts == 0
        # The slot passes back to A only when B is done.
        b_job = run_one(worker)
        assert b_job.pk == b
        assert finish_job(DB, b, worker.pk, None)
        assert status(a) == JobStatus.READY

    def test_a_keyed_release_behind_another_holder_is_blocked(self, worker, other):
        """A and B held both slots of a limit-2 key; C re-declared the limit as 1 (so
        B alone now fills it). A's hand-back must leave A blocked, not ready."""
        a = enqueue(tt.two_at_a_time, "x")
        b = enqueue(tt.two_at_a_time, "x")
        claim_one(worker)
        run_one(other)
        c = enqueue(tt.two_at_a_time.using(concurrency_limit=1), "x")
        assert status(c) == JobStatus.BLOCKED
        assert release_job(DB, a, worker.pk)
        assert status(a) == JobStatus.BLOCKED and status(b) == JobStatus.RUNNING
        semaphore = Semaphore.objects.get(key="two/x")
        assert (semaphore.limit, semaphore.value) == (1, 0)
        assert finish_job(DB, b, other.pk, None)
        # One slot: the older of the two waiting jobs gets it.
        assert status(a) == JobStatus.READY and status(c) == JobStatus.BLOCKED
        assert Semaphore.objects.get(key="two/x").value == 0

    def test_a_released_holder_keeps_the_count_right_with_two_slots(self, worker, other):
        a = enqueue(tt.two_at_a_time, "x")
        b = enqueue(tt.two_at_a_time, "x")
        c = enqueue(tt.two_at_a_time, "x")
        claim_one(worker)
        run_one(other)
        assert status(c) == JobStatus.BLOCKED
        assert release_job(DB, a, worker.pk)
        # A (older than C) wins the freed slot back; C still waits; no slot is free.
        assert status(a) == JobStatus.READY and status(c) == JobStatus.BLOCKED
        assert status(b) == JobStatus.RUNNING
        assert Semaphore.objects.get(key="two/x").value == 0

    def test_bulk_enqueued_jobs_release_in_any_order(self, worker):
        made = [int(r.id) for r in bulk_enqueue([(tt.noop, [n], {}) for n in range(3)])]
        claimed = claim_jobs(DB, worker.pk, ALL, 3)
        for job in reversed(claimed):
            assert release_job(DB, job.pk, worker.pk)
        assert sorted(ReadyExecution.objects.values_list("job_id", flat=True)) == made
        assert set(Job.objects.values_list("attempts", flat=True)) == {0}


# --- batched start and finish (the worker's completer) -------------------------------


def test_a_batched_start_counts_only_the_claims_still_held(worker):
    bulk_enqueue([(tt.noop, (n,), {}) for n in range(2)])
    kept, lost = claim_jobs(DB, worker.pk, ALL, 2)
    assert recover_claim(DB, lost.pk, worker.pk, "pruned") == "released"
    assert start_jobs(DB, [kept, lost], worker.pk, worker.name) == [kept]
    assert (kept.status, kept.attempts, kept.worker_ids) == (
        JobStatus.RUNNING,
        1,
        [worker.name],
    )
    rows = {job.pk: job for job in Job.objects.all()}
    assert (rows[kept.pk].status, rows[kept.pk].attempts) == (JobStatus.RUNNING, 1)
    assert (rows[lost.pk].status, rows[lost.pk].attempts) == (JobStatus.READY, 0)


@pytest.mark.parametrize("hinted", [False, True], ids=["general", "plain"])
def test_a_batched_finish_writes_only_the_claims_still_held(worker, hinted):
    """Jobs known to have no key and no batch take PostgreSQL's one statement: the same
    rule."""
    bulk_enqueue([(tt.noop, (n,), {}) for n in range(2)])
    jobs = claim_jobs(DB, worker.pk, ALL, 2)
    kept, lost = start_jobs(DB, jobs, worker.pk, worker.name)
    assert recover_claim(DB, lost.pk, worker.pk, "pruned") == "failed"
    known = [kept, lost] if hinted else []
    assert finish_jobs(DB, worker.pk, {kept.pk: "kept", lost.pk: "lost"}, known) == {kept.pk}
    rows = {job.pk: job for job in Job.objects.all()}
    assert (rows[kept.pk].status, rows[kept.pk].return_value) == (JobStatus.SUCCEEDED, "kept")
    assert (rows[lost.pk].status, rows[lost.pk].return_value) == (JobStatus.FAILED, None)
    assert FailedExecution.objects.filter(job_id=lost.pk).count() == 1
    assert not ClaimedExecution.objects.exists()


RETURN_VALUES = [None, 0, 1.5, True, "", 'it\'s "quoted" é', [], [1, [2]], {"a": {"b": None}}]


@pytest.mark.parametrize("hinted", [False, True], ids=["general", "plain"])
def test_a_batched_finish_writes_each_jobs_own_return_value(worker, hinted):
    """One UPDATE writes every job's value (a CASE on the general path): each JSON type
    comes back as it was returned, and a job that returned None reads NULL."""
    bulk_enqueue([(tt.noop, (n,), {}) for n in range(len(RETURN_VALUES))])
    jobs = start_jobs(DB, claim_jobs(DB, worker.pk, ALL, len(RETURN_VALUES)), worker.pk, "w")
    values = {job.pk: value for job, value in zip(jobs, RETURN_VALUES, strict=True)}
    known = jobs if hinted else []
    assert finish_jobs(DB, worker.pk, values, known) == set(values)
    rows = dict(Job.objects.values_list("pk", "return_value"))
    assert rows == values
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
    assert Job.objects.filter(return_value__isnull=True).count() == 1


@pytest.mark.parametrize("hinted", [False, True], ids=["general", "wrongly-plain"])
def test_a_batched_finish_frees_each_keys_slot_for_its_next_job(worker, hinted):
    """A keyed job whose caller's copy wrongly says it has no key still frees its slot:
    the one statement leaves it to the general path."""
    bulk_enqueue([(tt.one_at_a_time, (key, n), {}) for n in range(2) for key in ("b", "a")])
    holders = claim_jobs(DB, worker.pk, ALL, 10)
    assert sorted(job.concurrency_key for job in holders) == ["one/a", "one/b"]
    start_jobs(DB, holders, worker.pk, worker.name)
    known = [Job(pk=job.pk) for job in holders] if hinted else []
    assert finish_jobs(DB, worker.pk, {job.pk: None for job in holders}, known) == {
        job.pk for job in holders
    }
    assert not BlockedExecution.objects.exists()
    ready = ReadyExecution.objects.order_by("concurrency_key")
    assert [row.concurrency_key for row in ready] == ["one/a", "one/b"]
    assert all(s.value == 0 for s in Semaphore.objects.all())
    assert Job.objects.filter(status=JobStatus.SUCCEEDED).count() == 2
