"""Async and sync jobs: the kind follows a job onto every ready row it gets, and a claim for
one lane takes jobs of that kind only (``core/lanes.py``, migration 0022).

A worker whose threads are busy but whose event loop has room claims ``lane=ASYNC``
(``runtime/worker.py``, ``Worker.capacity``): its claim filters on the ready row's copy of
``Job.is_async``. A path that made a job ready without copying it would leave an async job
on a sync row, run by no lane of a process whose threads stay busy, or a sync job taken by a
loop that cannot run it. So each path that writes a ready row is taken here for an async
and a sync job, and ends with the job claimable by its own lane and by no other.

In-process, on the real database: all three. The race of the two lanes' claims needs row
locks (PostgreSQL, MariaDB); SQLite serialises writers.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs import bulk_enqueue, enqueue_batch, workflow
from django_jobs.core.claimed import fail_job, finish_job, release_job, snooze_job
from django_jobs.core.fairness import fifo_turn
from django_jobs.core.lanes import Lane
from django_jobs.core.operator import retry_failed_job, run_blocked_now
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recovery import recover_process_claims
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.db import features
from django_jobs.db.mysql import ENQUEUE_PROCEDURE
from django_jobs.models import (
    Batch,
    BlockedExecution,
    ClaimedExecution,
    Job,
    JobStatus,
    Pause,
    ReadyExecution,
    ScheduledExecution,
)
from tests.lane_tasks import CALLBACK, ECHO
from tests.test_races import Runner, wait_for

DB = "default"
ALL = QueueSelector(("*",))
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")
KINDS = [False, True]
KIND_IDS = ["sync", "async"]


def lane_of(is_async: bool) -> Lane:
    return Lane.ASYNC if is_async else Lane.SYNC


def ids(jobs) -> list[int]:
    return [job.pk for job in jobs]


def pk(result) -> int:
    return int(result.id)


@pytest.fixture
def worker(db):
    return register_process(DB, "worker")


@pytest.fixture(params=KINDS, ids=KIND_IDS)
def is_async(request) -> bool:
    """The kind of the job a path makes ready: each test runs for both."""
    return request.param


def assert_ready_in_its_lane(worker, job_id: int, is_async: bool) -> None:
    """``job_id`` is ready, its job row and its ready row both of kind ``is_async``; the
    other lane's claim (of every queue, as many as there are) leaves it, and its own
    lane's claim takes it. Ends the job's test: it is claimed after."""
    job = Job.objects.get(pk=job_id)
    row = ReadyExecution.objects.get(job_id=job_id)
    assert job.status == JobStatus.READY
    assert (job.is_async, row.is_async) == (is_async, is_async)
    other = claim_jobs(DB, worker.pk, ALL, 1000, lane=lane_of(not is_async))
    assert job_id not in ids(other)
    assert {job.is_async for job in other} <= {not is_async}
    own = claim_jobs(DB, worker.pk, ALL, 1000, lane=lane_of(is_async))
    assert job_id in ids(own)
    assert {job.is_async for job in own} == {is_async}


def claim_only(worker, job_id: int, worker_id: str | None = "w"):
    """Claim ``job_id`` and nothing else, started at claim with ``worker_id``."""
    others = list(ReadyExecution.objects.exclude(job_id=job_id).values_list("job_id", flat=True))
    ReadyExecution.objects.filter(job_id__in=others).update(queue_name="parked")
    try:
        (job,) = claim_jobs(
            DB, worker.pk, QueueSelector(("default", "emails")), 1, worker_id=worker_id
        )
    finally:
        ReadyExecution.objects.filter(job_id__in=others).update(queue_name="default")
    assert job.pk == job_id
    return job


def make_due(job_id: int) -> None:
    """The scheduled row of ``job_id`` due now, for the dispatcher's next round."""
    past = timezone.now() - timedelta(seconds=1)
    assert ScheduledExecution.objects.filter(job_id=job_id).update(scheduled_at=past) == 1


# --- every path that makes a job ready copies its kind ---------------------------------


@pytest.mark.django_db
def test_a_single_enqueue_writes_the_kind_on_both_rows(worker, is_async):
    """One enqueue, by the path each database takes for it: PostgreSQL's one-statement
    insert (``db/postgresql/insert.py``), MariaDB's enqueue procedure (its ready INSERT
    writes ``LATER_READY_COLUMNS``), SQLite's statements (``make_ready``)."""
    task = ECHO[is_async]
    task.enqueue(0)  # MariaDB: the procedure's parameters are read once per process
    ReadyExecution.objects.all().delete()
    with CaptureQueriesContext(connection) as captured:
        job_id = pk(task.enqueue(1))
    statements = [query["sql"] for query in captured.captured_queries]
    if connection.vendor == "postgresql":
        assert len(statements) == 1 and "new_jobs" in statements[0]
    elif connection.vendor == "mysql":
        assert len(statements) == 1 and statements[0].startswith(f"CALL {ENQUEUE_PROCEDURE}")
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
def test_a_bulk_enqueue_writes_each_jobs_own_kind(worker):
    """Kinds interleaved in one bulk enqueue (PostgreSQL: one statement from column arrays;
    elsewhere ``bulk_create`` and ``make_ready``): each ready row is its own job's kind,
    not the first job's or the chunk's."""
    kinds = [n % 3 == 0 for n in range(12)]
    results = bulk_enqueue([(ECHO[kind], (n,), {}) for n, kind in enumerate(kinds)])
    made = {pk(result): kind for result, kind in zip(results, kinds, strict=True)}
    rows = dict(ReadyExecution.objects.values_list("job_id", "is_async"))
    assert rows == made
    assert dict(Job.objects.values_list("pk", "is_async")) == made
    taken_async = claim_jobs(DB, worker.pk, ALL, 100, lane=Lane.ASYNC)
    taken_sync = claim_jobs(DB, worker.pk, ALL, 100, lane=Lane.SYNC)
    assert ids(taken_async) == [job_id for job_id, kind in made.items() if kind]
    assert ids(taken_sync) == [job_id for job_id, kind in made.items() if not kind]


@pytest.mark.django_db
def test_a_job_due_later_is_ready_in_its_lane_when_the_dispatcher_promotes_it(worker, is_async):
    result = ECHO[is_async].using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1)
    job_id = pk(result)
    assert Job.objects.get(pk=job_id).status == JobStatus.SCHEDULED
    assert not ReadyExecution.objects.exists()
    make_due(job_id)
    assert promote_due_jobs(DB, 100) == 1
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
@pytest.mark.parametrize("backoff", [0, 30], ids=["at once", "after its backoff"])
def test_a_failed_attempt_is_retried_in_its_lane(worker, is_async, backoff):
    """A retry due at once is admitted in the failure's transaction; one due later goes
    through its scheduled row and the dispatcher."""
    task = ECHO[is_async].using(max_attempts=3, backoff=backoff)
    job_id = pk(task.enqueue(1))
    claim_only(worker, job_id)
    outcome = fail_job(DB, job_id, worker.pk, BOOM, worker_id=worker.name)
    assert outcome is not None and outcome.will_retry
    if backoff:
        make_due(job_id)
        assert promote_due_jobs(DB, 100) == 1
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
@pytest.mark.parametrize("seconds", [0, 60], ids=["due at once", "due later"])
def test_a_snoozed_job_comes_back_in_its_lane(worker, is_async, seconds):
    job_id = pk(ECHO[is_async].enqueue(1))
    claim_only(worker, job_id)
    assert snooze_job(DB, job_id, worker.pk, seconds) is not None
    if seconds:
        make_due(job_id)
        assert promote_due_jobs(DB, 100) == 1
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
def test_a_keyed_job_with_a_free_slot_is_ready_in_its_lane(worker, is_async):
    """Admitted at enqueue under its key's semaphore (``admission.admit_to_key``)."""
    job_id = pk(ECHO[is_async].using(concurrency_key="lanes", concurrency_limit=1).enqueue(1))
    assert_ready_in_its_lane(worker, job_id, is_async)


PROMOTIONS = ["one statement", "statements"]


@pytest.mark.django_db
@pytest.mark.parametrize("promotion", PROMOTIONS)
def test_a_blocked_job_is_promoted_in_its_own_lane_not_its_holders(
    worker, is_async, promotion, monkeypatch
):
    """The holder is of the other kind: the promoted job's kind is read from its own job
    row, by PostgreSQL's one-statement recount and promotion (``db/postgresql/
    admission.py``, which joins the job) and by the statements' path every database has
    (``promote_blocked_by_key``, from ``blocked_in_order``, which joins it too)."""
    if promotion == "one statement" and not features(DB).can_promote_in_one_statement:
        pytest.skip("PostgreSQL's one-statement promotion")
    if promotion == "statements":
        monkeypatch.setattr(features(DB), "can_promote_in_one_statement", False)
    keyed = {"concurrency_key": "k", "concurrency_group": "lanes", "concurrency_limit": 1}
    holder = pk(ECHO[not is_async].using(**keyed).enqueue(0))
    claim_only(worker, holder)
    blocked = pk(ECHO[is_async].using(**keyed).enqueue(1))
    assert BlockedExecution.objects.filter(job_id=blocked).exists()
    assert finish_job(DB, holder, worker.pk, None)
    assert_ready_in_its_lane(worker, blocked, is_async)


@pytest.mark.django_db
def test_a_blocked_job_run_now_by_an_operator_is_ready_in_its_lane(worker, is_async):
    keyed = {"concurrency_key": "k", "concurrency_group": "lanes", "concurrency_limit": 1}
    ECHO[not is_async].using(**keyed).enqueue(0)
    blocked = pk(ECHO[is_async].using(**keyed).enqueue(1))
    assert run_blocked_now(DB, blocked)
    assert_ready_in_its_lane(worker, blocked, is_async)


@pytest.mark.django_db
@pytest.mark.parametrize("keyed", [False, True], ids=["no key", "keyed"])
@pytest.mark.parametrize("started", [False, True], ids=["claimed", "started at claim"])
def test_a_handed_back_claim_is_ready_in_its_lane(worker, is_async, keyed, started):
    """``release_job``: a worker hands back a job it did not run (its start undone if the
    claim counted one), straight to a ready row or through its key."""
    task = ECHO[is_async]
    if keyed:
        task = task.using(concurrency_key="lanes", concurrency_limit=1)
    job_id = pk(task.enqueue(1))
    claim_only(worker, job_id, worker_id="w" if started else None)
    assert release_job(DB, job_id, worker.pk)
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
def test_a_dead_workers_unstarted_claim_is_ready_in_its_lane(worker, is_async):
    """Recovery hands back a claim its dead process never started."""
    job_id = pk(ECHO[is_async].enqueue(1))
    claim_only(worker, job_id, worker_id=None)
    assert recover_process_claims(DB, worker.pk, "died") == {job_id: "released"}
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
def test_an_operators_retry_is_ready_in_its_lane(worker, is_async):
    job_id = pk(ECHO[is_async].using(max_attempts=1).enqueue(1))
    claim_only(worker, job_id)
    fail_job(DB, job_id, worker.pk, BOOM, worker_id=worker.name)
    assert Job.objects.get(pk=job_id).status == JobStatus.FAILED
    assert retry_failed_job(DB, job_id)
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
def test_a_workflows_first_node_is_ready_in_its_lane_at_enqueue(worker, is_async):
    with workflow() as wf:
        first = wf.add(ECHO[is_async], 1)
        wf.add(ECHO[not is_async], 2, after=[first])
    assert_ready_in_its_lane(worker, pk(first.result), is_async)


@pytest.mark.django_db
@pytest.mark.parametrize("parent_fails", [False, True], ids=["succeeded", "failed, run anyway"])
def test_a_dependent_is_ready_in_its_own_lane_when_its_parent_ends(worker, is_async, parent_fails):
    """The parent is of the other kind. A success settles the edges in one statement where
    the database can (``settle_succeeded``); a failure with ``on_dependency_failure="run"``
    takes ``settle_level``. Both read the dependents with ``RELEASE_FIELDS``."""
    with workflow() as wf:
        parent = wf.add(ECHO[not is_async], 1)
        child = wf.add(ECHO[is_async].using(on_dependency_failure="run"), 2, after=[parent])
    assert Job.objects.get(pk=pk(child.result)).status == JobStatus.AWAITING
    claim_only(worker, pk(parent.result))
    if parent_fails:
        fail_job(DB, pk(parent.result), worker.pk, BOOM, worker_id=worker.name, retry=False)
    else:
        assert finish_job(DB, pk(parent.result), worker.pk, 1)
    assert_ready_in_its_lane(worker, pk(child.result), is_async)


@pytest.mark.django_db
def test_a_job_enqueued_after_a_finished_one_is_ready_in_its_lane_at_once(worker, is_async):
    parent = ECHO[not is_async].enqueue(1)
    claim_only(worker, pk(parent))
    assert finish_job(DB, pk(parent), worker.pk, 1)
    job_id = pk(ECHO[is_async].using(after=[parent]).enqueue(2))
    assert_ready_in_its_lane(worker, job_id, is_async)


@pytest.mark.django_db
def test_a_batch_callback_is_ready_in_its_own_lane(worker, is_async):
    """The items are of the other kind; the callback's own task decides its kind
    (``core/batches.py``, ``enqueue_callback``)."""
    made = enqueue_batch([(ECHO[not is_async], [0], {})], on_finish=CALLBACK[is_async])
    item = pk(made.results[0])
    claim_only(worker, item)
    assert finish_job(DB, item, worker.pk, 0)
    callback = Batch.objects.get(pk=made.id).callback_jobs["on_finish"]
    assert_ready_in_its_lane(worker, callback, is_async)


# --- a claim for one lane takes that kind only ------------------------------------------


def plant(queue: str, priority: int, is_async: bool) -> int:
    """A ready job of ``queue`` planted as an enqueue would write it, of kind ``is_async``."""
    job = Job.objects.create(
        task_path=ECHO[is_async].module_path,
        queue_name=queue,
        priority=priority,
        is_async=is_async,
    )
    ReadyExecution.objects.create(
        job_id=job.pk,
        queue_name=queue,
        priority=priority,
        is_async=is_async,
        turn=fifo_turn(job.pk),
    )
    return job.pk


# (queue, priority) of the mix, each planted once of each kind, in an order where the
# kinds interleave in every queue's claim order.
MIX = [
    ("emails", 0),
    ("reports", 5),
    ("emails-bulk", 1),
    ("default", 9),
    ("emails", 3),
    ("emailsx", 0),
    ("email", 7),
    ("emails-bulk", 1),
    ("reports", 0),
    ("emails", 3),
]


def plant_mix() -> dict[int, tuple[str, int, bool]]:
    """Every (queue, priority) of :data:`MIX` as a sync job and as an async one, the two
    kinds alternating by id."""
    planted = {}
    for queue, priority in MIX:
        for is_async in (True, False):
            planted[plant(queue, priority, is_async)] = (queue, priority, is_async)
    return planted


def claim_order(planted, selector: QueueSelector, kind: bool | None) -> list[int]:
    """The jobs a claim of ``selector`` for ``kind`` (None: either) takes, in its order:
    each pattern in turn, by priority then age within it, each job once."""
    order: list[int] = []
    for pattern in selector.patterns:
        matching = [
            job_id
            for job_id, (queue, _, job_kind) in planted.items()
            if QueueSelector((pattern,)).matches(queue)
            and (kind is None or job_kind == kind)
            and job_id not in order
        ]
        order += sorted(matching, key=lambda job_id: (-planted[job_id][1], job_id))
    return order


def claim_in_rounds(worker, selector, lane, size: int = 3, **options) -> list[int]:
    """Claim ``size`` at a time until nothing is left for the claim; all it took, in order."""
    taken: list[int] = []
    while batch := ids(claim_jobs(DB, worker.pk, selector, size, lane=lane, **options)):
        taken += batch
    return taken


SELECTORS = {
    "every queue": ("*",),
    "named queues": ("reports", "emails", "default"),
    "a prefix": ("emails*",),
    "a name, then every queue": ("reports", "*"),
}


@pytest.mark.django_db
@pytest.mark.parametrize("patterns", list(SELECTORS.values()), ids=list(SELECTORS))
@pytest.mark.parametrize("size", [2, 50], ids=["in rounds", "at once"])
def test_a_lane_claim_takes_its_kind_only_in_claim_order(worker, patterns, size):
    """Each lane in turn takes exactly its kind of the queues it serves, in the order a
    claim of both kinds would have taken them, and leaves every job of the other kind."""
    planted = plant_mix()
    selector = QueueSelector(patterns)
    for lane in (Lane.ASYNC, Lane.SYNC):
        assert claim_in_rounds(worker, selector, lane, size) == claim_order(
            planted, selector, lane.is_async
        )
    served = set(claim_order(planted, selector, None))
    assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == set(planted) - served
    claims = dict(ClaimedExecution.objects.values_list("job_id", "process_id"))
    assert set(claims) == served


@pytest.mark.django_db
@pytest.mark.parametrize("patterns", list(SELECTORS.values()), ids=list(SELECTORS))
def test_a_claim_of_either_lane_takes_both_kinds_in_claim_order(worker, patterns):
    """``lane=None``, the usual claim (MariaDB: the claim procedure, for ``*`` and named
    queues): both kinds, by priority then age, and each job knowing its kind."""
    planted = plant_mix()
    selector = QueueSelector(patterns)
    jobs = []
    while batch := claim_jobs(DB, worker.pk, selector, 3, worker_id="w"):
        jobs += batch
    assert ids(jobs) == claim_order(planted, selector, None)
    assert all(job.is_async == planted[job.pk][2] for job in jobs)
    assert {job.status for job in jobs} == {JobStatus.RUNNING}


@pytest.mark.django_db
def test_a_lane_claim_started_at_claim_counts_the_attempt(worker):
    """``worker_id`` given: the lane's claim starts the jobs too, on every path."""
    planted = plant_mix()
    for lane in (Lane.ASYNC, Lane.SYNC):
        selector = QueueSelector(("emails*",))
        jobs = claim_jobs(DB, worker.pk, selector, 100, worker_id="w", lane=lane)
        assert jobs and {(job.status, job.attempts) for job in jobs} == {(JobStatus.RUNNING, 1)}
        assert {planted[job.pk][2] for job in jobs} == {lane.is_async}
    stored = Job.objects.filter(pk__in=ClaimedExecution.objects.values("job_id"))
    assert set(stored.values_list("status", "attempts")) == {(JobStatus.RUNNING, 1)}


@pytest.mark.django_db
@pytest.mark.parametrize("patterns", [("*",), ("emails", "reports"), ("emails*", "reports")])
def test_a_lane_claim_skips_paused_queues(worker, patterns):
    paused = plant("emails", 9, True)
    served = plant("reports", 0, True)
    Pause.objects.create(queue_name="emails")
    selector = QueueSelector(patterns)
    assert ids(claim_jobs(DB, worker.pk, selector, 10, lane=Lane.ASYNC)) == [served]
    assert ReadyExecution.objects.filter(job_id=paused).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("patterns", [("*",), ("emails", "reports"), ("emails*", "reports")])
def test_a_queue_cap_counts_the_claims_of_both_lanes(worker, patterns):
    """``max_concurrency`` is the queue's, whatever the kind: a lane's claim sees the other
    lane's running jobs under the cap row's lock, and takes only the room left."""
    selector = QueueSelector(patterns)
    caps = {"emails": 3}
    running_sync = [plant("emails", 9, False)]
    assert (
        ids(claim_jobs(DB, worker.pk, selector, 1, caps, worker_id="w", lane=Lane.SYNC))
        == running_sync
    )
    async_emails = [plant("emails", 0, True) for _ in range(4)]
    sync_emails = [plant("emails", 0, False) for _ in range(4)]
    async_reports = [plant("reports", 0, True) for _ in range(2)]
    taken = ids(claim_jobs(DB, worker.pk, selector, 10, caps, worker_id="w", lane=Lane.ASYNC))
    assert set(taken) == {*async_emails[:2], *async_reports}
    # The cap is full: neither lane, nor a claim of both, takes another "emails" job.
    assert claim_jobs(DB, worker.pk, selector, 10, caps, worker_id="w", lane=Lane.SYNC) == []
    assert claim_jobs(DB, worker.pk, selector, 10, caps, worker_id="w") == []
    assert finish_job(DB, running_sync[0], worker.pk, None)
    assert (
        ids(claim_jobs(DB, worker.pk, selector, 10, caps, worker_id="w", lane=Lane.SYNC))
        == sync_emails[:1]
    )
    assert ClaimedExecution.objects.filter(queue_name="emails").count() == 3


def plant_many(queue: str, count: int, is_async: bool, priority: int = 0) -> None:
    """``count`` ready jobs of ``queue`` and kind ``is_async``, in a few statements."""
    jobs = Job.objects.bulk_create(
        [
            Job(
                task_path=ECHO[is_async].module_path,
                queue_name=queue,
                priority=priority,
                is_async=is_async,
            )
            for _ in range(count)
        ],
        batch_size=2000,
    )
    ReadyExecution.objects.bulk_create(
        [
            ReadyExecution(
                job_id=job.pk,
                queue_name=queue,
                priority=priority,
                is_async=is_async,
                turn=fifo_turn(job.pk),
            )
            for job in jobs
        ],
        batch_size=2000,
    )


@pytest.mark.skipif("connection.vendor != 'mysql'", reason="InnoDB's locking reads")
@pytest.mark.django_db(transaction=True)  # ANALYZE TABLE commits on MySQL
@pytest.mark.parametrize("lane", [Lane.ASYNC, Lane.SYNC])
def test_a_prefix_lane_claim_locks_only_what_it_takes(worker, lane):
    """A prefix claim on InnoDB picks its candidates by plain reads and locks them alone
    (``core/ready.py``, ``prefix_queues``): a ``LIKE`` read walks the claim-order index
    through other queues' backlogs, or sorts every matching row, locking each. A lane's
    claim must keep that path, the candidates of its kind: its condition is the pattern's
    and the lane's, and a check that the pattern was the condition's one part sent it to
    the ``LIKE`` read (1,001 rows locked here)."""
    plant_many("default", 3000, lane.is_async)
    for queue in ("reports", "reports-daily"):
        plant_many(queue, 500, not lane.is_async)
        plant_many(queue, 500, lane.is_async)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE django_jobs_readyexecution")
    wanted = list(
        ReadyExecution.objects.filter(queue_name__startswith="reports", is_async=lane.is_async)
        .order_by("job_id")
        .values_list("job_id", flat=True)[:2]
    )
    with transaction.atomic():
        claimed = claim_jobs(DB, worker.pk, QueueSelector(("reports*",)), 2, lane=lane)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT trx_rows_locked FROM information_schema.INNODB_TRX "
                "WHERE trx_mysql_thread_id = CONNECTION_ID()"
            )
            (locked,) = cursor.fetchone()
    assert ids(claimed) == wanted
    # The two ready rows, their claimed rows and jobs: none of the 3,000 rows of
    # "default", nor the 1,000 matching ones of the lane (which a sort would lock).
    assert locked < 50, locked


# --- the two lanes' claims at once --------------------------------------------------------

needs_row_locks = pytest.mark.skipif(
    "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
)


def lock_wait_timeout(seconds: int) -> None:
    """MariaDB: a claim that waited for another's rows fails instead of hanging the test
    (PostgreSQL's is a statement timeout of the same length)."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SET SESSION innodb_lock_wait_timeout = %s", [seconds])
        else:
            cursor.execute("SET lock_timeout = %s", [f"{seconds}s"])


def lock_every_ready_row() -> None:
    """The unprotected lane claim's first step: a locking read of the ready rows without
    the lane's condition, the kind left to be sorted out after the rows are locked."""
    list(
        ReadyExecution.objects.select_for_update(skip_locked=True)
        .order_by("-priority", "job_id")
        .values_list("job_id", flat=True)
    )


def race_the_lanes(worker, first: Lane, *, unprotected: bool = False):
    """The claim of lane ``first`` holds what it took (its transaction still open) while
    the other lane's claim runs to its end; then the first commits. Kinds interleave in the
    claim order, so each claim's read passes the other kind's rows. Returns the ids each
    took, the first's then the other's, and the jobs of each kind."""
    planted = plant_mix()
    kinds = {kind: {i for i, (_, _, k) in planted.items() if k == kind} for kind in KINDS}
    second = Lane.SYNC if first is Lane.ASYNC else Lane.ASYNC
    other = register_process(DB, "worker")
    holding, second_done = threading.Event(), threading.Event()

    def first_claim() -> list[int]:
        lock_wait_timeout(5)
        with transaction.atomic():
            if unprotected:
                lock_every_ready_row()
            jobs = claim_jobs(DB, worker.pk, ALL, 100, worker_id="first", lane=first)
            holding.set()
            assert second_done.wait(20), "the second claim never ended"
        return ids(jobs)

    def second_claim() -> list[int]:
        lock_wait_timeout(5)
        assert holding.wait(20), "the first claim never held its rows"
        try:
            return ids(claim_jobs(DB, other.pk, ALL, 100, worker_id="second", lane=second))
        finally:
            second_done.set()

    runners = [Runner(first_claim), Runner(second_claim)]
    for runner in runners:
        runner.start()
    wait_for(runners[1].blocked_or_done, "the second claim to end or wait")
    assert runners[1].done.is_set(), "the second claim waited for the first one's rows"
    taken_first, taken_second = (runner.finish() for runner in runners)
    return taken_first, taken_second, kinds, (worker, other)


@needs_row_locks
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", [Lane.ASYNC, Lane.SYNC])
def test_an_async_claim_and_a_sync_claim_at_once_split_the_jobs_by_kind(worker, first):
    """A worker's loop and another's threads claim at the same moment: while one lane's
    claim holds its rows, the other's takes every job of its own kind, none of the held
    ones, and waits for nothing. Together they take every job, each once, each by its lane.

    The protection is that each claim's locking read carries its lane: it locks only rows
    of its kind, so the other lane finds all of its own free (``SKIP LOCKED`` skips only
    what is held). The ``..._unprotected`` twin locks before sorting out the kind."""
    taken_first, taken_second, kinds, (first_worker, second_worker) = race_the_lanes(worker, first)
    assert set(taken_first) == kinds[first.is_async]
    assert set(taken_second) == kinds[not first.is_async]
    assert not ReadyExecution.objects.exists()
    claims = dict(ClaimedExecution.objects.values_list("job_id", "process_id"))
    assert claims == {
        **dict.fromkeys(taken_first, first_worker.pk),
        **dict.fromkeys(taken_second, second_worker.pk),
    }
    rows = Job.objects.values_list("attempts", "status")
    assert set(rows) == {(1, JobStatus.RUNNING)}


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_an_async_claim_and_a_sync_claim_unprotected_the_other_lane_misses_its_jobs(worker):
    """A lane claim whose lock does not carry the lane (the kind filtered after the rows
    are locked) holds the other kind's rows too: the other lane's claim, at that moment,
    skips them and takes nothing, though every job of its kind was free to run."""
    taken_first, taken_second, kinds, _ = race_the_lanes(worker, Lane.ASYNC, unprotected=True)
    assert set(taken_first) == kinds[True]
    assert taken_second == []
    assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == kinds[False]


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_two_lanes_claiming_in_rounds_at_once_take_each_job_once(worker):
    """Rounds started together by a barrier, an async and a sync claimer on their own
    connections, until neither lane has a job left: every job claimed once, by its lane."""
    kinds = [n % 3 != 0 for n in range(60)]
    results = bulk_enqueue(
        [(ECHO[kind].using(priority=n % 4), (n,), {}) for n, kind in enumerate(kinds)]
    )
    made = {pk(result): kind for result, kind in zip(results, kinds, strict=True)}
    claimers = {Lane.ASYNC: worker, Lane.SYNC: register_process(DB, "worker")}
    barrier = threading.Barrier(2, timeout=20)

    def claimer(lane: Lane) -> list[int]:
        lock_wait_timeout(5)
        process = claimers[lane]
        taken: list[int] = []
        while True:
            barrier.wait()
            taken += ids(claim_jobs(DB, process.pk, ALL, 4, worker_id=lane.value, lane=lane))
            barrier.wait()  # both rounds ended: the same view of what is left, for both
            if not ReadyExecution.objects.exists():
                return taken

    runners = {lane: Runner(lambda lane=lane: claimer(lane)) for lane in claimers}
    for runner in runners.values():
        runner.start()
    taken = {lane: runner.finish() for lane, runner in runners.items()}
    assert sorted(taken[Lane.ASYNC]) == [job_id for job_id, kind in made.items() if kind]
    assert sorted(taken[Lane.SYNC]) == [job_id for job_id, kind in made.items() if not kind]
    claims = dict(ClaimedExecution.objects.values_list("job_id", "process_id"))
    assert claims == {
        job_id: claimers[lane].pk for lane, job_ids in taken.items() for job_id in job_ids
    }
    assert set(Job.objects.values_list("attempts", "status")) == {(1, JobStatus.RUNNING)}


# --- migration 0022 ---------------------------------------------------------------------

BEFORE_LANES = "0021_page_indexes"


def columns_of(model) -> set[str]:
    with connection.cursor() as cursor:
        return {
            column.name
            for column in connection.introspection.get_table_description(
                cursor, model._meta.db_table
            )
        }


def ready_indexes() -> set[str]:
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, ReadyExecution._meta.db_table))


def enqueue_procedure_columns() -> set[str]:
    """The job columns MariaDB's enqueue procedure takes now (its parameters but the first)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT parameter_name FROM information_schema.parameters "
            "WHERE specific_schema = DATABASE() AND specific_name = %s "
            "ORDER BY ordinal_position",
            [ENQUEUE_PROCEDURE],
        )
        first, *rest = [row[0] for row in cursor.fetchall()]
    assert first == "own_transaction"
    return {name.removeprefix("p_") for name in rest}


def enqueue_by_the_procedure(old_job) -> int:
    """One job of the historical model ``old_job`` enqueued by a ``CALL`` of the procedure
    as it stands, each of its parameters given that job's column; the new job's id."""
    by_column = {field.column: field for field in old_job._meta.concrete_fields}
    job = old_job(task_path=ECHO[False].module_path, queue_name="default", args=[1])
    names = sorted(enqueue_procedure_columns(), key=list(by_column).index)
    params = [
        by_column[name].get_db_prep_save(getattr(job, by_column[name].attname), connection)
        for name in names
    ]
    marks = ", ".join(["%s"] * (len(params) + 1))
    with connection.cursor() as cursor:
        cursor.execute(f"CALL {ENQUEUE_PROCEDURE}({marks})", [True, *params])
        (job_id,) = cursor.fetchone()
    return int(job_id)


@pytest.mark.django_db(transaction=True)
def test_migration_0022_goes_back_and_forth_and_the_jobs_before_it_are_sync(worker):
    """Back to 0021 the columns and the lane's index are gone, and MariaDB's enqueue
    procedure takes the job table's columns of then (it still enqueues: its ready INSERT
    names no column the table lacks). Jobs written then, by the ORM and by the procedure,
    read as sync once 0022 is applied again: a sync claim takes them, an async one none."""
    from django.core.management import call_command
    from django.db.migrations.loader import MigrationLoader

    from django_jobs.db.mysql import _procedure_fields

    job_columns, ready_columns = columns_of(Job), columns_of(ReadyExecution)
    assert "is_async" in job_columns and "is_async" in ready_columns
    assert "jobs_ready_async" in ready_indexes()
    planted: list[int] = []
    try:
        call_command("migrate", "django_jobs", BEFORE_LANES, verbosity=0)
        # 0024's columns (fair queues) are gone too.
        assert columns_of(Job) == job_columns - {"is_async", "fair_key", "fair_weight"}
        assert columns_of(ReadyExecution) == ready_columns - {"is_async", "turn"}
        assert "jobs_ready_async" not in ready_indexes()
        old = MigrationLoader(connection).project_state(("django_jobs", BEFORE_LANES)).apps
        old_job, old_ready = (
            old.get_model("django_jobs", name) for name in ("Job", "ReadyExecution")
        )
        for queue in ("default", "emails"):
            job = old_job.objects.create(task_path=ECHO[False].module_path, queue_name=queue)
            old_ready.objects.create(job_id=job.pk, queue_name=queue)
            planted.append(job.pk)
        if connection.vendor == "mysql":
            assert enqueue_procedure_columns() == columns_of(Job) - {"id"}
            planted.append(enqueue_by_the_procedure(old_job))
            assert old_ready.objects.filter(job_id=planted[-1]).exists()
    finally:
        call_command("migrate", "django_jobs", verbosity=0)
        _procedure_fields.clear()
    assert (columns_of(Job), columns_of(ReadyExecution)) == (job_columns, ready_columns)
    assert "jobs_ready_async" in ready_indexes()
    if connection.vendor == "mysql":
        assert enqueue_procedure_columns() == job_columns - {"id"}
    assert set(Job.objects.values_list("pk", "is_async")) == {(pk, False) for pk in planted}
    assert set(ReadyExecution.objects.values_list("job_id", "is_async")) == {
        (pk, False) for pk in planted
    }
    assert claim_jobs(DB, worker.pk, ALL, 10, lane=Lane.ASYNC) == []
    assert sorted(ids(claim_jobs(DB, worker.pk, ALL, 10, lane=Lane.SYNC))) == sorted(planted)
    # And the enqueue after it is whole again (MariaDB: one CALL, writing the kind).
    test_a_single_enqueue_writes_the_kind_on_both_rows(worker, True)


# --- a lane's claim behind a backlog of the other kind ------------------------------------

BACKLOG, ASYNC_JOBS = 20_000, 200


def analyze() -> None:
    """Fresh planner statistics for the planted backlog."""
    tables = [Job._meta.db_table, ReadyExecution._meta.db_table]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"ANALYZE {', '.join(tables)}")
        elif connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {', '.join(tables)}")
        else:
            cursor.execute("ANALYZE")


class ExplainingCursor:
    """A claim's cursor that has the server EXPLAIN each statement, with its parameters,
    before running it: the plan of the claim as sent, planned as it is (never prepared)."""

    def __init__(self, cursor, plans: list) -> None:
        self.cursor, self.plans = cursor, plans

    def __enter__(self):
        self.cursor.__enter__()
        return self

    def __exit__(self, *exc):
        return self.cursor.__exit__(*exc)

    def execute(self, sql, params=None):
        self.cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        self.plans.append(self.cursor.fetchone()[0])
        return self.cursor.execute(sql, params)

    def __getattr__(self, name):
        return getattr(self.cursor, name)


def picked_reads(plan) -> list[tuple[str, str | None]]:
    """(node type, index name) of each read of the ready table in the claim's ``picked``
    part (its locking read; the DELETE after it finds its rows by primary key)."""
    nodes, found, inside = [(plan[0]["Plan"], False)], [], False
    while nodes:
        node, inside = nodes.pop()
        inside = inside or node.get("Subplan Name") == "CTE picked"
        if inside and node.get("Relation Name") == ReadyExecution._meta.db_table:
            found.append((node["Node Type"], node.get("Index Name")))
        nodes += [(child, inside) for child in node.get("Plans", [])]
    return found


def explained_claim(worker, monkeypatch, lane: Lane | None) -> list[tuple[str, str | None]]:
    """How PostgreSQL reads the ready table for a claim of ``lane`` (run for real)."""
    from django_jobs.db.postgresql import claims

    plans: list = []
    unprepared = claims.unprepared_cursor
    monkeypatch.setattr(
        claims, "unprepared_cursor", lambda conn: ExplainingCursor(unprepared(conn), plans)
    )
    assert len(claim_jobs(DB, worker.pk, ALL, 5, worker_id="w", lane=lane)) == 5
    monkeypatch.setattr(claims, "unprepared_cursor", unprepared)
    (plan,) = plans
    return picked_reads(plan)


def claim_times(worker, lane: Lane | None, rounds: int = 15) -> str:
    """Median and fastest of ``rounds`` claims of 5 of ``lane``, started at claim: the
    fastest is the least disturbed by whatever else the machine runs."""
    import statistics
    import time

    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        jobs = claim_jobs(DB, worker.pk, ALL, 5, worker_id="w", lane=lane)
        times.append((time.perf_counter() - started) * 1000)
        assert len(jobs) == 5
        assert lane is None or {job.is_async for job in jobs} == {lane.is_async}
    return f"{statistics.median(times):.2f} ms (fastest {min(times):.2f})"


def lane_claim_plan(worker, lane: Lane) -> str:
    """How MariaDB or SQLite reads the ready table for a claim of ``lane``: its locking
    read, captured as it ran, explained (MariaDB: the key and access type of each table)."""
    with CaptureQueriesContext(connection) as captured:
        assert claim_jobs(DB, worker.pk, ALL, 5, worker_id="w", lane=lane)
    (pick,) = [
        query["sql"]
        for query in captured.captured_queries
        if ReadyExecution._meta.db_table in query["sql"]
        and query["sql"].lstrip().upper().startswith("SELECT")
        and "ORDER BY" in query["sql"]
    ]
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"EXPLAIN {pick}")
            names = [column[0] for column in cursor.description]
            return " ".join(
                f"{row['table']}:{row['key']}:{row['type']}"
                for row in (dict(zip(names, values, strict=True)) for values in cursor.fetchall())
            )
        cursor.execute(f"EXPLAIN QUERY PLAN {pick}")
        return " ".join(str(row[-1]) for row in cursor.fetchall())


@pytest.mark.skipif("connection.vendor == 'postgresql'", reason="EXPLAIN (FORMAT JSON) below")
@pytest.mark.django_db(transaction=True)  # ANALYZE TABLE commits on MySQL
@pytest.mark.parametrize("ahead", KINDS, ids=["sync ahead", "async ahead"])
def test_a_lane_claim_behind_the_other_kinds_backlog_reads_the_lane_index(worker, ahead):
    """MariaDB has no partial index: there ``jobs_ready_async`` is led by ``is_async``
    (``django_jobs.db.indexes.FlagIndex``), so either lane reads its own rows by it (a
    ``ref`` on the flag) rather than the claim-order index filtered through the other
    kind's backlog (42 ms a claim behind 20,000 rows, against 6). SQLite reads the async
    rows by the partial index, the sync ones by the claim order."""
    plant_many("default", 2000, ahead)
    plant_many("default", 20, not ahead)
    analyze()
    plan = lane_claim_plan(worker, lane_of(not ahead))
    if connection.vendor == "mysql":
        assert f"{ReadyExecution._meta.db_table}:jobs_ready_async:ref" in plan, plan
    else:
        # The sync lane has no index of its own there: it reads the claim order.
        assert ("jobs_ready_order" if ahead else "jobs_ready_async") in plan, plan


@pytest.mark.django_db(transaction=True)  # ANALYZE TABLE commits on MySQL
def test_an_async_claim_behind_a_sync_backlog_reads_its_own_index(worker, monkeypatch, figure):
    """20,000 sync ready jobs ahead of 200 async ones in claim order, as behind a worker
    whose threads are all busy. PostgreSQL reads the async rows through their partial index
    (``jobs_ready_async``), not the claim-order index filtered row by row through the
    backlog; without that index the same claim reads the claim order (so the check would
    see it gone). The claim times of both lanes are reported, not asserted."""
    plant_many("default", BACKLOG, False)
    plant_many("default", ASYNC_JOBS, True)
    analyze()
    postgresql = connection.vendor == "postgresql"
    if postgresql:
        assert explained_claim(worker, monkeypatch, Lane.ASYNC) == [
            ("Index Scan", "jobs_ready_async")
        ]
        # The usual claim reads the order index, as before.
        assert explained_claim(worker, monkeypatch, None) == [("Index Scan", "jobs_ready_order")]
    either, lane_async = claim_times(worker, None), claim_times(worker, Lane.ASYNC)
    without = ""
    if postgresql:
        index = next(i for i in ReadyExecution._meta.indexes if i.name == "jobs_ready_async")
        with connection.schema_editor() as editor:
            editor.remove_index(ReadyExecution, index)
        try:
            assert explained_claim(worker, monkeypatch, Lane.ASYNC) == [
                ("Index Scan", "jobs_ready_order")
            ]
            without = f", lane=ASYNC without jobs_ready_async {claim_times(worker, Lane.ASYNC)}"
        finally:
            with connection.schema_editor() as editor:
                editor.add_index(ReadyExecution, index)
    figure(
        f"lanes {connection.vendor}: a claim of 5 behind {BACKLOG:,} sync ready jobs, median "
        f"of 15: lane=ASYNC {lane_async}, lane=None {either}{without}"
    )


@pytest.mark.django_db
def test_the_lane_index_holds_the_async_rows_or_leads_with_the_flag():
    """``jobs_ready_async`` as built: partial where the database can, else led by the flag
    (never a copy of ``jobs_ready_order``, which Django builds from a declared condition on
    MySQL/MariaDB)."""
    from tests.test_partial_indexes import index_sql

    sql = index_sql("jobs_ready_async")
    if connection.features.supports_partial_indexes:
        assert re.search(r"priority DESC, turn, job_id WHERE is_async( = 1)?$", sql), sql
    else:
        assert sql == "is_async,priority,turn,job_id", sql
