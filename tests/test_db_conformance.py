"""The conformance suite of the database operations: each operation's contract, written
once, run on whichever database DATABASE_URL names (tox runs it on PostgreSQL, MariaDB
and SQLite).

Every operation a worker, a dispatcher or the admin relies on is called here directly,
on jobs made by the real enqueue path, and every test asserts the rows it leaves
behind (``Job.status``, ``attempts``, the execution tables, ``Semaphore.value``), not
only what the call returns. Where PostgreSQL takes a path of its own (a claim or a
finish in one statement, the finish's hints), the test runs the contract through each
path, and the outcome must be the same.

A contract about locks (a locked row is skipped, not waited for; a row lock orders two
transactions) is forced with a second real connection in another thread, which holds
the lock while the operation runs; the test observes the database (the other session
is waiting for a row lock) rather than sleeping. Those tests skip only where the
database lacks the capability, by Django's own feature flags: SQLite has no row locks,
its writers are serialised by ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import DataError, connections, transaction
from django.utils import timezone

from django_jobs import enqueue_batch
from django_jobs import task as jobs_task
from django_jobs.core.fairness import TURN_SCALE
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.db import features, ops
from django_jobs.models import (
    AwaitingExecution,
    Batch,
    BlockedExecution,
    ClaimedExecution,
    DependencyFailure,
    FailedExecution,
    FairTurn,
    Job,
    JobDependency,
    JobStatus,
    Pause,
    RateLimit,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
    Workflow,
)
from tests import batch_tasks as bt
from tests import rate_tasks, tasks
from tests import transition_tasks as tt
from tests.factories import BlockedExecutionFactory, JobFactory, SemaphoreFactory
from tests.transition_tasks import (
    TIMEOUT,
    InThread,
    backend_id,
    is_waiting_for_row_lock,
    wait_until,
)

# isort: split
# The operations under test, in one block: moving them between modules is an edit here only.
from django_jobs.core.admission import count_holders, lock_semaphores, release_slots
from django_jobs.core.claimed import fail_job, finish_jobs, release_job, snooze_job
from django_jobs.core.rate_limits import ensure_rate_rows
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_jobs

DB = "default"
ALL = QueueSelector(("*",))
BOOM = ErrorInfo(
    "builtins.ValueError", "boom", "Traceback (most recent call last):\nValueError: boom"
)
READY, BLOCKED, SCHEDULED = JobStatus.READY, JobStatus.BLOCKED, JobStatus.SCHEDULED
CLAIMED, RUNNING = JobStatus.CLAIMED, JobStatus.RUNNING
SUCCEEDED, FAILED = JobStatus.SUCCEEDED, JobStatus.FAILED
PROCESS_DIED = "django_jobs.exceptions.ProcessDied"

# The database's capabilities, as Django declares them (class attributes: no connection).
FEATURES = connections[DB].features
needs_skip_locked = pytest.mark.skipif(
    not FEATURES.has_select_for_update_skip_locked,
    reason="the database has no SELECT ... FOR UPDATE SKIP LOCKED (SQLite: no row locks, "
    "BEGIN IMMEDIATE serialises the writers)",
)
needs_string_lengths = pytest.mark.skipif(
    connections[DB].vendor == "sqlite",
    reason="SQLite stores a string of any length in a varchar(n) column",
)
needs_row_locks = pytest.mark.skipif(
    not FEATURES.has_select_for_update,
    reason="the database has no row locks (SQLite: BEGIN IMMEDIATE serialises the writers)",
)

# Rate-limited tasks of this suite: rates of an hour, so that no test depends on how
# fast the machine runs it (a window of a second could open between two calls).
three_an_hour = jobs_task(tasks.echo.func, rate_limit="3/h")
hourly_per_value = jobs_task(tasks.echo.func, rate_limit="1/h", rate_key="{value}")
hourly_one_at_a_time = jobs_task(
    tasks.echo.func, rate_limit="1/h", concurrency_key="acct:{value}", concurrency_limit=1
)


# --- helpers ------------------------------------------------------------------------------


@pytest.fixture
def worker(db):
    return register_process(DB, "worker")


@pytest.fixture
def other(db):
    return register_process(DB, "worker")


def enqueue(task, *args: Any) -> int:
    return int(task.enqueue(*args).id)


def ids(jobs) -> list[int]:
    return [job.pk for job in jobs]


def row(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


def statuses(*job_ids: int) -> list[str]:
    return [row(job_id).status for job_id in job_ids]


def executions(job_id: int) -> set[str]:
    """The execution tables holding a row of ``job_id`` (a job is in at most one)."""
    tables = {
        "ready": ReadyExecution,
        "scheduled": ScheduledExecution,
        "blocked": BlockedExecution,
        "claimed": ClaimedExecution,
        "awaiting": AwaitingExecution,
    }
    return {name for name, model in tables.items() if model.objects.filter(job_id=job_id).exists()}


def semaphore(key: str) -> tuple[int, int]:
    found = Semaphore.objects.get(key=key)
    return found.limit, found.value


def assert_slots_agree(key: str) -> None:
    """The semaphore of ``key`` says what its rows say, counted here independently:
    free = limit - holders (ready and claimed rows), never over-admitted, and no job
    blocked while a slot is free (docs/design.md invariants 1 and 2)."""
    limit, value = semaphore(key)
    holders = (
        ReadyExecution.objects.filter(concurrency_key=key).count()
        + ClaimedExecution.objects.filter(concurrency_key=key).count()
    )
    blocked = BlockedExecution.objects.filter(concurrency_key=key).count()
    assert value == limit - holders, (key, limit, value, holders)
    assert holders <= limit, (key, limit, holders)
    assert not (value > 0 and blocked), (key, value, blocked)


def claim(worker, limit: int = 10, *, start: bool = False, **options: Any) -> list[Job]:
    """``claim_jobs`` of every queue; ``start``: the worker's claim, which is the start."""
    worker_id = worker.name if start else None
    return claim_jobs(DB, worker.pk, ALL, limit, worker_id=worker_id, **options)


def running(worker, job_id: int) -> Job:
    """Claim the next ready job, which must be ``job_id``, and start it."""
    (job,) = claim(worker, 1)
    assert job.pk == job_id
    (started,) = start_jobs(DB, [job], worker.pk, worker.name)
    return started


# The hints finish_jobs takes, the caller's copies of the jobs (where the database can,
# it finishes the ones without a batch in one statement each, PostgreSQL): none, true
# copies, and wrong ones (a key where the job has none, none where it has one, no batch
# where it has one). A hint may cost a statement, never change the outcome.
HINTS = ["no_hints", "true_hints", "wrong_hints"]


def finish(worker, return_values: dict[int, object], hints: str) -> set[int]:
    if hints == "no_hints":
        return finish_jobs(DB, worker.pk, return_values)
    known = list(Job.objects.filter(pk__in=list(return_values)))
    if hints == "wrong_hints":
        for job in known:
            job.concurrency_key = None if job.concurrency_key else "no-such-key"
            job.batch_id = None
            job.workflow_id = None  # "no dependents": the statement must recheck the row
    return finish_jobs(DB, worker.pk, return_values, known)


@contextmanager
def held_by_another_transaction(lock: Callable[[], object]) -> Iterator[InThread]:
    """Run ``lock`` in a transaction of another connection (a thread), and keep that
    transaction open, with whatever locks ``lock`` took, until the block ends."""
    locked, release = threading.Event(), threading.Event()

    def hold() -> object:
        with transaction.atomic(using=DB):
            got = lock()
            locked.set()
            # Longer than any join of the test's: a test that fails reports its own error.
            assert release.wait(3 * TIMEOUT), "never released"
        return got

    holder = InThread(hold)
    if not locked.wait(TIMEOUT):
        release.set()
        holder.join()  # re-raises what the holder raised
        raise AssertionError("the holder never took its locks")
    try:
        yield holder
    finally:
        release.set()
        holder.join()


class Session:
    """A thread's call of ``fn`` on its own connection, whose server session can be
    watched from the test's (to see it wait for a row lock)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.id: int | None = None

        def run() -> object:
            self.id = backend_id()
            return fn()

        self.thread = InThread(run)

    def waits_for_a_row_lock(self) -> bool:
        return self.id is not None and is_waiting_for_row_lock(self.id)

    def wait_until_blocked(self) -> None:
        assert wait_until(self.waits_for_a_row_lock), "the session never waited for the lock"
        assert not self.thread.done.is_set()

    def join(self) -> object:
        return self.thread.join()


def locked_elsewhere(model, **filters: Any) -> bool:
    """Whether another transaction holds the row lock of the row ``filters`` name (the
    row exists: a skip-locked read that finds nothing found it locked)."""
    assert model.objects.filter(**filters).exists()
    with transaction.atomic(using=DB):
        free = model.objects.select_for_update(skip_locked=True).filter(**filters)
        return not list(free.values_list("pk", flat=True))


# --- claim ----------------------------------------------------------------------------------

CAPS = [None, {"default": 100, "emails": 100}]
CAP_IDS = ["uncapped", "capped"]


@pytest.mark.django_db
class TestClaim:
    @pytest.mark.parametrize("caps", CAPS, ids=CAP_IDS)
    def test_a_claim_moves_ready_rows_to_claimed_rows_and_counts_no_attempt(self, worker, caps):
        made = [enqueue(tt.noop, n) for n in range(3)]
        claimed = claim(worker, 2, caps=caps)
        assert ids(claimed) == made[:2]
        assert [job.status for job in claimed] == [CLAIMED, CLAIMED]
        for job_id in made[:2]:
            job = row(job_id)
            assert (job.status, job.attempts, job.worker_ids, job.started_at) == (
                CLAIMED,
                0,
                [],
                None,
            )
            assert executions(job_id) == {"claimed"}
            held = ClaimedExecution.objects.get(job_id=job_id)
            assert (held.process_id, held.queue_name) == (worker.pk, "default")
        assert (row(made[2]).status, executions(made[2])) == (READY, {"ready"})

    @pytest.mark.parametrize("caps", CAPS, ids=CAP_IDS)
    def test_a_claim_with_a_worker_id_is_the_start(self, worker, caps):
        made = [enqueue(tt.noop, n) for n in range(2)]
        before = timezone.now()
        claimed = claim(worker, caps=caps, start=True)
        assert [(job.pk, job.status, job.attempts, job.worker_ids) for job in claimed] == [
            (job_id, RUNNING, 1, [worker.name]) for job_id in made
        ]
        for job_id in made:
            job = row(job_id)
            assert (job.status, job.attempts, job.worker_ids) == (RUNNING, 1, [worker.name])
            assert job.started_at == job.last_attempted_at
            assert job.started_at >= before
            assert executions(job_id) == {"claimed"}

    @pytest.mark.parametrize("start", [False, True], ids=["claim", "claim=start"])
    @pytest.mark.parametrize("caps", CAPS, ids=CAP_IDS)
    def test_the_order_is_priority_then_id(self, worker, caps, start):
        low = enqueue(tt.noop.using(priority=-5))
        high = enqueue(tt.noop.using(priority=7))
        mid = enqueue(tt.noop)
        high2 = enqueue(tt.noop.using(priority=7))
        assert ids(claim(worker, 3, caps=caps, start=start)) == [high, high2, mid]
        assert statuses(high, high2, mid) == [RUNNING if start else CLAIMED] * 3
        assert (row(low).status, executions(low)) == (READY, {"ready"})
        assert ids(claim(worker, 10, caps=caps, start=start)) == [low]

    @pytest.mark.parametrize("caps", CAPS, ids=CAP_IDS)
    def test_a_paused_queue_is_skipped(self, worker, caps):
        mail = enqueue(tt.noop.using(queue_name="emails", priority=9))
        plain = enqueue(tt.noop)
        Pause.objects.create(queue_name="emails")
        for selector in (("emails",), ("em*",)):
            found = claim_jobs(DB, worker.pk, QueueSelector(selector), 10, caps=caps)
            assert found == []
        assert ids(claim(worker, caps=caps)) == [plain]
        assert (row(mail).status, row(mail).attempts, executions(mail)) == (READY, 0, {"ready"})
        Pause.objects.all().delete()
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("em*",)), 10, caps=caps)) == [mail]
        assert executions(mail) == {"claimed"}

    def test_a_queue_cap_of_n_counts_the_running_claims_and_lets_exactly_n_run(self, worker, other):
        first = enqueue(tt.noop)
        (theirs,) = claim(other, 1, start=True)  # one of default's three, on another worker
        capped = [enqueue(tt.noop, n) for n in range(4)]
        mail = enqueue(tt.noop.using(queue_name="emails"))
        caps = {"default": 3}
        assert ids(claim(worker, caps=caps, start=True)) == [*capped[:2], mail]
        assert ClaimedExecution.objects.filter(queue_name="default").count() == 3
        assert statuses(*capped) == [RUNNING, RUNNING, READY, READY]
        assert claim(worker, caps=caps) == []
        assert statuses(*capped[2:]) == [READY, READY]
        # One of the three ends: exactly one more may run.
        assert finish_jobs(DB, other.pk, {first: None}) == {theirs.pk}
        assert ids(claim(worker, caps=caps, start=True)) == [capped[2]]
        assert ClaimedExecution.objects.filter(queue_name="default").count() == 3
        assert executions(capped[3]) == {"ready"}

    @needs_skip_locked
    @pytest.mark.django_db(transaction=True)
    @pytest.mark.parametrize(
        "caps, start", [(None, False), ({"default": 100}, True)], ids=["claim", "capped-start"]
    )
    def test_rows_another_transaction_holds_are_skipped_not_waited_for(self, worker, caps, start):
        held = [enqueue(tt.noop.using(priority=9)) for _ in range(2)]
        free = [enqueue(tt.noop.using(priority=1)), enqueue(tt.noop)]

        def lock_the_best_two() -> list[int]:
            rows = ReadyExecution.objects.select_for_update().filter(job_id__in=held)
            return list(rows.order_by("job_id").values_list("job_id", flat=True))

        with held_by_another_transaction(lock_the_best_two):
            claimer = InThread(lambda: ids(claim(worker, caps=caps, start=start)))
            # Joined while the holder still holds the rows: a claim that waited for them
            # would not return (and the join would fail) before the block ends.
            assert claimer.join() == free
            assert statuses(*held) == [READY, READY]
            assert statuses(*free) == [RUNNING if start else CLAIMED] * 2
        assert [executions(job_id) for job_id in held] == [{"ready"}, {"ready"}]
        assert ids(claim(worker, caps=caps, start=start)) == held


# --- start ----------------------------------------------------------------------------------


@pytest.mark.django_db
class TestStart:
    def test_a_start_counts_one_attempt_per_job(self, worker):
        made = [enqueue(tt.noop, n) for n in range(3)]
        claimed = claim(worker)
        before = timezone.now()
        started = start_jobs(DB, claimed, worker.pk, "w-1")
        assert ids(started) == made
        for job_id in made:
            job = row(job_id)
            assert (job.status, job.attempts, job.worker_ids) == (RUNNING, 1, ["w-1"])
            assert job.started_at == job.last_attempted_at and job.started_at >= before
            assert executions(job_id) == {"claimed"}
        assert [(job.status, job.attempts) for job in started] == [(RUNNING, 1)] * 3

    def test_a_second_attempt_adds_one_and_keeps_the_first_start(self, worker):
        job_id = enqueue(tt.retried_at_once)  # max_attempts=3, backoff=0
        running(worker, job_id)
        first_start = row(job_id).started_at
        assert fail_job(DB, job_id, worker.pk, BOOM).will_retry
        assert row(job_id).status == READY
        (again,) = claim(worker)
        assert ids(start_jobs(DB, [again], worker.pk, "w-2")) == [job_id]
        job = row(job_id)
        assert (job.status, job.attempts, job.worker_ids) == (RUNNING, 2, [worker.name, "w-2"])
        assert job.started_at == first_start and job.last_attempted_at >= first_start

    def test_a_lost_claim_is_left_out_and_counts_nothing(self, worker, other):
        kept, taken, gone = (enqueue(tt.noop, n) for n in range(3))
        jobs = claim(worker)
        # Handed back before they ran: one claimed since by another worker, one waiting.
        assert release_job(DB, taken, worker.pk) and release_job(DB, gone, worker.pk)
        assert ids(claim(other, 1)) == [taken]
        assert ids(start_jobs(DB, jobs, worker.pk, worker.name)) == [kept]
        assert (row(kept).status, row(kept).attempts) == (RUNNING, 1)
        assert (row(taken).status, row(taken).attempts, row(taken).worker_ids) == (CLAIMED, 0, [])
        assert ClaimedExecution.objects.get(job_id=taken).process_id == other.pk
        assert (row(gone).status, row(gone).attempts, executions(gone)) == (READY, 0, {"ready"})

    def test_a_job_over_its_rate_goes_back_to_wait_as_scheduled_with_no_attempt(self, worker):
        first, second = enqueue(rate_tasks.once_a_minute, 1), enqueue(rate_tasks.once_a_minute, 2)
        claimed = claim(worker, start=True)
        # The start of a rate-limited job is decided by start_jobs, under the key's lock.
        assert [(job.status, job.attempts) for job in claimed] == [(CLAIMED, 0)] * 2
        assert ids(start_jobs(DB, claimed, worker.pk, worker.name)) == [first]
        assert (row(first).status, row(first).attempts) == (RUNNING, 1)
        job = row(second)
        assert (job.status, job.attempts, job.worker_ids) == (SCHEDULED, 0, [])
        assert executions(second) == {"scheduled"}
        waiting_until = ScheduledExecution.objects.get(job_id=second).scheduled_at
        assert waiting_until == job.rate_reserved_at
        assert waiting_until == row(first).last_attempted_at + timedelta(minutes=1)
        assert claimed[1].status == SCHEDULED  # the caller's copy says so too
        assert not FailedExecution.objects.exists()

    def test_a_job_sent_back_by_its_rate_frees_its_concurrency_slot(self, worker):
        admitted = enqueue(hourly_one_at_a_time, "a")
        sent_back = enqueue(hourly_one_at_a_time, "b")
        next_of_b = enqueue(hourly_one_at_a_time, "b")
        assert statuses(admitted, sent_back, next_of_b) == [READY, READY, BLOCKED]
        claimed = claim(worker)
        assert ids(start_jobs(DB, claimed, worker.pk, worker.name)) == [admitted]
        assert (row(sent_back).status, row(sent_back).attempts) == (SCHEDULED, 0)
        assert executions(sent_back) == {"scheduled"}
        # Waiting for its window, it holds no slot: the next job of its key has it.
        assert (row(next_of_b).status, executions(next_of_b)) == (READY, {"ready"})
        for key in ("tests.tasks.echo/acct:a", "tests.tasks.echo/acct:b"):
            assert semaphore(key) == (1, 0)
            assert_slots_agree(key)


# --- finish ---------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("hints", HINTS)
class TestFinish:
    def test_a_plain_finish_stores_the_outcome_and_drops_the_claim(self, worker, hints):
        a, b = enqueue(tt.noop, 1), enqueue(tt.noop, 2)
        claim(worker, start=True)
        # A return value of None is stored as SQL NULL, whatever an earlier run left.
        Job.objects.filter(pk=b).update(return_value={"left": "by an earlier run"})
        before = timezone.now()
        value = {"n": [1, "two", None, 3.5]}
        assert finish(worker, {a: value, b: None}, hints) == {a, b}
        job_a, job_b = row(a), row(b)
        assert (job_a.status, job_a.attempts, job_a.return_value) == (SUCCEEDED, 1, value)
        assert (job_b.status, job_b.attempts) == (SUCCEEDED, 1)
        assert Job.objects.filter(pk=b, return_value__isnull=True).exists()
        assert job_a.finished_at >= before and job_b.finished_at >= before
        assert executions(a) == executions(b) == set()
        assert not FailedExecution.objects.exists()

    def test_a_keyed_finish_frees_the_slot_and_promotes_by_priority_then_age(self, worker, hints):
        holder = enqueue(tt.one_at_a_time, "x")
        claim(worker, start=True)
        low = enqueue(tt.one_at_a_time.using(priority=1), "x")
        high_old = enqueue(tt.one_at_a_time.using(priority=5), "x")
        high_new = enqueue(tt.one_at_a_time.using(priority=5), "x")
        alone = enqueue(tt.one_at_a_time, "y")  # a key with nobody waiting
        assert ids(claim(worker, start=True)) == [alone]
        assert statuses(low, high_old, high_new) == [BLOCKED] * 3
        assert finish(worker, {holder: 7, alone: None}, hints) == {holder, alone}
        assert (row(holder).status, row(holder).return_value) == (SUCCEEDED, 7)
        assert executions(holder) == executions(alone) == set()
        assert (row(high_old).status, executions(high_old)) == (READY, {"ready"})
        assert statuses(low, high_new) == [BLOCKED, BLOCKED]
        assert semaphore("one/x") == (1, 0)
        assert semaphore("one/y") == (1, 1)
        assert_slots_agree("one/x")
        assert_slots_agree("one/y")

    def test_a_finish_releases_what_waits_for_its_jobs_once_each(self, worker, hints):
        from django_jobs import workflow

        with workflow() as wf:
            a = wf.add(tt.noop, 1)
            b = wf.add(tt.noop, 2)
            both = wf.add(tt.noop, 3, after=[a, b])
            after_a = wf.add(tt.noop, 4, after=[a])
        first, second, merged, single = (int(n.id) for n in (a, b, both, after_a))
        assert ids(claim(worker, start=True)) == [first, second]
        assert finish(worker, {first: "a"}, hints) == {first}
        assert (row(single).status, executions(single)) == (READY, {"ready"})
        assert executions(merged) == {"awaiting"}
        assert AwaitingExecution.objects.get(job_id=merged).remaining == 1
        assert finish(worker, {second: "b"}, hints) == {second}
        assert executions(merged) == {"ready"}
        assert not JobDependency.objects.filter(settled=False).exists()
        assert (row(first).return_value, row(second).return_value) == ("a", "b")

    def test_a_batched_finish_counts_the_batch(self, worker, hints):
        made = enqueue_batch([(bt.item, [n], {}) for n in range(3)], on_finish=bt.callback)
        items = [int(result.id) for result in made.results]
        claim(worker, start=True)
        assert finish(worker, {items[0]: 0, items[1]: 1}, hints) == set(items[:2])
        batch = Batch.objects.get(pk=made.id)
        assert (batch.pending, batch.succeeded, batch.failed, batch.finished_at) == (1, 2, 0, None)
        assert batch.callback_jobs == {}
        assert finish(worker, {items[2]: 2}, hints) == {items[2]}
        batch = Batch.objects.get(pk=made.id)
        assert (batch.pending, batch.succeeded, batch.failed) == (0, 3, 0)
        assert batch.finished_at is not None
        callback = row(batch.callback_jobs["on_finish"])
        assert callback.status == READY
        assert callback.kwargs == {"batch_id": made.id, "succeeded": 3, "failed": 0}
        assert [(row(pk).status, row(pk).return_value) for pk in items] == [
            (SUCCEEDED, n) for n in range(3)
        ]
        assert not ClaimedExecution.objects.exists()

    def test_one_call_finishes_plain_keyed_and_batched_jobs_together(self, worker, hints):
        plain = enqueue(tt.noop)
        keyed = enqueue(tt.one_at_a_time, "x")
        behind_keyed = enqueue(tt.one_at_a_time, "x")
        made = enqueue_batch([(bt.item, [n], {}) for n in range(2)], concurrency_limit=1)
        first_item, second_item = (int(result.id) for result in made.results)
        batch_key = f"django_jobs.batch/{made.id}"
        assert statuses(behind_keyed, second_item) == [BLOCKED, BLOCKED]
        assert ids(claim(worker, start=True)) == [plain, keyed, first_item]
        done = finish(worker, {plain: "p", keyed: "k", first_item: 0}, hints)
        assert done == {plain, keyed, first_item}
        assert statuses(plain, keyed, first_item) == [SUCCEEDED] * 3
        assert statuses(behind_keyed, second_item) == [READY, READY]
        batch = Batch.objects.get(pk=made.id)
        assert (batch.pending, batch.succeeded) == (1, 1)
        for key in ("one/x", batch_key):
            assert semaphore(key) == (1, 0)
            assert_slots_agree(key)

    def test_a_job_whose_claim_is_gone_is_not_finished_twice(self, worker, other, hints):
        plain = enqueue(tt.noop)
        claim(worker, 1, start=True)
        recovered = enqueue(tt.retried_at_once)
        claim(other, 1, start=True)
        keyed = enqueue(tt.one_at_a_time, "x")
        claim(worker, 1, start=True)
        behind = enqueue(tt.one_at_a_time, "x")

        assert finish(worker, {plain: 1, keyed: "k"}, hints) == {plain, keyed}
        finished_at = row(plain).finished_at
        assert row(behind).status == READY
        last = enqueue(tt.one_at_a_time, "x")
        assert row(last).status == BLOCKED
        # Again, with other values: nothing is written, and no second slot is freed.
        assert finish(worker, {plain: 2, keyed: "again"}, hints) == set()
        assert (row(plain).return_value, row(plain).finished_at) == (1, finished_at)
        assert row(keyed).return_value == "k"
        assert row(last).status == BLOCKED
        assert semaphore("one/x") == (1, 0)
        assert_slots_agree("one/x")

        # Another process's claim is not this process's to finish.
        assert finish(worker, {recovered: "not mine"}, hints) == set()
        assert (row(recovered).status, row(recovered).return_value) == (RUNNING, None)
        # Its owner was taken for dead and the job retried: the late owner finishes nothing.
        assert recover_process_claims(DB, other.pk, "taken for dead") == {recovered: "retried"}
        assert finish(other, {recovered: "late"}, hints) == set()
        job = row(recovered)
        assert (job.status, job.attempts, job.return_value, job.finished_at) == (
            READY,
            1,
            None,
            None,
        )
        assert executions(recovered) == {"ready"}


@needs_row_locks
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("hints", HINTS[:2])
def test_a_finish_waiting_behind_a_recovery_finds_the_claim_gone(worker, hints):
    """TestFinish's exactly-once, raced: the recovery of the job holds its claim's lock
    (and has deleted it) while the worker's finish arrives; the finish waits for the
    lock, then finds nothing to finish."""
    job_id = enqueue(tt.one_at_a_time_retried, "x")  # max_attempts=3, backoff=0
    claim(worker, start=True)
    behind = enqueue(tt.one_at_a_time, "x")

    def recover() -> dict[int, str]:
        return recover_process_claims(DB, worker.pk, "taken for dead")

    with held_by_another_transaction(recover) as recovery:
        finisher = Session(lambda: finish(worker, {job_id: "late"}, hints))
        finisher.wait_until_blocked()
    assert recovery.join() == {job_id: "retried"}
    assert finisher.join() == set()
    job = row(job_id)
    # Retried at once, through the key: the job that waited behind it had the slot first.
    assert (job.status, job.attempts, job.return_value, job.finished_at) == (
        BLOCKED,
        1,
        None,
        None,
    )
    assert row(behind).status == READY
    assert list(FailedExecution.objects.values_list("job_id", "exception_class_path")) == [
        (job_id, PROCESS_DIED)
    ]
    assert semaphore("one/x") == (1, 0)
    assert_slots_agree("one/x")


# --- fail -----------------------------------------------------------------------------------


@pytest.mark.django_db
class TestFail:
    def test_a_failure_with_attempts_left_is_retried_after_its_backoff(self, worker):
        job_id = enqueue(tt.retried_later)  # max_attempts=3, backoff=30
        claim(worker, start=True)
        before = timezone.now()
        outcome = fail_job(DB, job_id, worker.pk, BOOM, worker_id=worker.name)
        after = timezone.now()
        assert outcome.will_retry
        assert before + timedelta(seconds=30) <= outcome.retry_at <= after + timedelta(seconds=30)
        job = row(job_id)
        assert (job.status, job.attempts, job.finished_at) == (SCHEDULED, 1, None)
        assert executions(job_id) == {"scheduled"}
        assert ScheduledExecution.objects.get(job_id=job_id).scheduled_at == outcome.retry_at
        failure = FailedExecution.objects.get(job_id=job_id)
        assert (failure.attempt, failure.worker_id, failure.exception_class_path) == (
            1,
            worker.name,
            "builtins.ValueError",
        )
        assert (failure.message, failure.traceback) == (BOOM.message, BOOM.traceback)

    @pytest.mark.parametrize(
        "task, retry",
        [(tt.noop, True), (tt.retried_later, False)],
        ids=["attempts-used-up", "retry-refused"],
    )
    def test_a_failure_without_a_retry_fails_for_good(self, worker, task, retry):
        job_id = enqueue(task)
        claim(worker, start=True)
        outcome = fail_job(DB, job_id, worker.pk, BOOM, worker_id=worker.name, retry=retry)
        assert not outcome.will_retry
        job = row(job_id)
        assert (job.status, job.attempts) == (FAILED, 1)
        assert job.finished_at is not None
        assert executions(job_id) == set()
        assert FailedExecution.objects.filter(job_id=job_id, attempt=1).count() == 1

    def test_a_failure_frees_the_slot_for_the_next_blocked_job(self, worker):
        holder = enqueue(tt.one_at_a_time, "x")
        claim(worker, start=True)
        behind = enqueue(tt.one_at_a_time, "x")
        assert not fail_job(DB, holder, worker.pk, BOOM).will_retry
        assert row(holder).status == FAILED
        assert (row(behind).status, executions(behind)) == (READY, {"ready"})
        assert semaphore("one/x") == (1, 0)
        assert_slots_agree("one/x")

    def test_a_retry_due_at_once_goes_back_through_the_limit(self, worker):
        holder = enqueue(tt.one_at_a_time_retried, "x")  # max_attempts=3, backoff=0
        claim(worker, start=True)
        behind = enqueue(tt.one_at_a_time, "x")
        outcome = fail_job(DB, holder, worker.pk, BOOM)
        assert outcome.will_retry and outcome.retry_at <= timezone.now()
        # The freed slot went to the job waiting for it; the retry waits its turn.
        assert (row(holder).status, row(holder).attempts, executions(holder)) == (
            BLOCKED,
            1,
            {"blocked"},
        )
        assert row(behind).status == READY
        assert semaphore("one/x") == (1, 0)
        assert_slots_agree("one/x")

    def test_a_lost_claim_is_not_failed(self, worker, other):
        job_id = enqueue(tt.retried_later)
        claim(worker, start=True)
        assert fail_job(DB, job_id, other.pk, BOOM) is None
        assert (row(job_id).status, executions(job_id)) == (RUNNING, {"claimed"})
        assert finish_jobs(DB, worker.pk, {job_id: 1}) == {job_id}
        assert fail_job(DB, job_id, worker.pk, BOOM) is None
        assert (row(job_id).status, row(job_id).return_value) == (SUCCEEDED, 1)
        assert not FailedExecution.objects.exists()
        assert not ScheduledExecution.objects.exists()


# --- release --------------------------------------------------------------------------------


@pytest.mark.django_db
class TestRelease:
    @pytest.mark.parametrize("how", ["claimed", "claimed then started", "claim=start"])
    def test_a_released_job_is_ready_again_without_the_attempt(self, worker, how):
        job_id = enqueue(tt.noop)
        if how == "claim=start":
            claim(worker, start=True)
        elif how == "claimed then started":
            running(worker, job_id)
        else:
            claim(worker)
        assert release_job(DB, job_id, worker.pk)
        job = row(job_id)
        assert (job.status, job.attempts, job.worker_ids, job.started_at) == (READY, 0, [], None)
        assert executions(job_id) == {"ready"}
        assert not FailedExecution.objects.exists()

    def test_a_retried_job_released_keeps_its_earlier_attempts(self, worker):
        job_id = enqueue(tt.retried_at_once)  # max_attempts=3, backoff=0
        claim(worker, start=True)
        first_start = row(job_id).started_at
        assert fail_job(DB, job_id, worker.pk, BOOM).will_retry
        claim(worker, start=True)
        assert row(job_id).attempts == 2
        assert release_job(DB, job_id, worker.pk)
        job = row(job_id)
        assert (job.status, job.attempts, job.worker_ids) == (READY, 1, [worker.name])
        assert job.started_at == first_start

    def test_a_keyed_job_goes_back_through_the_limit(self, worker):
        released = enqueue(tt.one_at_a_time, "x")
        claim(worker, start=True)
        outranking = enqueue(tt.one_at_a_time.using(priority=3), "x")
        alone = enqueue(tt.one_at_a_time, "y")
        claim(worker, start=True)
        assert release_job(DB, released, worker.pk) and release_job(DB, alone, worker.pk)
        # The higher priority takes the freed slot; the released job waits again, unpaid.
        assert (row(outranking).status, executions(outranking)) == (READY, {"ready"})
        assert (row(released).status, row(released).attempts) == (BLOCKED, 0)
        assert executions(released) == {"blocked"}
        assert (row(alone).status, row(alone).attempts, executions(alone)) == (READY, 0, {"ready"})
        for key in ("one/x", "one/y"):
            assert semaphore(key) == (1, 0)
            assert_slots_agree(key)

    def test_a_lost_claim_is_not_released(self, worker, other):
        job_id = enqueue(tt.noop)
        claim(worker, start=True)
        assert not release_job(DB, job_id, other.pk)
        assert (row(job_id).status, row(job_id).attempts, executions(job_id)) == (
            RUNNING,
            1,
            {"claimed"},
        )


# --- snooze ---------------------------------------------------------------------------------


@pytest.mark.django_db
class TestSnooze:
    def test_a_snoozed_job_waits_with_its_start_kept_and_no_retry_used(self, worker):
        job_id = enqueue(tt.noop)  # max_attempts=1
        claim(worker, start=True)
        before = timezone.now()
        run_at = snooze_job(DB, job_id, worker.pk, 60)
        assert before + timedelta(seconds=60) <= run_at <= timezone.now() + timedelta(seconds=60)
        job = row(job_id)
        assert (job.status, job.attempts, job.max_attempts) == (SCHEDULED, 1, 2)
        assert executions(job_id) == {"scheduled"}
        assert ScheduledExecution.objects.get(job_id=job_id).scheduled_at == run_at
        assert not FailedExecution.objects.exists()

    @pytest.mark.parametrize("seconds, waits_as", [(0, BLOCKED), (60, SCHEDULED)])
    def test_a_snooze_frees_the_slot_and_comes_back_through_the_limit(
        self, worker, seconds, waits_as
    ):
        snoozed = enqueue(tt.one_at_a_time, "x")
        claim(worker, start=True)
        behind = enqueue(tt.one_at_a_time, "x")
        assert snooze_job(DB, snoozed, worker.pk, seconds) is not None
        job = row(snoozed)
        assert (job.status, job.attempts, job.max_attempts) == (waits_as, 1, 2)
        assert executions(snoozed) == {"blocked" if waits_as == BLOCKED else "scheduled"}
        assert (row(behind).status, executions(behind)) == (READY, {"ready"})
        assert semaphore("one/x") == (1, 0)
        assert_slots_agree("one/x")

    def test_a_lost_claim_is_not_snoozed(self, worker, other):
        job_id = enqueue(tt.noop)
        claim(worker, start=True)
        assert snooze_job(DB, job_id, other.pk, 60) is None
        job = row(job_id)
        assert (job.status, job.max_attempts, executions(job_id)) == (RUNNING, 1, {"claimed"})


# --- recover --------------------------------------------------------------------------------


@pytest.mark.django_db
class TestRecover:
    def test_each_claim_is_settled_by_whether_it_started_and_only_once(self, worker, other):
        never_started = enqueue(tt.noop)
        claim(worker, 1)
        retried = enqueue(tt.retried_later)  # max_attempts=3, backoff=30
        running(worker, retried)
        last_attempt = enqueue(tt.noop)
        claim(worker, 1, start=True)
        not_its_own = enqueue(tt.noop)
        claim(other, 1, start=True)
        reason = "worker w (pid 1) stopped heartbeating"
        before = timezone.now()
        assert recover_process_claims(DB, worker.pk, reason) == {
            never_started: "released",
            retried: "retried",
            last_attempt: "failed",
        }

        def settled() -> list[tuple]:
            jobs = [row(pk) for pk in (never_started, retried, last_attempt, not_its_own)]
            return [(job.status, job.attempts, executions(job.pk)) for job in jobs]

        outcome = settled()
        assert outcome == [
            (READY, 0, {"ready"}),
            (SCHEDULED, 1, {"scheduled"}),
            (FAILED, 1, set()),
            (RUNNING, 1, {"claimed"}),
        ]
        scheduled_at = ScheduledExecution.objects.get(job_id=retried).scheduled_at
        assert scheduled_at >= before + timedelta(seconds=30)
        assert row(last_attempt).finished_at is not None
        failures = FailedExecution.objects.order_by("job_id")
        assert [(f.job_id, f.attempt, f.exception_class_path, f.message) for f in failures] == [
            (retried, 1, PROCESS_DIED, reason),
            (last_attempt, 1, PROCESS_DIED, reason),
        ]
        # Called again: nothing left to settle, nothing written twice.
        assert recover_process_claims(DB, worker.pk, reason) == {}
        assert settled() == outcome
        assert FailedExecution.objects.count() == 2
        assert ClaimedExecution.objects.get(job_id=not_its_own).process_id == other.pk

    def test_keyed_claims_free_their_slots_once(self, worker):
        started = enqueue(tt.one_at_a_time, "x")
        claim(worker, start=True)
        next_x, last_x = enqueue(tt.one_at_a_time, "x"), enqueue(tt.one_at_a_time, "x")
        unstarted = enqueue(tt.one_at_a_time, "y")
        claim(worker)
        outranking = enqueue(tt.one_at_a_time.using(priority=3), "y")
        assert recover_process_claims(DB, worker.pk, "gone") == {
            started: "failed",
            unstarted: "released",
        }
        assert recover_process_claims(DB, worker.pk, "gone") == {}
        assert statuses(started, next_x, last_x) == [FAILED, READY, BLOCKED]
        # The unstarted claim goes back through its key's limit, costing nothing.
        assert (row(outranking).status, row(unstarted).status) == (READY, BLOCKED)
        assert row(unstarted).attempts == 0
        for key in ("one/x", "one/y"):
            assert semaphore(key) == (1, 0)
            assert_slots_agree(key)


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_a_recovery_waiting_behind_another_recovery_settles_nothing(worker):
    job_id = enqueue(tt.one_at_a_time, "x")
    claim(worker, start=True)
    behind = enqueue(tt.one_at_a_time, "x")

    def recover() -> dict[int, str]:
        return recover_process_claims(DB, worker.pk, "first")

    with held_by_another_transaction(recover) as first:
        second = Session(lambda: recover_process_claims(DB, worker.pk, "second"))
        second.wait_until_blocked()
    assert first.join() == {job_id: "failed"}
    assert second.join() == {}
    assert statuses(job_id, behind) == [FAILED, READY]
    assert list(FailedExecution.objects.values_list("message", flat=True)) == ["first"]
    assert semaphore("one/x") == (1, 0)
    assert_slots_agree("one/x")


# --- promote --------------------------------------------------------------------------------


def scheduled(task, *args: Any) -> int:
    """A job enqueued to run in an hour: it waits as scheduled."""
    return enqueue(task.using(run_after=timezone.now() + timedelta(hours=1)), *args)


def make_due(*job_ids: int, ago: float = 1.0) -> None:
    ScheduledExecution.objects.filter(job_id__in=job_ids).update(
        scheduled_at=timezone.now() - timedelta(seconds=ago)
    )


@pytest.mark.django_db
class TestPromote:
    def test_due_jobs_become_ready_in_their_queue_and_priority_and_the_rest_wait(self):
        due = scheduled(tt.noop.using(queue_name="emails", priority=7))
        also_due = scheduled(tt.noop)
        future = scheduled(tt.noop)
        assert statuses(due, also_due, future) == [SCHEDULED] * 3
        assert promote_due_jobs(DB, 10) == 0
        make_due(due, also_due)
        assert promote_due_jobs(DB, 10) == 2
        assert statuses(due, also_due, future) == [READY, READY, SCHEDULED]
        ready = ReadyExecution.objects.get(job_id=due)
        assert (ready.queue_name, ready.priority) == ("emails", 7)
        assert executions(due) == executions(also_due) == {"ready"}
        assert executions(future) == {"scheduled"}
        assert promote_due_jobs(DB, 10) == 0

    def test_a_batch_takes_the_most_overdue_first(self):
        jobs = [scheduled(tt.noop) for _ in range(3)]
        for n, job_id in enumerate(jobs):
            make_due(job_id, ago=100 - n)  # the first made is the most overdue
        assert promote_due_jobs(DB, 2) == 2
        assert statuses(*jobs) == [READY, READY, SCHEDULED]
        assert promote_due_jobs(DB, 2) == 1
        assert statuses(*jobs) == [READY] * 3

    def test_due_keyed_jobs_are_admitted_through_their_key(self, worker):
        holder = enqueue(tt.one_at_a_time, "x")
        claim(worker, start=True)
        low = scheduled(tt.one_at_a_time.using(priority=1), "x")
        high = scheduled(tt.one_at_a_time.using(priority=5), "x")
        first_y, second_y = scheduled(tt.one_at_a_time, "y"), scheduled(tt.one_at_a_time, "y")
        make_due(low, high, first_y, second_y)
        assert promote_due_jobs(DB, 10) == 4
        # x's slot is held by a running job; y's one slot goes to the older of two.
        assert statuses(low, high, first_y, second_y) == [BLOCKED, BLOCKED, READY, BLOCKED]
        assert finish_jobs(DB, worker.pk, {holder: None}) == {holder}
        assert statuses(low, high) == [BLOCKED, READY]
        for key in ("one/x", "one/y"):
            assert semaphore(key) == (1, 0)
            assert_slots_agree(key)

    @needs_skip_locked
    @pytest.mark.django_db(transaction=True)
    def test_a_row_another_transaction_holds_is_skipped_not_waited_for(self):
        held, free = scheduled(tt.noop), scheduled(tt.noop)
        make_due(held, ago=100)  # the first a promotion would take
        make_due(free)

        def lock_held() -> object:
            return ScheduledExecution.objects.select_for_update().get(job_id=held)

        with held_by_another_transaction(lock_held):
            assert InThread(lambda: promote_due_jobs(DB, 10)).join() == 1
            assert statuses(held, free) == [SCHEDULED, READY]
        assert promote_due_jobs(DB, 10) == 1
        assert statuses(held, free) == [READY, READY]


# --- the rate decision ----------------------------------------------------------------------


def start_next(worker) -> list[Job]:
    """The worker's claim and start of whatever is ready; the jobs started."""
    return start_jobs(DB, claim(worker, start=True), worker.pk, worker.name)


@pytest.mark.django_db
class TestRateDecision:
    def test_n_starts_per_period_are_admitted_and_the_next_waits(self, worker):
        made = [enqueue(three_an_hour, n) for n in range(4)]
        assert ids(start_next(worker)) == made[:3]
        assert [(row(pk).status, row(pk).attempts) for pk in made] == [
            (RUNNING, 1),
            (RUNNING, 1),
            (RUNNING, 1),
            (SCHEDULED, 0),
        ]
        waiting = row(made[3])
        first_start = row(made[0]).last_attempted_at
        assert waiting.rate_reserved_at == first_start + timedelta(hours=1)
        assert ScheduledExecution.objects.get(job_id=made[3]).scheduled_at == (
            waiting.rate_reserved_at
        )
        window = RateLimit.objects.get(key="tests.tasks.echo")
        assert (window.limit, window.period, len(window.starts)) == (3, 3600.0, 3)

    def test_the_window_holds_across_separate_starts_and_a_due_job_waits_again(self, worker):
        for n in range(3):
            job_id = enqueue(three_an_hour, n)
            assert ids(start_next(worker)) == [job_id]
        fourth = enqueue(three_an_hour, 3)
        assert start_next(worker) == []
        assert (row(fourth).status, row(fourth).attempts) == (SCHEDULED, 0)
        # Its planned time comes early (made due now): promoted, claimed, and sent back
        # again while three starts still fill the hour, still without an attempt.
        make_due(fourth)
        assert promote_due_jobs(DB, 10) == 1
        assert row(fourth).status == READY
        assert start_next(worker) == []
        job = row(fourth)
        assert (job.status, job.attempts, job.worker_ids, executions(fourth)) == (
            SCHEDULED,
            0,
            [],
            {"scheduled"},
        )
        assert Job.objects.filter(status=RUNNING).count() == 3
        assert len(RateLimit.objects.get(key="tests.tasks.echo").starts) == 3

    def test_each_rate_key_has_its_own_window(self, worker):
        a1, a2, b1 = (enqueue(hourly_per_value, value) for value in ("a", "a", "b"))
        assert sorted(ids(start_next(worker))) == [a1, b1]
        assert statuses(a1, a2, b1) == [RUNNING, SCHEDULED, RUNNING]
        assert row(a2).attempts == 0
        keys = sorted(RateLimit.objects.values_list("key", flat=True))
        assert keys == ["tests.tasks.echo/a", "tests.tasks.echo/b"]


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_two_starts_at_once_take_the_last_start_of_a_window_once(worker, other):
    """The decision is taken under the key's row lock: the second start waits for the
    first to commit, then sees its start and sends its own job back."""
    first = enqueue(rate_tasks.once_a_minute, 1)
    (first_job,) = claim(worker, 1)
    second = enqueue(rate_tasks.once_a_minute, 2)
    (second_job,) = claim(other, 1)
    ensure_rate_rows(DB, ["tests.rate_tasks.once_a_minute"])

    def start_first() -> list[int]:
        return ids(start_jobs(DB, [first_job], worker.pk, worker.name))

    with held_by_another_transaction(start_first) as starter:
        late = Session(lambda: ids(start_jobs(DB, [second_job], other.pk, other.name)))
        late.wait_until_blocked()
    assert starter.join() == [first]
    assert late.join() == []
    assert (row(first).status, row(first).attempts) == (RUNNING, 1)
    job = row(second)
    assert (job.status, job.attempts, executions(second)) == (SCHEDULED, 0, {"scheduled"})
    assert job.rate_reserved_at == row(first).last_attempted_at + timedelta(minutes=1)


# --- slot accounting ------------------------------------------------------------------------


@pytest.mark.django_db
class TestSlots:
    def test_release_slots_recounts_from_the_holders_never_above_the_limit(self, worker):
        holders = [enqueue(tt.two_at_a_time, "x", n) for n in range(2)]
        blocked = enqueue(tt.two_at_a_time, "x", 2)
        claim(worker, 1, start=True)
        for drifted in (5, -3, 2):
            Semaphore.objects.filter(key="two/x").update(value=drifted)
            for _ in range(2):  # however many times it runs
                with transaction.atomic():
                    assert release_slots(DB, ["two/x"]) == 0
                assert semaphore("two/x") == (2, 0)
        assert statuses(*holders, blocked) == [RUNNING, READY, BLOCKED]
        assert_slots_agree("two/x")

    def test_release_slots_fills_each_keys_free_slots_by_priority_then_age(self):
        SemaphoreFactory(key="k-b", limit=2, value=0)
        SemaphoreFactory(key="k-a", limit=1, value=0)

        def waiting(key: str, priority: int) -> int:
            job = JobFactory(
                status=BLOCKED, concurrency_key=key, concurrency_limit=2, priority=priority
            )
            return BlockedExecutionFactory(job=job).job_id

        b_low, b_high, b_high_newer, b_last = (waiting("k-b", p) for p in (0, 5, 5, 0))
        a_first, a_second = waiting("k-a", 0), waiting("k-a", 0)
        with transaction.atomic():
            assert release_slots(DB, ["k-b", "k-a", "k-b"]) == 3
        assert statuses(b_low, b_high, b_high_newer, b_last) == [BLOCKED, READY, READY, BLOCKED]
        assert statuses(a_first, a_second) == [READY, BLOCKED]
        assert executions(b_high) == executions(a_first) == {"ready"}
        assert semaphore("k-b") == (2, 0) and semaphore("k-a") == (1, 0)
        assert_slots_agree("k-b")
        assert_slots_agree("k-a")

    def test_release_slots_of_unknown_keys_does_nothing(self):
        with transaction.atomic():
            assert release_slots(DB, ["nobody", "no-one"]) == 0
            assert release_slots(DB, []) == 0
        assert not Semaphore.objects.exists()

    def test_count_holders_counts_ready_and_live_claims_of_the_key_only(self, worker):
        leased = tt.two_at_a_time.using(concurrency_limit=3, concurrency_duration=600)
        x1, x2, x3, x4 = (enqueue(leased, "x", n) for n in range(4))
        enqueue(tt.two_at_a_time, "y")
        assert statuses(x1, x2, x3, x4) == [READY, READY, READY, BLOCKED]
        assert ids(claim_jobs(DB, worker.pk, QueueSelector(("default",)), 2)) == [x1, x2]
        assert count_holders(DB, "two/x") == 3  # two claims, one ready; not the blocked one
        assert ClaimedExecution.objects.get(job_id=x1).lease_expires_at is not None
        # A claim whose lease ran out no longer holds a slot.
        ClaimedExecution.objects.filter(job_id=x2).update(
            lease_expires_at=timezone.now() - timedelta(seconds=1)
        )
        assert count_holders(DB, "two/x") == 2
        assert count_holders(DB, "two/y") == 1
        assert count_holders(DB, "nobody") == 0

    def test_lock_semaphores_gives_the_existing_rows_in_code_point_order(self):
        # Code point order ("B" < "Z" < "a" < "m"), not a case-insensitive collation's.
        for key in ("m", "a", "Z", "B"):
            SemaphoreFactory(key=key)
        with transaction.atomic():
            locked = lock_semaphores(DB, ["m", "a", "nope", "Z", "B", "a"])
            assert [found.key for found in locked] == ["B", "Z", "a", "m"]
            assert lock_semaphores(DB, []) == []


@needs_skip_locked
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "held, locked_meanwhile",
    [("a", {"B"}), ("B", set())],
    ids=["waits-at-the-second", "waits-at-the-first"],
)
def test_lock_semaphores_takes_the_locks_in_ascending_key_order(held, locked_meanwhile):
    """Another transaction holds one semaphore; ``lock_semaphores`` of three keys must
    have locked exactly the keys before it (by code point: "B" < "a" < "m") while it
    waits for it, and none after it. A lock taken in another order (a case-insensitive
    collation's "a" < "B" < "m", or the order asked) fails one of the two cases."""
    for key in ("m", "a", "B"):
        SemaphoreFactory(key=key)
    done = threading.Event()

    def lock_all() -> list[str]:
        with transaction.atomic(using=DB):
            keys = [found.key for found in lock_semaphores(DB, ["m", "a", "B"])]
            assert done.wait(TIMEOUT), "never released"
        return keys

    def lock_one() -> object:
        return Semaphore.objects.select_for_update().get(key=held)

    try:
        with held_by_another_transaction(lock_one):
            locker = Session(lock_all)
            locker.wait_until_blocked()
            others = {"m", "a", "B"} - {held}
            assert {key for key in others if locked_elsewhere(Semaphore, key=key)} == (
                locked_meanwhile
            )
        # The holder is gone: the locker has them all, and says so in order.
        assert wait_until(lambda: all(locked_elsewhere(Semaphore, key=k) for k in ("m", "a", "B")))
    finally:
        done.set()
    assert locker.join() == ["B", "a", "m"]


# --- a workflow's rows ----------------------------------------------------------------------


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunk boundaries within a few rows where a database writes in chunks (PostgreSQL's
    column arrays): each chunk's ids must still go to its own jobs."""
    monkeypatch.setattr("django_jobs.db.postgresql.insert.CHUNK_SIZE", 3)


def concrete_values(instance, *, skip: tuple[str, ...] = ()) -> dict[str, object]:
    return {
        field.attname: getattr(instance, field.attname)
        for field in type(instance)._meta.concrete_fields
        if field.attname not in skip
    }


def edge_columns(edge: JobDependency) -> tuple[int, int, int, bool]:
    return (edge.job_id, edge.depends_on_id, edge.position, edge.settled)


def workflow_jobs(count: int) -> list[Job]:
    """Unsaved jobs as a workflow writes them (the real enqueue's, then its marks), each
    different: JSON documents, nulls and set values, datetimes to the microsecond."""
    workflow = Workflow.objects.create(name="conformance")
    backend = tasks.echo.get_backend()
    shapes = [
        tasks.echo,
        tasks.add.using(queue_name="reports", priority=-3, run_after=timezone.now()),
        tt.two_at_a_time,
        tasks.always_fails,
    ]
    jobs = []
    for n in range(count):
        task = shapes[n % len(shapes)]
        args = {
            0: [{"n": n, "nested": [1.5, None, True, "é\u2028"], "empty": {}}],
            1: [n, -n],
            2: ["x", n],
            3: [f"message {n}"],
        }[n % len(shapes)]
        job, _ = backend.prepare_job(task, args, {})
        job.workflow_id = workflow.pk
        if n % 2:
            job.status = JobStatus.AWAITING
            job.on_dependency_failure = DependencyFailure.RUN
        if n % 3 == 0:
            job.trace_context = {"traceparent": f"00-{n:032x}-{n:016x}-01"}
            job.progress_at = timezone.now() - timedelta(microseconds=n + 1)
        jobs.append(job)
    return jobs


@pytest.mark.django_db
class TestWorkflowRows:
    @pytest.mark.parametrize("count", [1, 7])
    def test_insert_jobs_sets_the_ids_in_order_and_writes_the_rows_as_given(
        self, small_chunks, count
    ):
        jobs = workflow_jobs(count)
        given = [concrete_values(job, skip=("id",)) for job in jobs]
        with transaction.atomic():
            ops(DB).insert_jobs(DB, jobs)
        assert all(job.pk is not None and not job._state.adding for job in jobs)
        assert ids(jobs) == sorted(ids(jobs))  # in the order given
        assert len(set(ids(jobs))) == count
        written = {job.pk: job for job in Job.objects.filter(pk__in=ids(jobs))}
        assert [concrete_values(written[job.pk], skip=("id",)) for job in jobs] == given
        # Job rows only: no execution row of any kind.
        assert not any(executions(job.pk) for job in jobs)
        assert not AwaitingExecution.objects.exists()

    def test_insert_jobs_of_none_writes_nothing(self):
        ops(DB).insert_jobs(DB, [])
        assert not Job.objects.exists()

    def test_insert_rows_writes_edges_and_awaiting_rows_as_given(self, small_chunks):
        jobs = workflow_jobs(5)
        ops(DB).insert_jobs(DB, jobs)
        root, *rest = ids(jobs)
        edges = [
            JobDependency(job_id=pk, depends_on_id=parent, position=position, settled=not position)
            for i, pk in enumerate(rest)
            for position, parent in enumerate([root, *rest[i - 1 : i]])
        ]
        now = timezone.now()
        awaiting = [
            AwaitingExecution(
                job_id=pk,
                queue_name=f"queue-{n}",
                priority=n - 2,
                remaining=n,
                created_at=now - timedelta(microseconds=n),
            )
            for n, pk in enumerate(rest)
        ]
        with transaction.atomic():
            ops(DB).insert_rows(DB, JobDependency, edges)
            ops(DB).insert_rows(DB, AwaitingExecution, awaiting)
            ops(DB).insert_rows(DB, JobDependency, [])
        # An edge's id is its own (nobody reads it back); its columns are as given.
        assert len(edges) == 7
        assert sorted(map(edge_columns, JobDependency.objects.all())) == sorted(
            map(edge_columns, edges)
        )
        # An awaiting row's primary key is its job's: a column inserted as given.
        assert {row.job_id: concrete_values(row) for row in AwaitingExecution.objects.all()} == {
            row.job_id: concrete_values(row) for row in awaiting
        }

    @needs_string_lengths
    @pytest.mark.parametrize("written", ["jobs", "rows"])
    def test_a_string_longer_than_its_column_is_refused_not_cut_short(self, written):
        """An array cast to varchar(n)[] would cut it short without a word (PostgreSQL):
        the insert must refuse it, as a single insert does."""
        (job,) = workflow_jobs(1)
        with pytest.raises(DataError), transaction.atomic():
            if written == "jobs":
                job.queue_name = "q" * 200
                ops(DB).insert_jobs(DB, [job])
            else:
                ops(DB).insert_jobs(DB, [job])
                row = AwaitingExecution(job_id=job.pk, queue_name="q" * 200, remaining=1)
                ops(DB).insert_rows(DB, AwaitingExecution, [row])
        assert not Job.objects.exists() and not AwaitingExecution.objects.exists()


# --- a fair group's stamp, read and written back (Operations.fair_group_state) --------------

needs_exclusive_writes = pytest.mark.skipif(
    not features(DB).writes_hold_the_database,
    reason="a write transaction here does not exclude the other writers: the stamp is "
    "locked (core.fairness.lock_stamps)",
)


def fair_sequence(worker) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Single enqueues of a fair queue through each case of the rule, with claims between
    them: each job's group and turn, then each group's stamp, counted from the first job's
    FIFO turn (the ids of two runs differ by an offset, their steps do not)."""
    from tests.fair_tasks import tenant_report

    reports = QueueSelector(("reports",))
    given: list[tuple[str, int]] = []

    def one(tenant: str, **options: Any) -> None:
        task = tenant_report.using(**options) if options else tenant_report
        pk = int(task.enqueue(tenant).id)
        given.append((tenant, ReadyExecution.objects.get(job_id=pk).turn))

    one("A")  # a new group at an idle level: its own place
    one("A")  # its last job waits: a step after it
    one("B", fair_weight=2)  # a new group behind a backlog: the head
    one("B", fair_weight=2)  # half a step after its last
    claim_jobs(DB, worker.pk, reports, 2)
    one("A")
    FairTurn.objects.filter(fair_key="B").update(last_turn=-7)
    one("B")  # a stamp no enqueue writes: FIFO, and written again
    one("B")
    while claim_jobs(DB, worker.pk, reports, 10):
        pass
    one("C")  # the level idle again: its own place
    one("A")  # nothing of A waits: the head
    first = given[0][1]
    stamps = FairTurn.objects.order_by("fair_key").values_list("fair_key", "last_turn")
    return (
        [(tenant, turn - first) for tenant, turn in given],
        [(key, turn - first) for key, turn in stamps],
    )


@needs_exclusive_writes
@pytest.mark.django_db
def test_a_fair_stamp_read_and_written_back_gives_the_locked_paths_turns(worker, monkeypatch):
    """The two statements of ``fair_group_state`` and ``write_fair_stamp``
    (``core.fairness.stamp_alone``) against the portable stamping (the upsert that locks,
    then the reads): the same enqueues and claims give the same turns and stamps."""
    from django.conf import settings
    from django.test import override_settings

    with override_settings(DJANGO_JOBS={**settings.DJANGO_JOBS, "fair_queues": ["reports"]}):
        read_back = fair_sequence(worker)
        for model in (ReadyExecution, ClaimedExecution, FairTurn, Job):
            model.objects.all().delete()
        monkeypatch.setattr(type(features(DB)), "writes_hold_the_database", False)
        locked = fair_sequence(worker)
    assert read_back == locked
    turns = [turn for _, turn in read_back[0]]
    # Each case moved the turn as the rule says (so the two paths agreeing is no accident of
    # both giving FIFO turns): a step, a half step, FIFO after the broken stamp.
    assert turns[1] == turns[0] + TURN_SCALE and turns[3] == turns[2] + TURN_SCALE // 2
    assert turns[5] == 5 * TURN_SCALE
