"""MySQL/MariaDB: a worker's claim is one ``CALL`` of migration 0014's procedure, which leaves
the same rows as the statements' path (jobs, claims, ready rows), all or nothing, in autocommit
and inside the caller's transaction; two claimers never take the same job, and neither waits
for the rows the other holds; without the procedure the statements' path takes over. The
completer's finish of plain jobs is one ``CALL`` of migration 0015's, held to the same."""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from importlib import import_module

import pytest
from django.apps import apps
from django.db import DatabaseError, connection, connections, transaction
from django.db.migrations.state import ProjectState
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs import bulk_enqueue
from django_jobs import task as jobs_task
from django_jobs.core import claimed, ready
from django_jobs.core.claimed import finish_jobs
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.db import ops
from django_jobs.db.mysql import (
    CLAIM_PARAMETERS,
    CLAIM_PROCEDURE,
    FINISH_PROCEDURE,
    _procedures,
)
from django_jobs.models import ClaimedExecution, Job, JobStatus, Pause, ReadyExecution
from tests import tasks
from tests.mysql_columns import column_changed, column_definition
from tests.rate_tasks import once_a_minute
from tests.test_races import Runner, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the procedure is MySQL's"),
]

DB = "default"
ALL = QueueSelector(("*",))
NOW = timezone.now().replace(microsecond=123456)

keyed = jobs_task(
    tasks.add.func, concurrency_key="k:{a}", concurrency_limit=5, concurrency_duration=2.5
)
unique_until_start = jobs_task(tasks.add.func, unique_key="u:{a}", unique_until="start")


def migration():
    """The claim procedure as the latest migration that creates it does (0014's, with 0023's
    lock of the process row and 0024's order by turn): a test that drops or rebuilds it puts
    back that one."""
    return import_module("django_jobs.migrations.0024_fair_turns")


@pytest.fixture
def worker():
    return register_process(DB, "worker")


@pytest.fixture
def frozen_now(monkeypatch):
    """One ``now`` for both paths' claims, so their rows can be compared whole."""
    monkeypatch.setattr(ready.timezone, "now", lambda: NOW)


@pytest.fixture
def statements(monkeypatch):
    """The statements' path: the procedure's claim declines, as where it is missing."""

    def take_statements() -> None:
        monkeypatch.setattr(ops(DB), "claim_ready", lambda *args, **kwargs: None)

    return take_statements


def enqueue_the_mix() -> None:
    """Plain jobs of three priorities and two queues, keyed jobs with a lease, rate-limited
    and unique-until-start jobs (claimed, not started), a job retried once (a worker id
    and a first start already), and jobs of a paused queue."""
    Pause.objects.create(queue_name="slow")
    bulk_enqueue(
        [(tasks.add.using(priority=priority), (priority, 1), {}) for priority in (0, 5, -3, 5)]
        + [(tasks.add.using(queue_name="emails", priority=2), (i, 2), {}) for i in range(3)]
        + [(keyed, (i, 3), {}) for i in range(2)]
        + [(once_a_minute, (4,), {})]
        + [(unique_until_start, (5, 5), {})]
        + [(tasks.add.using(queue_name="slow", priority=9), (6, 6), {})]
    )
    retried = Job.objects.filter(args=[0, 1]).get()
    Job.objects.filter(pk=retried.pk).update(
        attempts=1, worker_ids=["earlier"], started_at=NOW - timedelta(hours=1)
    )


def snapshot() -> dict:
    """Every row a claim touches, by job id."""
    return {
        "jobs": {row["id"]: row for row in Job.objects.values()},
        "ready": {row["job_id"]: row for row in ReadyExecution.objects.values()},
        "claimed": {row["job_id"]: row for row in ClaimedExecution.objects.values()},
    }


def restore(rows: dict) -> None:
    """Put back the rows of a :func:`snapshot` taken before a claim."""
    ClaimedExecution.objects.all().delete()
    ReadyExecution.objects.all().delete()
    ReadyExecution.objects.bulk_create([ReadyExecution(**row) for row in rows["ready"].values()])
    ClaimedExecution.objects.bulk_create(
        [ClaimedExecution(**row) for row in rows["claimed"].values()]
    )
    for pk, row in rows["jobs"].items():
        Job.objects.filter(pk=pk).update(**{k: v for k, v in row.items() if k != "id"})
    assert snapshot() == rows


def as_rows(jobs: list[Job]) -> list[dict]:
    """The claimed jobs as the claim returned them (every field), in its order."""
    return [
        {field.attname: getattr(job, field.attname) for field in Job._meta.concrete_fields}
        for job in jobs
    ]


def claim_both_ways(worker, statements, claim) -> None:
    """Run ``claim`` by the procedure, then, from the same rows, by the statements; each
    must return the same jobs and leave the same rows."""
    before = snapshot()
    with CaptureQueriesContext(connection) as captured:
        by_procedure = claim()
    assert [q["sql"].split("(")[0] for q in captured.captured_queries] == [
        f"CALL {CLAIM_PROCEDURE}"
    ]
    after_procedure = snapshot()
    restore(before)
    statements()
    by_statements = claim()
    assert by_statements, "nothing claimed: the comparison would prove nothing"
    assert as_rows(by_procedure) == as_rows(by_statements)
    assert after_procedure == snapshot()
    # What the claim returned is what it wrote.
    assert as_rows(by_procedure) == as_rows([Job.objects.get(pk=job.pk) for job in by_procedure])


def test_the_procedure_takes_the_parameters_the_code_sends():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT parameter_name FROM information_schema.parameters "
            "WHERE specific_schema = DATABASE() AND specific_name = %s ORDER BY ordinal_position",
            [CLAIM_PROCEDURE],
        )
        assert tuple(row[0] for row in cursor.fetchall()) == CLAIM_PARAMETERS


def test_a_workers_claim_of_the_mix_writes_what_the_statements_write(
    worker, frozen_now, statements
):
    enqueue_the_mix()
    claim_jobs(DB, worker.pk, QueueSelector(("none",)), 1)  # the procedure looked up once
    claimed: list[Job] = []

    def claim() -> list[Job]:
        claimed[:] = claim_jobs(DB, worker.pk, ALL, 8, worker_id="w-1")
        return claimed

    claim_both_ways(worker, statements, claim)
    # What the comparison covered: priority then age; started at claim, or only claimed.
    jobs = {job.pk: job for job in Job.objects.filter(pk__in=[job.pk for job in claimed])}
    assert [job.priority for job in claimed] == [5, 5, 2, 2, 2, 0, 0, 0]
    assert {job.status for job in claimed} == {JobStatus.RUNNING}
    retried = Job.objects.get(args=[0, 1])
    assert retried.pk in jobs
    assert (retried.attempts, retried.worker_ids, retried.started_at) == (
        2,
        ["earlier", "w-1"],
        NOW - timedelta(hours=1),
    )
    assert not ClaimedExecution.objects.filter(queue_name="slow").exists()


def test_the_rest_of_the_mix_by_named_queues(worker, frozen_now, statements):
    enqueue_the_mix()
    claim_jobs(DB, worker.pk, ALL, 7, worker_id="w-0")  # the first seven out of the way
    claim_both_ways(
        worker,
        statements,
        lambda: claim_jobs(
            DB, worker.pk, QueueSelector(("slow", "emails", "default")), 20, worker_id="w-1"
        ),
    )
    claims = {c.job_id: c for c in ClaimedExecution.objects.all()}
    jobs = Job.objects.filter(pk__in=claims)
    kinds = {
        (bool(job.concurrency_key), bool(job.rate_key), job.unique_until, job.status)
        for job in jobs
    }
    # The keyed ones started, with a lease; the rate-limited and unique-until-start ones only
    # claimed (their start decides apart); the paused queue's job left waiting.
    assert (True, False, None, JobStatus.RUNNING) in kinds
    assert (False, True, None, JobStatus.CLAIMED) in kinds
    assert (False, False, "start", JobStatus.CLAIMED) in kinds
    leases = [c.lease_expires_at for c in claims.values() if c.concurrency_key]
    assert leases == [NOW + timedelta(seconds=2.5)] * 2
    assert list(ReadyExecution.objects.values_list("queue_name", flat=True)) == ["slow"]


def test_a_claim_without_a_worker_id_starts_nothing(worker, frozen_now, statements):
    enqueue_the_mix()
    claim_jobs(DB, worker.pk, QueueSelector(("none",)), 1)
    claim_both_ways(worker, statements, lambda: claim_jobs(DB, worker.pk, ALL, 20))
    assert set(Job.objects.values_list("status", flat=True)) == {
        JobStatus.CLAIMED,
        JobStatus.READY,
    }


def test_a_claim_of_nothing_is_one_call(worker):
    claim_jobs(DB, worker.pk, ALL, 1)
    with CaptureQueriesContext(connection) as captured:
        assert claim_jobs(DB, worker.pk, ALL, 4, worker_id="w") == []
    assert len(captured.captured_queries) == 1


def test_prefix_patterns_and_caps_take_the_statements_path(worker):
    tasks.add.enqueue(1, 2)
    for selector, caps in [(QueueSelector(("def*",)), None), (ALL, {"unused": 1})]:
        with CaptureQueriesContext(connection) as captured:
            claim_jobs(DB, worker.pk, selector, 1, caps)
        assert not any("CALL" in q["sql"] for q in captured.captured_queries)


@pytest.fixture
def claimed_queue_names_of_three():
    """The claimed table's queue_name cut to 3 characters: the claims' INSERT fails for a
    longer one, after the jobs' UPDATE succeeded."""
    with column_changed(ClaimedExecution, "queue_name", "VARCHAR(3) NOT NULL"):
        yield


@pytest.mark.parametrize("in_atomic", [False, True])
def test_a_failure_part_way_leaves_nothing_behind(claimed_queue_names_of_three, worker, in_atomic):
    bulk_enqueue([(tasks.add, (i, 1), {}) for i in range(3)])
    before = snapshot()
    if in_atomic:
        with transaction.atomic():
            with pytest.raises(DatabaseError):
                ops(DB).claim_ready(DB, worker.pk, None, 3, "w", timezone.now())
            assert snapshot() == before  # the savepoint, not the caller's block, undone
            kept = tasks.add.enqueue(7, 7)
        assert Job.objects.filter(pk=int(kept.id)).exists()
        ReadyExecution.objects.filter(job_id=int(kept.id)).delete()
        Job.objects.filter(pk=int(kept.id)).delete()
    else:
        with pytest.raises(DatabaseError):
            ops(DB).claim_ready(DB, worker.pk, None, 3, "w", timezone.now())
    assert snapshot() == before
    # No lock left behind either: another connection locks every row at once.
    other = Runner(locked_at_once)
    other.start()
    assert other.finish() == (3, 3)


def locked_at_once() -> tuple[int, int]:
    """Lock every ready row and job, refusing to wait: (ready rows, jobs)."""
    with transaction.atomic():
        return (
            len(ReadyExecution.objects.select_for_update(nowait=True)),
            len(Job.objects.select_for_update(nowait=True)),
        )


def test_without_the_procedure_the_statements_take_over(worker):
    bulk_enqueue([(tasks.add, (i, 1), {}) for i in range(3)])
    assert len(claim_jobs(DB, worker.pk, ALL, 1, worker_id="w")) == 1  # found, and cached
    schema_state = ProjectState.from_apps(apps)
    with connection.schema_editor() as editor:
        migration().drop_procedure(schema_state.apps, editor)
    try:
        # The cache still names the procedure: the CALL fails, the statements claim.
        (first,) = claim_jobs(DB, worker.pk, ALL, 1, worker_id="w")
        with CaptureQueriesContext(connection) as captured:
            (second,) = claim_jobs(DB, worker.pk, ALL, 1, worker_id="w")
        assert not any("CALL" in q["sql"] for q in captured.captured_queries)
        # Read again, and found missing.
        assert [found for (_, name), found in _procedures.items() if name == CLAIM_PROCEDURE] == [
            False
        ]
        assert {first.status, second.status} == {JobStatus.RUNNING}
        assert ClaimedExecution.objects.count() == 3 and not ReadyExecution.objects.exists()
    finally:
        with connection.schema_editor() as editor:
            migration().create_procedure(schema_state.apps, editor)
        _procedures.clear()
    tasks.add.enqueue(1, 2)
    with CaptureQueriesContext(connection) as captured:
        assert len(claim_jobs(DB, worker.pk, ALL, 1, worker_id="w")) == 1
    assert any("CALL" in q["sql"] for q in captured.captured_queries)


@pytest.fixture
def queue_names_in_another_collation():
    """The queue columns the claim compares in a collation that is not their character
    set's default (a database created with ``COLLATE utf8mb4_unicode_ci``), and the
    procedure created over them, as migrate would have created it; after the test, the
    columns as they were (binary since migration 0018) and the procedure over them."""

    def create_procedure() -> None:
        with connection.schema_editor() as editor:
            migration().create_procedure(ProjectState.from_apps(apps).apps, editor)

    with ExitStack() as columns:
        columns.callback(create_procedure)
        for model in (ReadyExecution, Pause):
            kind, _, _, collation = column_definition(model, "queue_name")
            other = "utf8mb4_unicode_ci" if collation != "utf8mb4_unicode_ci" else "utf8mb4_bin"
            columns.enter_context(
                column_changed(model, "queue_name", f"{kind} COLLATE {other} NOT NULL")
            )
        create_procedure()
        yield


def test_a_claim_of_named_queues_in_any_collation(queue_names_in_another_collation, worker):
    bulk_enqueue([(tasks.add.using(queue_name=name), (1, 1), {}) for name in ("emails", "slow")])
    Pause.objects.create(queue_name="slow")
    with CaptureQueriesContext(connection) as captured:
        jobs = claim_jobs(DB, worker.pk, QueueSelector(("slow", "emails")), 2, worker_id="w")
    assert any("CALL" in q["sql"] for q in captured.captured_queries)
    assert [job.queue_name for job in jobs] == ["emails"]


def lock_wait_timeout(seconds: int) -> None:
    """This thread's connection gives up waiting for a row lock after ``seconds``: a claim
    that waited for another's rows fails the test instead of hanging it."""
    with connections[DB].cursor() as cursor:
        cursor.execute("SET SESSION innodb_lock_wait_timeout = %s", [seconds])


def test_a_claim_skips_the_rows_another_claim_holds_and_waits_for_none(worker):
    """The first claim holds its rows (its caller's transaction is still open) while the
    second runs: the second takes the other jobs, without waiting for a lock. At the tail
    of a queue, a ready table of a few rows: the first claim's ready and job rows are in
    the second's way (ids in between), so a statement of the second that reached them by
    a scan instead of by primary key would wait for them; and a pick that read the table
    through another index and sorted it would have locked every ready row, leaving the
    second nothing (the statements' pick does, there)."""
    bulk_enqueue([(tasks.add.using(priority=i % 2), (i, 1), {}) for i in range(6)])
    other = register_process(DB, "worker")
    first_holds, second_done = threading.Event(), threading.Event()

    def first() -> list[int]:
        with transaction.atomic():
            jobs = claim_jobs(DB, worker.pk, ALL, 3, worker_id="first")
            first_holds.set()
            assert second_done.wait(20), "the second claim never ended"
        return [job.pk for job in jobs]

    def second() -> list[int]:
        lock_wait_timeout(5)
        assert first_holds.wait(20), "the first claim never held its rows"
        try:
            return [job.pk for job in claim_jobs(DB, other.pk, ALL, 6, worker_id="second")]
        finally:
            second_done.set()

    runners = [Runner(first), Runner(second)]
    for runner in runners:
        runner.start()
    wait_for(lambda: runners[1].blocked_or_done(), "the second claim to end or wait")
    assert runners[1].done.is_set(), "the second claim waited for the first one's rows"
    taken_first, taken_second = (runner.finish() for runner in runners)
    assert len(taken_first) == 3 and len(taken_second) == 3
    assert not set(taken_first) & set(taken_second)
    claims = dict(ClaimedExecution.objects.values_list("job_id", "process_id"))
    assert claims == {
        **{pk: worker.pk for pk in taken_first},
        **{pk: other.pk for pk in taken_second},
    }
    assert set(Job.objects.values_list("attempts", "status")) == {(1, JobStatus.RUNNING)}


def test_two_claimers_claiming_at_once_never_take_the_same_job(worker):
    """Rounds started together by a barrier, each claimer on its own connection, until
    the queue is empty: every job claimed once, by one of them, started once."""
    total = 60
    bulk_enqueue([(tasks.add.using(priority=i % 3), (i, 1), {}) for i in range(total)])
    claimers = [worker, register_process(DB, "worker")]
    barrier = threading.Barrier(2, timeout=20)

    def claimer(process) -> list[int]:
        lock_wait_timeout(5)
        taken: list[int] = []
        while True:
            barrier.wait()
            jobs = claim_jobs(DB, process.pk, ALL, 4, worker_id=str(process.pk))
            taken += [job.pk for job in jobs]
            barrier.wait()  # both rounds ended: the queue is empty for both or for neither
            if not ReadyExecution.objects.exists():
                return taken

    runners = [Runner(lambda process=process: claimer(process)) for process in claimers]
    for runner in runners:
        runner.start()
    taken = [runner.finish() for runner in runners]
    assert sorted(taken[0] + taken[1]) == sorted(Job.objects.values_list("pk", flat=True))
    assert len(taken[0]) + len(taken[1]) == total
    claims = dict(ClaimedExecution.objects.values_list("job_id", "process_id"))
    for process, pks in zip(claimers, taken, strict=True):
        assert all(claims[pk] == process.pk for pk in pks)
    rows = Job.objects.values_list("attempts", "worker_ids", "status")
    assert all(
        (attempts, status) == (1, JobStatus.RUNNING) and len(ids) == 1
        for attempts, ids, status in rows
    )


# --- the finish: migration 0015's procedure ------------------------------------------------

unique_until_finish = jobs_task(tasks.add.func, unique_key="f:{a}", unique_until="finish")
one_at_a_time = jobs_task(tasks.add.func, concurrency_key="one:{a}", concurrency_limit=1)
# Return values of every JSON kind, and None (NULL, whatever the row held before).
VALUES = [None, {"a": [1, "é", None], "b": 'q"\\'}, "text", 3.5, [True, False], 0, None, "ü"]


def finish_migration():
    return import_module("django_jobs.migrations.0015_mysql_finish_procedure")


@pytest.fixture
def frozen_finish(monkeypatch):
    """One ``now`` for both paths' finishes."""
    monkeypatch.setattr(claimed.timezone, "now", lambda: NOW)


@pytest.fixture
def finish_statements(monkeypatch):
    """The statements' path: the procedure's finish declines, as where it is missing."""

    def take_statements() -> None:
        monkeypatch.setattr(ops(DB), "finish_plain", lambda *args, **kwargs: None)

    return take_statements


def running(worker, calls) -> list[Job]:
    """The jobs of ``calls``, claimed and started by ``worker``, as the completer knows them."""
    bulk_enqueue(calls)
    jobs = claim_jobs(DB, worker.pk, ALL, 100, worker_id="w")
    assert {job.status for job in jobs} == {JobStatus.RUNNING}
    return jobs


def warm_finish(worker) -> None:
    """The procedure looked up once (a finish of a job this worker does not hold)."""
    assert ops(DB).finish_plain(DB, worker.pk, {0: None}, NOW) == set()


def test_a_finish_batch_writes_what_the_statements_write(worker, frozen_finish, finish_statements):
    jobs = running(
        worker,
        [(tasks.add, (i, 1), {}) for i in range(5)]
        + [(unique_until_finish, (i, 9), {}) for i in range(3)],
    )
    Job.objects.filter(pk=jobs[0].pk).update(return_value={"earlier": "run"})
    values = {job.pk: value for job, value in zip(jobs, VALUES, strict=True)}
    warm_finish(worker)
    before = snapshot()
    with CaptureQueriesContext(connection) as captured:
        by_procedure = finish_jobs(DB, worker.pk, values, jobs)
    assert [q["sql"].split("(")[0] for q in captured.captured_queries] == [
        f"CALL {FINISH_PROCEDURE}"
    ]
    after_procedure = snapshot()
    restore(before)
    finish_statements()
    by_statements = finish_jobs(DB, worker.pk, values, jobs)
    assert by_procedure == by_statements == set(values)
    assert after_procedure == snapshot()
    assert dict(Job.objects.values_list("pk", "return_value")) == values
    assert not ClaimedExecution.objects.exists()
    assert set(Job.objects.values_list("status", "unique_lock", "finished_at")) == {
        (JobStatus.SUCCEEDED, None, NOW)
    }


def test_a_batch_of_nones_clears_what_an_earlier_run_left(worker, frozen_finish, finish_statements):
    """No job of the batch returned anything: both paths write NULL over a value a row held
    (the statements' UPDATE has no CASE then, and once left the old value)."""
    jobs = running(worker, [(tasks.add, (i, 1), {}) for i in range(2)])
    Job.objects.filter(pk=jobs[0].pk).update(return_value={"earlier": "run"})
    values = dict.fromkeys((job.pk for job in jobs), None)
    warm_finish(worker)
    before = snapshot()
    assert finish_jobs(DB, worker.pk, values, jobs) == set(values)
    after_procedure = snapshot()
    restore(before)
    finish_statements()
    assert finish_jobs(DB, worker.pk, values, jobs) == set(values)
    assert after_procedure == snapshot()
    assert set(Job.objects.values_list("return_value", flat=True)) == {None}


def test_keyed_batched_and_gone_claims_are_left_to_the_general_path(worker):
    """A batch of plain jobs, keyed ones (their finish frees the slot and admits the next
    one) and one whose claim is gone: the procedure finishes the plain ones, the general
    path the keyed ones, nobody the gone one."""
    jobs = running(
        worker,
        [(tasks.add, (i, 1), {}) for i in range(2)]
        + [(one_at_a_time, (i, 2), {}) for i in range(2)],
    )
    followers = [int(one_at_a_time.enqueue(i, 3).id) for i in range(2)]
    assert set(Job.objects.filter(pk__in=followers).values_list("status", flat=True)) == {
        JobStatus.BLOCKED
    }
    gone = running(worker, [(tasks.add, (9, 9), {})])[0]
    ClaimedExecution.objects.filter(job_id=gone.pk).delete()
    # A wrong copy: the procedure reads the key under the claim's lock, not from the copy.
    hints = [*jobs, gone]
    jobs[2].concurrency_key = None
    warm_finish(worker)
    done = finish_jobs(DB, worker.pk, {job.pk: job.pk for job in hints}, hints)
    assert done == {job.pk for job in jobs}
    assert set(Job.objects.filter(pk__in=followers).values_list("status", flat=True)) == {
        JobStatus.READY
    }
    assert Job.objects.get(pk=gone.pk).status == JobStatus.RUNNING
    assert not ClaimedExecution.objects.exists()


def test_a_finish_failing_part_way_leaves_nothing_behind(worker):
    """The jobs' UPDATE refused (a return value the JSON column's check refuses), after the
    claims' DELETE: the claims are back, the jobs still running, in autocommit and inside
    the caller's transaction."""
    jobs = running(worker, [(tasks.add, (i, 1), {}) for i in range(3)])
    outcomes = json.dumps([[job.pk, "{not json"] for job in sorted(jobs, key=lambda j: j.pk)])
    before = snapshot()
    for own_transaction in (True, False):
        with transaction.atomic() if not own_transaction else nullcontext():
            with pytest.raises(DatabaseError), connection.cursor() as cursor:
                cursor.execute(
                    f"CALL {FINISH_PROCEDURE}(%s, %s, %s, %s)",
                    [own_transaction, worker.pk, outcomes, "2026-01-01 00:00:00"],
                )
            assert snapshot() == before
    other = Runner(locked_claims_at_once)
    other.start()
    assert other.finish() == 3


def locked_claims_at_once() -> int:
    with transaction.atomic():
        return len(ClaimedExecution.objects.select_for_update(nowait=True))


def test_without_the_finish_procedure_the_statements_take_over(worker):
    jobs = running(worker, [(tasks.add, (i, 1), {}) for i in range(3)])
    warm_finish(worker)
    schema_state = ProjectState.from_apps(apps)
    with connection.schema_editor() as editor:
        finish_migration().drop_procedure(schema_state.apps, editor)
    try:
        # The cache still names the procedure: the CALL fails, the statements finish.
        assert finish_jobs(DB, worker.pk, {jobs[0].pk: 1}, jobs) == {jobs[0].pk}
        with CaptureQueriesContext(connection) as captured:
            assert finish_jobs(DB, worker.pk, {jobs[1].pk: 2}, jobs) == {jobs[1].pk}
        assert not any("CALL" in q["sql"] for q in captured.captured_queries)
    finally:
        with connection.schema_editor() as editor:
            finish_migration().create_procedure(schema_state.apps, editor)
        _procedures.clear()
    with CaptureQueriesContext(connection) as captured:
        assert finish_jobs(DB, worker.pk, {jobs[2].pk: 3}, jobs) == {jobs[2].pk}
    assert any("CALL" in q["sql"] for q in captured.captured_queries)
    assert list(Job.objects.order_by("pk").values_list("return_value", flat=True)) == [1, 2, 3]
