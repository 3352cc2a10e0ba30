"""Fair queues (docs/fairness.md): the order in which claims take the ready jobs of a queue
of ``DJANGO_JOBS["fair_queues"]``, on real claims, and the stamps' lock under two real
connections.

The turns are start-time fair queuing (core/fairness.py): these tests give the exact
claim order the rule makes, so a change of the rule shows here as a changed sequence.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.db import OperationalError, connection, connections, transaction
from django.db.models import F
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs import bulk_enqueue
from django_jobs.core import fairness, maintenance
from django_jobs.core.claimed import finish_job
from django_jobs.core.fairness import TURN_SCALE, fifo_turn
from django_jobs.core.maintenance import FAIR_TURN_IDLE, prune_fair_turns
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs, make_ready
from django_jobs.core.starting import start_job
from django_jobs.models import FairTurn, Job, ReadyExecution
from tests.fair_tasks import capped_report, plain_default, tenant_report, unkeyed_report
from tests.test_races import Runner, wait_for

DB = "default"
REPORTS = QueueSelector(("reports",))
FAIR = {**settings.DJANGO_JOBS, "fair_queues": ["reports"]}


@pytest.fixture
def fair():
    with override_settings(DJANGO_JOBS=FAIR):
        yield


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def group(job: Job) -> str:
    return job.fair_key if job.fair_key else "-"


def claim_groups(worker, count: int, selector: QueueSelector = REPORTS) -> list[str]:
    """The groups of the next ``count`` jobs, claimed one claim at a time."""
    taken = []
    for _ in range(count):
        (job,) = claim_jobs(DB, worker.pk, selector, 1)
        taken.append(group(job))
    return taken


def enqueue_many(tenant: str, count: int, **options: Any) -> list[int]:
    """One bulk enqueue of ``count`` jobs of ``tenant``."""
    task = tenant_report.using(**options) if options else tenant_report
    return [int(r.id) for r in bulk_enqueue([(task, (tenant,), {}) for _ in range(count)])]


def enqueue_one(tenant: str, **options: Any) -> int:
    """One job of ``tenant``, enqueued alone: PostgreSQL's one statement, stamp and all."""
    task = tenant_report.using(**options) if options else tenant_report
    return int(task.enqueue(tenant).id)


# Both ways a job of a fair queue is enqueued: alone (one statement on PostgreSQL, the ORM's
# statements elsewhere) and in a bulk (the ORM's statements everywhere).
WAYS = {
    "alone": lambda tenant: [enqueue_one(tenant)],
    "bulk": lambda tenant: enqueue_many(tenant, 2),
}


def turn_of(job_id: int) -> int:
    return ReadyExecution.objects.get(job_id=job_id).turn


@pytest.mark.django_db
def test_a_tenants_backlog_does_not_hold_up_the_jobs_enqueued_after_it(fair, worker):
    """A's 50 first, then three jobs of no key one by one, then C's three at once: each
    group's first job takes the head's turn (a tie of turns goes to the older job, A's),
    and from there the groups take turns. FIFO would start all 50 of A's first."""
    enqueue_many("A", 50)
    for n in range(3):
        unkeyed_report.enqueue(n)
    enqueue_many("C", 3)
    assert claim_groups(worker, 12) == ["A", "-", "C"] * 3 + ["A"] * 3
    assert claim_groups(worker, 44) == ["A"] * 44


@pytest.mark.django_db
def test_the_groups_of_one_bulk_enqueue_take_turns(fair, worker):
    """Several groups in one call, into an idle queue, start from the call's first job
    alike: interleaved, not one group after the other."""
    bulk_enqueue([(tenant_report, (tenant,), {}) for tenant in ("A", "B", "C") for _ in range(4)])
    assert claim_groups(worker, 12) == ["A", "B", "C"] * 4


@pytest.mark.django_db
def test_a_queue_that_is_not_fair_keeps_priority_then_id_order(fair, worker):
    results = bulk_enqueue(
        [(plain_default.using(priority=n % 3), (n,), {}) for n in range(9)]
        + [(plain_default, (9,), {})]
    )
    ids = [int(r.id) for r in results]
    assert {turn_of(pk) for pk in ids} == {fifo_turn(pk) for pk in ids}
    assert Job.objects.filter(pk__in=ids, fair_key__isnull=False).count() == 0
    order = [job.pk for job in claim_jobs(DB, worker.pk, QueueSelector(("default",)), 10)]
    priority = {pk: n % 3 if n < 9 else 0 for n, pk in enumerate(ids)}
    assert order == sorted(ids, key=lambda pk: (-priority[pk], pk))


@pytest.mark.django_db
def test_a_group_of_weight_two_starts_two_jobs_for_each_of_weight_one(fair, worker):
    enqueue_many("heavy", 40, fair_weight=2)
    enqueue_many("light", 40)
    first = claim_groups(worker, 30)
    # Two turns of heavy's to one of light's: 20 and 10 of the first 30, 4 in every 6.
    assert first[:6] == ["heavy", "light", "heavy", "heavy", "light", "heavy"], first
    assert first.count("heavy") == 20
    for start in range(25):
        assert first[start : start + 6].count("heavy") == 4, first


@pytest.mark.django_db
def test_a_group_that_was_idle_starts_at_the_head_without_credit(fair, worker):
    """B had nothing ready while A's first ten ran: its ten jobs then take turns with A's,
    they do not all go first."""
    enqueue_many("A", 20)
    assert claim_groups(worker, 10) == ["A"] * 10
    enqueue_many("B", 10)
    assert claim_groups(worker, 10) == ["A", "B"] * 5


@pytest.mark.django_db
def test_a_higher_priority_still_goes_first(fair, worker):
    enqueue_many("A", 10)
    urgent = int(tenant_report.using(priority=5).enqueue("B").id)
    (job,) = claim_jobs(DB, worker.pk, REPORTS, 1)
    assert job.pk == urgent


@pytest.mark.django_db
def test_a_group_that_ran_ahead_alone_starts_anew_once_the_queue_was_idle(fair, worker):
    """A's jobs were the only ones, so they ran: with nothing ready, every group starts at
    its first job's place, A's stamp far ahead or not."""
    enqueue_many("A", 5, fair_weight=0.01)  # 5 turns of 100 ids each: far ahead
    assert claim_groups(worker, 5) == ["A"] * 5
    (b,) = enqueue_many("B", 1)
    (a,) = enqueue_many("A", 1)
    assert turn_of(b) == fifo_turn(b)
    assert claim_groups(worker, 2) == ["B", "A"]
    assert a > b


@pytest.mark.django_db
@pytest.mark.parametrize("way", WAYS)
def test_a_group_whose_last_turn_another_group_shares_is_not_taken_for_waiting(fair, worker, way):
    """A, B and C, enqueued together into an idle queue, share their first turn. Once A's
    job is claimed, nothing of A waits, though B's and C's jobs of that turn do: A's next
    job takes the head, a tie it loses to their older jobs, and does not step past it,
    behind their second jobs too. (Hypothesis found this: a group's stamp equal to another
    group's waiting turn was read as its own job still waiting.)"""
    bulk_enqueue([(tenant_report, (t,), {}) for t in ("A", "B", "B", "C", "C")])
    assert claim_groups(worker, 1) == ["A"]
    late = WAYS[way]("A")
    order = ["B", "C", "A", "B", "C"] + ["A"] * (len(late) - 1)
    assert claim_groups(worker, len(order)) == order


@pytest.mark.django_db
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("stamp", [None, -1, -5, 2**62, 2**63 - 1])
def test_a_stamp_edited_by_hand_gives_fifo_turns_and_a_warning(fair, worker, caplog, stamp, way):
    """Alone (one statement on PostgreSQL) or two in a bulk (the ORM's statements): the
    group's jobs take their FIFO turns from there, one warning, and the row is written
    again, so the group's next job is stamped as usual."""
    enqueue = {"alone": lambda: [enqueue_one("A")], "bulk": lambda: enqueue_many("A", 2)}[way]
    enqueue_many("A", 3)
    enqueue_many("B", 3)
    FairTurn.objects.filter(fair_key="A").update(last_turn=stamp)
    with caplog.at_level(logging.WARNING, logger="django_jobs.fairness"):
        late = enqueue()
    assert [turn_of(pk) for pk in late] == [fifo_turn(pk) for pk in late]
    (record,) = caplog.records
    assert "'A'" in record.getMessage() and "FIFO" in record.getMessage()
    assert FairTurn.objects.get(fair_key="A").last_turn == turn_of(late[-1])
    after = enqueue_one("A")
    assert turn_of(after) == turn_of(late[-1]) + TURN_SCALE
    count = 3 + len(late) + 1
    assert sorted(claim_groups(worker, count + 3)) == ["A"] * count + ["B"] * 3
    assert not ReadyExecution.objects.exists()


@pytest.mark.django_db
def test_a_job_let_in_by_its_concurrency_slot_takes_the_queues_head(fair, worker):
    """Blocked behind its key's holder while A's backlog was enqueued, T's second job takes
    the head of the queue when the slot frees, not a place behind A's backlog."""
    holder = int(capped_report.enqueue("T").id)
    waiting = int(capped_report.enqueue("T").id)
    assert not ReadyExecution.objects.filter(job_id=waiting).exists()
    (job,) = claim_jobs(DB, worker.pk, REPORTS, 1)
    assert job.pk == holder
    assert start_job(DB, job, worker.pk, worker.name)
    enqueue_many("A", 20)
    head = min(ReadyExecution.objects.values_list("turn", flat=True))
    finish_job(DB, holder, worker.pk, None)
    assert turn_of(waiting) == head
    # A tie of turns goes to the older job: T's, enqueued before A's backlog.
    (job,) = claim_jobs(DB, worker.pk, REPORTS, 1)
    assert job.pk == waiting


def enqueue_behind_a_last_job_moved_to_the_head(worker) -> tuple[int, int, int]:
    """T's stamp names its job at the turn of its enqueue, and that job then waits at the
    head, four of A's starts later, as a job retried, blocked on its key and let in at the
    head leaves it (admission's promotion writes its ready row at the head, and no stamp).
    T's next job, enqueued alone; its turn, the head, and the stamp's turn before it."""
    enqueue_many("A", 10)
    t = enqueue_one("T")
    stamped = FairTurn.objects.get(fair_key="T").last_turn
    assert stamped == turn_of(t)
    ReadyExecution.objects.filter(job_id=t).delete()  # out of the way, as a claim takes it
    assert claim_groups(worker, 4) == ["A"] * 4
    make_ready(DB, [Job.objects.get(pk=t)], at_head=True)
    head = turn_of(t)
    assert head == stamped + 4 * TURN_SCALE
    return turn_of(enqueue_one("T")), head, stamped


@pytest.mark.django_db(transaction=True)
def test_a_last_job_waiting_at_another_turn_than_its_stamp_gives_no_turn_before_the_head(
    fair, worker
):
    """T's last job still waits, so T's next one takes ``max(head, last + step)``: the head,
    not a step after the stamp's turn, which the head has passed. (MySQL/MariaDB's procedure
    and PostgreSQL's function skip the head only where the last job waits at the stamp's
    very turn.)"""
    turn, head, _ = enqueue_behind_a_last_job_moved_to_the_head(worker)
    assert turn == head


@contextmanager
def routine_edited(
    monkeypatch, module: Any, builder: str, create: Any, edits: Iterable[tuple[str, str]]
) -> Iterator[None]:
    """A stamp routine created again (``module.create``) from ``module.builder``'s SQL with
    each ``(old, new)`` of ``edits`` (``old`` found once) made, an unprotected twin; the
    routine as shipped created again after."""
    from django.apps import apps

    original = getattr(module, builder)

    def edited(*args: Any) -> str:
        sql = original(*args)
        for old, new in edits:
            assert sql.count(old) == 1, (old, sql)
            sql = sql.replace(old, new)
        return sql

    monkeypatch.setattr(module, builder, edited)
    try:
        # Inside the try: creating it drops the shipped one first, which must come back
        # even where the edit or its CREATE fails.
        with connection.schema_editor() as editor:
            getattr(module, create)(apps, editor)
        yield
    finally:
        monkeypatch.setattr(module, builder, original)
        with connection.schema_editor() as editor:
            getattr(module, create)(apps, editor)


def enqueue_procedure_edited(monkeypatch, old: str, new: str) -> Any:
    """MySQL/MariaDB's enqueue procedure with its fair branch's ``old`` made ``new``."""
    from django_jobs.db import enqueue_procedure

    return routine_edited(
        monkeypatch, enqueue_procedure, "fair_procedure_sql", "create_procedure", [(old, new)]
    )


def fair_function_edited(monkeypatch, *edits: tuple[str, str]) -> Any:
    """PostgreSQL's stamp function with each ``(old, new)`` of ``edits`` made."""
    from django_jobs.db.postgresql import fair_function

    return routine_edited(monkeypatch, fair_function, "function_sql", "create_function", edits)


@contextmanager
def stamp_routine_edited(monkeypatch, old: str, new: str) -> Iterator[None]:
    """The database's own stamp routine (MySQL/MariaDB's enqueue procedure, PostgreSQL's
    function) with ``old`` made ``new``."""
    if connection.vendor == "mysql":
        with enqueue_procedure_edited(monkeypatch, old, new):
            yield
    else:
        with fair_function_edited(monkeypatch, (old, new)):
            yield


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="a stamp routine of the database")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", ["the stamp's UPDATE", "the locking path"])
def test_unprotected_a_routine_skipping_the_head_whenever_the_last_job_waits_goes_before_it(
    fair, worker, monkeypatch, where
):
    """The twins: MySQL/MariaDB's procedure or PostgreSQL's function takes ``last + step``
    whenever the group's last job waits, wherever it waits: in the one UPDATE that steps a
    stamp whose job waits at its turn (the turn not compared), or in the path that locks
    the stamp first. The stamp's turn is four steps behind the head, so T's next job goes
    ahead of every job ready."""
    if where == "the locking path":
        edit = ("AND same_level_ AND last_at_ = prior_", "AND last_at_ IS NOT NULL")
    else:
        stamp = "`django_jobs_fairturn`" if connection.vendor == "mysql" else "f"
        edit = (f"(SELECT w.turn = {stamp}.last_turn AND ", "(SELECT ")
    with stamp_routine_edited(monkeypatch, *edit):
        turn, head, stamped = enqueue_behind_a_last_job_moved_to_the_head(worker)
    assert turn == stamped + TURN_SCALE < head


# --- two connections ---------------------------------------------------------------------

needs_row_locks = pytest.mark.skipif(
    "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
)


def lock_error_during_an_enqueue_of(
    tenant: str, last_job_moved: bool = False
) -> OperationalError | None:
    """A's and B's three jobs each ready (with ``last_job_moved``, A's last one a turn
    later than its stamp's, as a hand edit leaves it: it waits, but the routine's one-UPDATE
    path is not taken, and its reads of the last job and the head are); while an enqueue of
    ``tenant`` holds its transaction open (on another connection), every one of those ready
    rows locked at once (``FOR UPDATE NOWAIT``, as a claim locks them, but failing instead
    of passing over): the error, or None if each was free."""
    a = enqueue_many("A", 3)
    enqueue_many("B", 3)
    if last_job_moved:
        ReadyExecution.objects.filter(job_id=a[-1]).update(turn=F("turn") + 1)
    ready = list(ReadyExecution.objects.order_by("job_id").values_list("job_id", flat=True))
    holding, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def enqueue_and_hold() -> None:
        try:
            with transaction.atomic(), CaptureQueriesContext(connection) as queries:
                enqueue_one(tenant)
                calls.extend(q["sql"] for q in queries.captured_queries)
                holding.set()
                assert release.wait(10)
        finally:
            holding.set()
            connections.close_all()

    thread = threading.Thread(target=enqueue_and_hold)
    thread.start()
    assert holding.wait(10)
    error = None
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            marks = ", ".join(["%s"] * len(ready))
            cursor.execute(
                "SELECT job_id FROM django_jobs_readyexecution WHERE job_id IN "
                f"({marks}) ORDER BY job_id FOR UPDATE NOWAIT",
                ready,
            )
            assert [row[0] for row in cursor.fetchall()] == ready
    except OperationalError as exc:
        error = exc
    finally:
        release.set()
        thread.join(10)
    if connection.vendor == "mysql":
        assert any(sql.startswith("CALL ") for sql in calls), calls
    else:
        assert any("django_jobs_fair_turn(" in sql for sql in calls), calls
    return error


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="a stamp routine of the database")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("tenant", "last_job_moved"),
    [("A", False), ("A", True), ("C", False)],
    ids=["A", "A-moved", "C"],
)
def test_the_routines_reads_of_ready_rows_lock_none(fair, tenant, last_job_moved):
    """The reads of ready rows of MySQL/MariaDB's procedure and of PostgreSQL's function
    lock nothing: while a fair enqueue's transaction is open, every ready row committed
    before it can still be locked at once, as a claim locks it. A's enqueue reads its last
    job's row in the stamp's UPDATE (it waits at the stamp's turn); moved a turn on, by
    itself, and then the head; C's, a new group's, reads the head. Were any read a locking
    one, a claim's SKIP LOCKED would pass that job over until the enqueue commits."""
    error = lock_error_during_an_enqueue_of(tenant, last_job_moved)
    assert error is None, f"the open fair enqueue holds a lock on a ready row: {error}"


@pytest.mark.skipif("connection.vendor != 'mysql'", reason="MySQL/MariaDB's enqueue procedure")
@pytest.mark.django_db(transaction=True)
def test_unprotected_a_procedure_reading_the_last_job_by_a_subquery_locks_its_row(
    fair, monkeypatch
):
    """The twin: the last job's ready row read as ``SET ... = (SELECT ...)``, as the
    ``IF EXISTS (SELECT ...)`` before migration 0028 did. MariaDB reads a row it finds by
    primary key in a procedure's subquery with a shared lock, held to the commit."""
    read_into = (
        "SELECT turn, queue_name = p_queue_name AND priority = p_priority INTO last_at_, "
        "same_level_ FROM `django_jobs_readyexecution` WHERE job_id = prior_job_;"
    )
    by_subquery = (
        "SET last_at_ = (SELECT turn FROM `django_jobs_readyexecution` WHERE job_id = "
        "prior_job_); SET same_level_ = TRUE;"
    )
    with enqueue_procedure_edited(monkeypatch, read_into, by_subquery):
        error = lock_error_during_an_enqueue_of("A", last_job_moved=True)
    # MariaDB's NOWAIT fails as a lock wait timeout (1205), MySQL 8's with 3572.
    assert error is not None and error.args[0] in (1205, 3572), error


def race_two_enqueues_of_one_group(way: str) -> tuple[list[int], list[int]]:
    """The first enqueue of group X holds its transaction open after its stamp; the second
    runs meanwhile, to its end or to a lock wait; then the first commits. The jobs' turns."""
    enqueue_many("X", 1)  # X's stamp row exists, committed
    return race_two_enqueues_of_x(way)


def race_two_enqueues_of_x(way: str) -> tuple[list[int], list[int]]:
    """Two enqueues of X, ``way``: the first holds its transaction open after its stamp,
    the second runs meanwhile, to its end or to a lock wait, then the first commits."""
    holding, release = threading.Event(), threading.Event()
    enqueue = WAYS[way]

    def first() -> list[int]:
        with transaction.atomic():
            ids = enqueue("X")
            holding.set()
            assert release.wait(20), "never released"
        return ids

    def second() -> list[int]:
        assert holding.wait(20), "the first enqueue never held its stamp"
        with transaction.atomic():
            return enqueue("X")

    runners = [Runner(first), Runner(second)]
    for runner in runners:
        runner.start()
    wait_for(runners[1].blocked_or_done, "the second enqueue to end or wait")
    release.set()
    a, b = (runner.finish() for runner in runners)
    return [turn_of(pk) for pk in a], [turn_of(pk) for pk in b]


@needs_row_locks
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("way", WAYS)
def test_two_enqueues_of_one_group_at_once_take_two_turns(fair, way):
    """The stamp row is locked for the write: the second enqueue waits for the first to
    commit, then reads its stamp."""
    first, second = race_two_enqueues_of_one_group(way)
    assert min(second) == max(first) + TURN_SCALE


def race_two_enqueues_at_the_head(way: str) -> tuple[list[int], list[int]]:
    """X's last job was claimed while another group's job waits at X's last turn (the
    head): the first enqueue of X gives the head again, the same turn its stamp held, and
    holds its transaction open while the second runs (:func:`race_two_enqueues_of_x`)."""
    worker = register_process(DB, "worker")
    bulk_enqueue([(tenant_report, (tenant,), {}) for tenant in ("X", "B")])
    (job,) = claim_jobs(DB, worker.pk, REPORTS, 1)
    assert job.fair_key == "X"
    return race_two_enqueues_of_x(way)


@needs_row_locks
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("way", WAYS)
def test_two_enqueues_of_one_group_at_the_head_at_once_take_two_turns(fair, way):
    """The first writes back the turn the stamp held (the head), with a job of its own: the
    second, which waited for the stamp, must see that job waiting, though its statement's
    snapshot (PostgreSQL) predates it, and step after it."""
    first, second = race_two_enqueues_at_the_head(way)
    assert min(second) == max(first) + TURN_SCALE, (first, second)


def race_a_bulk_enqueue_waiting_for_a_stamp_while_claims_go_on() -> tuple[int, int]:
    """X ran before; A's backlog is being claimed; a transaction holds X's stamp (as an
    enqueue of X does); a bulk enqueue of X and Y (a new group) waits for it while two of
    A's jobs are claimed, then goes on. Y's job's turn, and the head once it committed."""
    worker = register_process(DB, "worker")
    enqueue_one("X")
    assert claim_groups(worker, 1) == ["X"]
    enqueue_many("A", 5)
    holding, release = threading.Event(), threading.Event()

    def first() -> None:
        with transaction.atomic():
            FairTurn.objects.select_for_update().get(fair_key="X")
            holding.set()
            assert release.wait(20), "never released"

    def second() -> list[int]:
        assert holding.wait(20), "the first transaction never held X's stamp"
        return [int(r.id) for r in bulk_enqueue([(tenant_report, (t,), {}) for t in "XY"])]

    runners = [Runner(first), Runner(second)]
    for runner in runners:
        runner.start()
    wait_for(runners[1].blocked_or_done, "the bulk enqueue to wait for X's stamp")
    assert not runners[1].done.is_set(), "the bulk enqueue did not wait for X's stamp"
    assert claim_groups(worker, 2) == ["A", "A"]
    release.set()
    runners[0].finish()
    x, y = runners[1].finish()
    head = ReadyExecution.objects.filter(job__fair_key="A").order_by("turn")[0].turn
    assert turn_of(x) == turn_of(y), "X and Y, neither waiting, start at the same head"
    return turn_of(y), head


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_a_bulk_enqueue_reads_the_head_after_the_stamps_it_waited_for(fair):
    """The turns count from the head as the enqueue read it: read after the stamps' locks,
    a new group's first job does not go ahead of the starts made while it waited for them
    (docs/fairness.md, the stale head)."""
    y, head = race_a_bulk_enqueue_waiting_for_a_stamp_while_claims_go_on()
    assert y == head


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_unprotected_a_head_read_before_the_stamps_locks_puts_a_new_group_behind_it(
    fair, monkeypatch
):
    """The twin: the heads read before the stamps' locks. Y's first job takes the head of
    before the wait, two of A's turns behind the head it finds once committed."""
    real_lock, real_head = fairness.lock_stamps, fairness.queue_head
    early: dict[tuple[str, int], int | None] = {}

    def heads_first(db: str, groups: dict) -> Any:
        for queue, priority, _ in groups:
            early[(queue, priority)] = real_head(db, queue, priority)
        return real_lock(db, groups)

    monkeypatch.setattr(fairness, "lock_stamps", heads_first)
    monkeypatch.setattr(fairness, "queue_head", lambda db, q, p: early[(q, p)])
    y, head = race_a_bulk_enqueue_waiting_for_a_stamp_while_claims_go_on()
    assert y == head - 2 * TURN_SCALE


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's stamp function")
@pytest.mark.django_db(transaction=True)
def test_unprotected_a_function_reading_the_last_job_before_the_stamps_lock_shares_a_turn(
    fair, monkeypatch
):
    """The twin: PostgreSQL's function reads the group's last job's ready row before it
    waits for the stamp's lock (in a snapshot older than the lock, as a statement's is).
    The first enqueue wrote the same turn back (the head) with its own job, which the second
    does not see waiting, so it takes the head too: two jobs of X, one turn."""
    read = (
        "SELECT w.turn, w.queue_name = p_queue_name AND w.priority = p_priority\n"
        '    INTO last_at_, same_level_ FROM "django_jobs_readyexecution" AS w '
        "WHERE w.job_id = prior_job_;\n"
    )
    early = (
        'BEGIN\n  SELECT last_job_id INTO prior_job_ FROM "django_jobs_fairturn" '
        "WHERE queue_name = p_queue_name AND priority = p_priority AND fair_key = p_fair_key;\n"
        f"  {read}"
    )
    with fair_function_edited(monkeypatch, (f"  {read}", ""), ("BEGIN\n", early)):
        first, second = race_two_enqueues_at_the_head("alone")
    assert set(first) & set(second)


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_unprotected_two_enqueues_of_one_group_share_a_turn(fair, monkeypatch):
    """The twin of the ORM's path: the stamp read without the upsert that locks it, both
    enqueues read the same last turn and give their jobs the same one."""

    def unlocked(db: str, groups: list) -> tuple[dict, set]:
        return fairness.read_stamps(db, groups), set()

    monkeypatch.setattr(fairness, "lock_stamps", unlocked)
    first, second = race_two_enqueues_of_one_group("bulk")
    assert set(first) & set(second)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's stamp function")
@pytest.mark.django_db(transaction=True)
def test_unprotected_a_function_reading_the_stamp_without_its_lock_shares_a_turn(fair, monkeypatch):
    """The twin of PostgreSQL's function where X's last job no longer waits: the stamp read
    without ``FOR UPDATE``. The second enqueue reads the stamp the first has not committed
    yet and takes the head as the first did; its write waits for the first's only after."""
    locking = "FOR UPDATE;\n  IF NOT FOUND THEN"
    with fair_function_edited(monkeypatch, (locking, ";\n  IF NOT FOUND THEN")):
        first, second = race_two_enqueues_at_the_head("alone")
    assert set(first) & set(second)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's stamp function")
@pytest.mark.django_db(transaction=True)
def test_unprotected_a_function_stepping_from_a_stamp_read_before_its_update_shares_a_turn(
    fair, monkeypatch
):
    """The twin of PostgreSQL's function where X's last job waits (its one statement): the
    stamp and its job read first, without a lock, and the UPDATE then writes a step after
    what was read. It waits for the first enqueue's lock as the shipped one does, but
    checks nothing again on the version that enqueue wrote, so both take the same turn."""
    group = "queue_name = p_queue_name AND priority = p_priority AND fair_key = p_fair_key"
    update = '  UPDATE "django_jobs_fairturn" AS f SET last_turn = '
    edits = (
        (
            f"{update}f.last_turn + step_,",
            f'  SELECT last_turn, last_job_id INTO prior_, prior_job_ FROM "django_jobs_fairturn" '
            f"WHERE {group};\n{update}prior_ + step_,",
        ),
        ("AND f.last_turn BETWEEN 0 AND", "AND prior_ BETWEEN 0 AND"),
        ("(SELECT w.turn = f.last_turn AND", "(SELECT w.turn = prior_ AND"),
        ("WHERE w.job_id = f.last_job_id)", "WHERE w.job_id = prior_job_)"),
    )
    with fair_function_edited(monkeypatch, *edits):
        first, second = race_two_enqueues_of_one_group("alone")
    assert set(first) & set(second)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's stamp function")
@pytest.mark.django_db
def test_a_fair_enqueue_notifying_in_its_own_statement_is_stamped_and_tells_a_broken_stamp(
    fair, caplog, monkeypatch
):
    """A quiet process notifies in the enqueue's own statement (``notify.INLINE_AFTER`` 0):
    the fair statement in that shape still takes the stamp's turn, and still returns the
    broken-stamp flag beside the notification."""
    from django_jobs.db import notify

    monkeypatch.setattr(notify, "INLINE_AFTER", 0.0)
    (last,) = enqueue_many("A", 1)
    with CaptureQueriesContext(connection) as queries:
        stamped = enqueue_one("A")
    assert any("pg_notify" in q["sql"] and "django_jobs_fair_turn(" in q["sql"] for q in queries)
    assert turn_of(stamped) == turn_of(last) + TURN_SCALE
    FairTurn.objects.filter(fair_key="A").update(last_turn=-5)
    with caplog.at_level(logging.WARNING, logger="django_jobs.fairness"):
        broken = enqueue_one("A")
    assert turn_of(broken) == fifo_turn(broken)
    (record,) = caplog.records
    assert "'A'" in record.getMessage()


def index_reads(names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Scans begun and entries returned so far in this transaction, per index of
    ``names``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, pg_stat_get_xact_numscans(oid), "
            "pg_stat_get_xact_tuples_returned(oid) FROM pg_class WHERE relname = ANY(%s)",
            [list(names)],
        )
        return {name: (scans, entries) for name, scans, entries in cursor.fetchall()}


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's stamp function")
@pytest.mark.django_db
@pytest.mark.parametrize("statistics", ["truncated", "analyzed"])
def test_the_functions_head_reads_are_one_index_edge_each_in_the_plans_it_keeps(fair, statistics):
    """The generic plans (what the function keeps once planned, here forced from the first
    call) of its two reads of the head, beside 5,000 ready jobs of another queue at
    priority 5 and 5,000 of the fair queue at priority 0: a new group's enqueue at priority
    5 (C) and that of a group whose last job no longer waits (A) each start one scan of
    ``jobs_ready_poll`` at the level's edge (C's job, or nothing, found there) and none of
    ``jobs_ready_order``. Written ``queue_name =``, the head read's plan made while the
    table was empty (a new install, or one emptied by TRUNCATE) and kept as it filled reads
    ``jobs_ready_order`` through the other queue's rows: the truncated case fails so, two
    scans returning 10,005 entries (seen with that edit of ``fair_function.head_sql``)."""
    with connection.cursor() as cursor:
        # No row count, as a new table (TRUNCATE forgets it until the test's rollback); its
        # invalidation makes the function plan its reads of the table anew.
        cursor.execute("TRUNCATE django_jobs_readyexecution")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    # A's stamp at priority 5, its job gone: each of the function's head reads runs once
    # (a new group's, then the other branch's), planned on the empty table.
    enqueue_one("A", priority=5)
    ReadyExecution.objects.filter(queue_name="reports", priority=5).delete()
    enqueue_one("A", priority=5)
    bulk_enqueue([(plain_default.using(priority=5), (n,), {}) for n in range(5000)])
    bulk_enqueue([(tenant_report, (f"t{n % 50}",), {}) for n in range(5000)])
    ReadyExecution.objects.filter(queue_name="reports", priority=5).delete()
    if statistics == "analyzed":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE django_jobs_readyexecution")  # planned anew, with them
    indexes = ("jobs_ready_poll", "jobs_ready_order")
    before = index_reads(indexes)
    c, a = enqueue_one("C", priority=5), enqueue_one("A", priority=5)
    after = index_reads(indexes)
    reads = {
        name: tuple(x - y for x, y in zip(after[name], before[name], strict=True))
        for name in indexes
    }
    # Entries: the level's two ready rows of A deleted above, whose index entries this
    # transaction still finds (the heap tells them deleted), each read twice, and C's job.
    assert reads == {"jobs_ready_poll": (2, 5), "jobs_ready_order": (0, 0)}, reads
    assert turn_of(a) == turn_of(c)  # A starts at the head: C's job


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's plan")
@pytest.mark.django_db
def test_the_queues_head_is_one_index_read(fair):
    enqueue_many("A", 200)
    bulk_enqueue([(plain_default, (n,), {}) for n in range(2000)])  # another queue's backlog
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_jobs_readyexecution")
        cursor.execute(
            "EXPLAIN SELECT turn FROM django_jobs_readyexecution WHERE queue_name = %s "
            "AND priority = %s ORDER BY turn LIMIT 1",
            ["reports", 0],
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "jobs_ready_poll" in plan and "Sort" not in plan, plan
    assert fairness.queue_head(DB, "reports", 0) is not None


# --- the other options compose with it ----------------------------------------------------


def assert_takes_turns_with_a_backlog(worker, late: list[int]) -> None:
    """``late``, the jobs of group B enqueued after A's backlog of 20 (in the test), start
    among the first few, not after all of A's."""
    order: list[int] = []
    for _ in range(2 * len(late) + 2):
        order += [job.pk for job in claim_jobs(DB, worker.pk, REPORTS, 1)]
    assert set(late) <= set(order), (late, order)  # FIFO would start them after 20 of A's


@pytest.mark.django_db
def test_a_workflows_dependent_is_stamped_when_its_parent_ends(fair, worker):
    from django_jobs import workflow

    enqueue_many("A", 20)
    with workflow() as wf:
        parent = wf.add(tenant_report, "B")
        child = wf.add(tenant_report, "B", after=[parent])
    parent_id, child_id = int(parent.result.id), int(child.result.id)
    assert Job.objects.get(pk=child_id).fair_key == "B"
    order = []
    while parent_id not in order:
        (job,) = claim_jobs(DB, worker.pk, REPORTS, 1)
        order.append(job.pk)
    assert len(order) <= 3, order  # B's parent took the head's turn
    assert start_job(DB, job, worker.pk, worker.name)
    assert finish_job(DB, parent_id, worker.pk, None)
    # Released by its parent's end, the dependent is made ready with a turn of its group's.
    assert turn_of(child_id) < max(ReadyExecution.objects.values_list("turn", flat=True))
    assert_takes_turns_with_a_backlog(worker, [child_id])


@pytest.mark.django_db
def test_a_batchs_items_take_turns_with_a_backlog(fair, worker):
    from django_jobs import enqueue_batch

    enqueue_many("A", 20)
    made = enqueue_batch([(tenant_report, ["B"], {}) for _ in range(3)])
    items = [int(result.id) for result in made.results]
    assert set(Job.objects.filter(pk__in=items).values_list("fair_key", flat=True)) == {"B"}
    assert_takes_turns_with_a_backlog(worker, items)


@pytest.mark.django_db
def test_a_unique_and_fair_job_takes_turns_and_stays_unique(fair, worker):
    from tests.fair_tasks import unique_report

    enqueue_many("A", 20)
    first = int(unique_report.enqueue("B", 1).id)
    again = int(unique_report.enqueue("B", 1).id)
    assert again == first  # the holder's result: one job per unique key
    assert_takes_turns_with_a_backlog(worker, [first])


@pytest.mark.django_db
def test_a_rate_limited_fair_job_takes_turns(fair, worker):
    from tests.fair_tasks import rated_report

    enqueue_many("A", 20)
    late = [int(rated_report.enqueue("B").id) for _ in range(2)]
    assert_takes_turns_with_a_backlog(worker, late)


@pytest.mark.django_db
def test_a_projects_test_runs_its_fair_jobs_in_turns_with_run_enqueued_jobs(fair):
    """As a user's test would: the test toolkit runs what the code enqueued, in the fair
    order (docs/fairness.md, "Testing")."""
    from django_jobs.testing import run_enqueued_jobs

    enqueue_many("A", 5)
    late = enqueue_one("B")
    report = run_enqueued_jobs(queue="reports")
    assert [run.args[0] for run in report.runs] == ["A", "B", "A", "A", "A", "A"]
    assert report.runs[1].job_id == late


# --- the prune of idle stamps (core.maintenance.prune_fair_turns) ---------------------------


def age_stamps(*keys: str) -> None:
    """The stamps of ``keys`` last written two days ago: idle past FAIR_TURN_IDLE."""
    long_ago = timezone.now() - 2 * FAIR_TURN_IDLE
    FairTurn.objects.filter(fair_key__in=keys).update(updated_at=long_ago)


def queue_head() -> int | None:
    return fairness.queue_head(DB, "reports", 0)


@pytest.mark.django_db
def test_the_prune_deletes_the_idle_stamps_whose_last_job_no_longer_waits(fair, worker):
    """B's job started and nothing of B waits: its stamp goes, and B's next job takes the
    head, as it would with the stamp. A's last job waits, C's stamp is recent: both stay."""
    enqueue_many("B", 1)
    assert claim_groups(worker, 1) == ["B"]
    enqueue_many("A", 3)
    enqueue_many("C", 1)
    age_stamps("A", "B")
    assert prune_fair_turns(DB) == 1
    assert sorted(FairTurn.objects.values_list("fair_key", flat=True)) == ["A", "C"]
    head = queue_head()
    (late,) = enqueue_many("B", 1)
    assert turn_of(late) == head


def enqueue_meanwhile(tenant: str) -> Any:
    """``delete_idle_stamp`` run right after another transaction, which enqueues a job of
    ``tenant`` and commits, between the prune's read of its candidates and its lock."""
    real = maintenance.delete_idle_stamp

    def interleaved(db: str, pk: int, cutoff: Any) -> bool:
        enqueue_one(tenant)
        return real(db, pk, cutoff)

    return interleaved


@pytest.mark.django_db(transaction=True)
def test_a_stamp_written_between_the_prunes_read_and_its_lock_is_kept(fair, worker, monkeypatch):
    """X's stamp was idle when the prune read it; an enqueue of X committed before the prune
    locked it: the prune decides again under the lock and keeps it, so X's next job comes a
    step after the one waiting, not at the head beside it."""
    enqueue_many("A", 5)
    enqueue_one("X")
    (job,) = claim_jobs(DB, worker.pk, REPORTS, 1)
    assert job.fair_key == "A"
    assert claim_groups(worker, 1) == ["X"]
    age_stamps("X")
    monkeypatch.setattr(maintenance, "delete_idle_stamp", enqueue_meanwhile("X"))
    assert prune_fair_turns(DB) == 0
    waiting = ReadyExecution.objects.filter(job__fair_key="X").get().turn
    assert turn_of(enqueue_one("X")) == waiting + TURN_SCALE


@pytest.mark.django_db(transaction=True)
def test_unprotected_a_prune_deleting_what_it_read_gives_two_jobs_of_a_group_one_turn(
    fair, worker, monkeypatch
):
    """The twin: the prune deletes the stamps it read as idle without locking them and
    deciding again. X's enqueue in between is forgotten: X's next job takes the head, the
    turn of X's job still waiting."""
    enqueue_many("A", 5)
    enqueue_one("X")
    claim_jobs(DB, worker.pk, REPORTS, 1)
    assert claim_groups(worker, 1) == ["X"]
    age_stamps("X")

    def unlocked(db: str, pk: int, cutoff: Any) -> bool:
        enqueue_one("X")
        return FairTurn.objects.filter(pk=pk).delete()[0] == 1

    monkeypatch.setattr(maintenance, "delete_idle_stamp", unlocked)
    assert prune_fair_turns(DB) == 1
    waiting = ReadyExecution.objects.filter(job__fair_key="X").get().turn
    assert turn_of(enqueue_one("X")) == waiting
