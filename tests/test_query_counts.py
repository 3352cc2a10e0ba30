"""Round trips on the hot paths: a fixed number per call, whatever the number of jobs.

Each path is counted twice, for a few jobs and for many; the two counts must be
equal (no query per job: an N+1 fails here), and the count must stay within the
budget written below, so a change that adds a round trip to every job shows up
as a failing test, not as a slower benchmark weeks later. The budgets count
BEGIN and COMMIT, which Django records too.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs import bulk_enqueue, workflow
from django_jobs.core.claimed import fail_job, finish_job, finish_jobs
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.models import Job, JobStatus, ScheduledExecution
from tests import tasks
from tests import transition_tasks as tt
from tests import workflow_tasks as wt

pytestmark = pytest.mark.django_db(transaction=True)

ALL = QueueSelector(("*",))
DB = "default"
FEW, MANY = 2, 40


def budget(postgresql: int, other: int) -> int:
    return postgresql if connection.vendor == "postgresql" else other


def mysql() -> bool:
    return connection.vendor == "mysql"


def count(action) -> int:
    with CaptureQueriesContext(connection) as captured:
        action()
    return len(captured.captured_queries)


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def plain_calls(n: int):
    return [(tasks.add, (i, 1), {}) for i in range(n)]


def claimed_and_started(worker, n: int) -> list[Job]:
    bulk_enqueue(plain_calls(n))
    jobs = claim_jobs(DB, worker.pk, ALL, n)
    assert len(start_jobs(DB, jobs, worker.pk, worker.name)) == n
    return jobs


def test_enqueue_one_job():
    # PostgreSQL: the job and its ready row in one statement (no BEGIN/COMMIT); MySQL: one
    # CALL of migration 0013's procedure (after the procedure's parameters, read once).
    tasks.add.enqueue(0, 0)
    assert count(lambda: tasks.add.enqueue(1, 2)) <= budget(1, 1 if mysql() else 4)


def test_enqueue_one_job_in_the_callers_transaction():
    # Inside the caller's atomic(): the writes alone, no SAVEPOINT/RELEASE around them.
    tasks.add.enqueue(0, 0)
    with transaction.atomic():
        assert count(lambda: tasks.add.enqueue(1, 2)) <= budget(1, 1 if mysql() else 2)
    assert Job.objects.filter(status=JobStatus.READY).count() == 2


def test_bulk_enqueue_does_not_grow_with_the_jobs():
    few, many = (
        count(lambda: bulk_enqueue(plain_calls(FEW))),
        count(lambda: bulk_enqueue(plain_calls(MANY))),
    )
    assert few == many <= budget(1, 4)
    assert Job.objects.filter(status=JobStatus.READY).count() == FEW + MANY


def test_bulk_enqueue_with_concurrency_keys_costs_per_key_not_per_job():
    def keyed(n: int, keys: int):
        return lambda: bulk_enqueue([(tt.two_at_a_time, (f"k{i % keys}",), {}) for i in range(n)])

    keyed(4, 2)()  # both keys exist and are full from here on: every later job blocks
    one_key_few, one_key_many = count(keyed(FEW, 1)), count(keyed(MANY, 1))
    assert one_key_few == one_key_many <= 7
    two_keys = count(keyed(MANY, 2))
    per_key = two_keys - one_key_many
    assert 0 < per_key <= 4


def test_claim_does_not_grow_with_the_jobs(worker):
    claim_jobs(DB, worker.pk, ALL, 1)  # MySQL: the procedure is looked up once per process
    bulk_enqueue(plain_calls(FEW + MANY))
    for worker_id in (None, "w"):
        few = count(lambda w=worker_id: claim_jobs(DB, worker.pk, ALL, FEW, worker_id=w))
        many = count(lambda w=worker_id: claim_jobs(DB, worker.pk, ALL, MANY, worker_id=w))
        # PostgreSQL: one data-modifying statement (no BEGIN/COMMIT), db/postgresql/claims.py;
        # MySQL: one CALL of migration 0014's procedure, which starts them too; SQLite's
        # statements, the process row's lock first (migration 0023's note says why).
        assert few == many <= budget(1, 1 if mysql() else 8)
        bulk_enqueue(plain_calls(FEW + MANY))


def test_start_does_not_grow_with_the_jobs(worker):
    bulk_enqueue(plain_calls(FEW + MANY))
    few_jobs = claim_jobs(DB, worker.pk, ALL, FEW)
    many_jobs = claim_jobs(DB, worker.pk, ALL, MANY)
    few = count(lambda: start_jobs(DB, few_jobs, worker.pk, worker.name))
    many = count(lambda: start_jobs(DB, many_jobs, worker.pk, worker.name))
    assert few == many <= budget(1, 5)


def test_batched_finish_does_not_grow_with_the_jobs(worker):
    few_jobs = claimed_and_started(worker, FEW)
    many_jobs = claimed_and_started(worker, MANY)

    def finish(jobs, value=lambda job: None):
        # As the completer calls it: these jobs have neither a key nor a batch.
        values = {job.pk: value(job) for job in jobs}
        return lambda: finish_jobs(DB, worker.pk, values, jobs)

    finish_jobs(DB, worker.pk, {0: None}, [Job(pk=0)])  # MySQL: the procedure looked up once
    few = count(finish(few_jobs))
    many = count(finish(many_jobs))
    # PostgreSQL: claims locked and deleted, jobs and return values updated, one statement;
    # MySQL: the same, one CALL of migration 0015's procedure.
    assert few == many <= budget(1, 1 if mysql() else 5)
    # Return values are written by the same UPDATE: no statement more, on any database.
    valued = claimed_and_started(worker, MANY)
    assert count(finish(valued, lambda job: job.pk)) == many
    assert sorted(
        Job.objects.filter(pk__in=[job.pk for job in valued]).values_list("return_value", flat=True)
    ) == sorted(job.pk for job in valued)
    assert Job.objects.filter(status=JobStatus.SUCCEEDED).count() == FEW + 2 * MANY


def test_failing_a_job_costs_a_fixed_number_of_queries(worker):
    error = ErrorInfo("builtins.ValueError", "boom", "boom")
    jobs = claimed_and_started(worker, 2)
    first, second = (count(lambda job=job: fail_job(DB, job.pk, worker.pk, error)) for job in jobs)
    assert first == second <= 7


def test_promoting_due_jobs_does_not_grow_with_the_jobs():
    def schedule(n: int) -> None:
        now = timezone.now()
        jobs = Job.objects.bulk_create(
            [
                Job(task_path="tests.tasks.add", args=[1, 2], status=JobStatus.SCHEDULED)
                for _ in range(n)
            ]
        )
        ScheduledExecution.objects.bulk_create(
            [ScheduledExecution(job=job, queue_name="default", scheduled_at=now) for job in jobs]
        )

    schedule(FEW)
    few = count(lambda: promote_due_jobs(DB, 100))
    schedule(MANY)
    many = count(lambda: promote_due_jobs(DB, 100))
    assert few == many <= 7
    assert Job.objects.filter(status=JobStatus.READY).count() == FEW + MANY


def test_batched_finish_of_keyed_jobs_costs_the_same_for_one_key_or_many(worker):
    """All keys at once: their semaphores locked, holders recounted, next blocked jobs
    picked and written in bulk. On MariaDB too: its semaphores' point lookups are one
    statement (``db/mysql.py``, ``lock_in_key_order``)."""

    keys: dict[int, str] = {}

    def running_with_followers(names: list[str]) -> dict[int, None]:
        # Two running (the limit) and two blocked behind them, per key.
        bulk_enqueue([(tt.two_at_a_time, (name, n), {}) for name in names for n in range(4)])
        jobs = claim_jobs(DB, worker.pk, ALL, 100)
        assert len(start_jobs(DB, jobs, worker.pk, worker.name)) == 2 * len(names)
        keys.update({job.pk: job.concurrency_key for job in jobs})
        return {job.pk: None for job in jobs}

    def finish(values: dict[int, None], hinted: bool):
        # As the completer calls it: these jobs have a key and no batch.
        known = [Job(pk=pk, concurrency_key=keys[pk]) for pk in values] if hinted else []
        return lambda: finish_jobs(DB, worker.pk, values, known)

    counts = {}
    for hinted in (False, True):
        first = running_with_followers([f"a{hinted}"])
        one_key = count(finish(first, hinted))
        claim_jobs(DB, worker.pk, ALL, 100)  # the promoted ones, out of the way
        second = running_with_followers([f"b{hinted}", f"c{hinted}"])
        two_keys = count(finish(second, hinted))
        claim_jobs(DB, worker.pk, ALL, 100)
        assert two_keys == one_key
        counts[hinted] = one_key
    # PostgreSQL: the recount and the promotion are one statement (db/postgresql/admission.py).
    # With the hint (each job's key), the finish, the semaphores' lock and the recount are
    # three statements sent as one message, their own transaction (finish_keyed in
    # db/postgresql/claims.py).
    assert counts[False] <= budget(7, 12)
    assert counts[True] <= budget(1, 12)
    assert Job.objects.filter(status=JobStatus.SUCCEEDED).count() == 12
    assert Job.objects.filter(status=JobStatus.READY).count() == 0
    assert Job.objects.filter(status=JobStatus.CLAIMED).count() == 12


@pytest.mark.parametrize("parent_fails", [False, True], ids=["succeeded", "failed"])
def test_releasing_a_workflows_dependents_does_not_grow_with_them(worker, parent_fails):
    """A parent's end makes its waiting dependents ready in a fixed number of statements:
    they are read once (``core/dependencies.py``, ``RELEASE_FIELDS``), with every column
    their ready rows copy, whether the parent succeeded (``settle_succeeded``) or failed
    with dependents that run anyway (``settle_level``). ``is_async`` left out of that read
    (migration 0022) cost one more SELECT per dependent, on every database: 38 more for 40."""
    error = ErrorInfo("builtins.ValueError", "boom", "boom")
    child_task = wt.cleanup if parent_fails else wt.step

    def end_parent_of(n: int):
        with workflow() as wf:
            parent = wf.add(wt.step, "parent")
            children = [wf.add(child_task, str(i), after=[parent]) for i in range(n)]
        (job,) = claim_jobs(DB, worker.pk, ALL, 1, worker_id="w")
        assert job.pk == int(parent.result.id)
        if parent_fails:
            ended = count(lambda: fail_job(DB, job.pk, worker.pk, error, retry=False))
        else:
            ended = count(lambda: finish_job(DB, job.pk, worker.pk, "parent"))
        ids = [int(child.result.id) for child in children]
        assert Job.objects.filter(pk__in=ids, status=JobStatus.READY).count() == n
        claim_jobs(DB, worker.pk, ALL, n)  # out of the way of the next parent's claim
        return ended

    few, many = end_parent_of(FEW), end_parent_of(MANY)
    assert few == many


# The usual claim (no lane: a worker with room of both kinds) as it cost before migration
# 0022 and the lanes, measured at that commit (2fc4dfd) on each database, with and without
# a worker id: (patterns, queue caps) -> statements on PostgreSQL, MySQL/MariaDB, SQLite.
# A prefix on MariaDB reads its queue names first (core/ready.py, prefix_queues); cleared
# before each count. The lanes changed none of these. Since migration 0023 the statements'
# path (every claim on SQLite, a capped one everywhere, a pattern's on MySQL/MariaDB) takes
# one more, the lock of its own process row (Operations.lock_own_process); the one
# statement and the procedure take it inside: PROCESS_ROW below.
USUAL_CLAIM = {
    (("*",), False): (1, 1, 7),
    (("*",), True): (11, 11, 11),
    (("default", "emails"), False): (3, 1, 7),
    (("default", "emails"), True): (11, 11, 11),
    (("emails*",), False): (1, 9, 7),
    (("emails*",), True): (11, 13, 11),
    (("default", "*"), False): (3, 7, 7),
    (("default", "*"), True): (11, 11, 11),
}
# (PostgreSQL, MySQL/MariaDB, SQLite): 1 where the entry above is the statements' path.
PROCESS_ROW = {
    (("*",), False): (0, 0, 1),
    (("*",), True): (1, 1, 1),
    (("default", "emails"), False): (0, 0, 1),
    (("default", "emails"), True): (1, 1, 1),
    (("emails*",), False): (0, 1, 1),
    (("emails*",), True): (1, 1, 1),
    (("default", "*"), False): (0, 1, 1),
    (("default", "*"), True): (1, 1, 1),
}
CAPS = {"default": 1000, "emails": 1000}


def claim_counts(worker, patterns, capped: bool, lane=None) -> list[int]:
    """The statements of claims of ``patterns`` for FEW and for MANY jobs, each with and
    without a worker id, over ready jobs of both kinds in two queues."""
    from django_jobs.core.ready import PREFIX_NAMES
    from tests.lane_tasks import ECHO

    selector, caps = QueueSelector(patterns), CAPS if capped else None

    def claim(n: int, worker_id: str | None):
        return lambda: claim_jobs(DB, worker.pk, selector, n, caps, worker_id=worker_id, lane=lane)

    counts = []
    for worker_id in (None, "w"):
        for n in (FEW, MANY):
            bulk_enqueue(
                [
                    (task.using(queue_name=queue), (i,), {})
                    for task in ECHO.values()
                    for queue in ("default", "emails")
                    for i in range(n)
                ]
            )
            PREFIX_NAMES.clear()
            counts.append(count(claim(n, worker_id)))
            claim_jobs(DB, worker.pk, ALL, 1000)  # the rest, out of the way
    return counts


SHAPES = [
    pytest.param(patterns, capped, id=f"{'|'.join(patterns)}-{'capped' if capped else 'plain'}")
    for patterns, capped in USUAL_CLAIM
]


def usual_claim(patterns, capped: bool) -> int:
    vendors = ("postgresql", "mysql", "sqlite")
    before = dict(zip(vendors, USUAL_CLAIM[(patterns, capped)], strict=True))
    locked = dict(zip(vendors, PROCESS_ROW[(patterns, capped)], strict=True))
    return before[connection.vendor] + locked[connection.vendor]


@pytest.mark.parametrize(("patterns", "capped"), SHAPES)
def test_the_usual_claim_costs_what_it_did_before_the_lanes(worker, patterns, capped):
    claim_jobs(DB, worker.pk, ALL, 1)  # MySQL: the procedure is looked up once per process
    assert claim_counts(worker, patterns, capped) == [usual_claim(patterns, capped)] * 4


@pytest.mark.parametrize(("patterns", "capped"), SHAPES)
@pytest.mark.parametrize("lane", ["async", "sync"])
def test_a_lane_claim_does_not_grow_with_the_jobs(worker, patterns, capped, lane):
    """One lane's claim costs what the usual claim of the same queues costs, or less; on
    MySQL/MariaDB it takes the statements' path where the usual claim is one CALL of the
    claim procedure (which serves no lane): 8 statements instead of 1 (7 before migration
    0023's lock of the process row)."""
    from django_jobs.core.lanes import Lane

    claim_jobs(DB, worker.pk, ALL, 1)
    counts = claim_counts(worker, patterns, capped, Lane(lane))
    assert len(set(counts)) == 1, counts
    usual = usual_claim(patterns, capped)
    assert counts[0] <= (max(usual, 8) if mysql() else usual)
