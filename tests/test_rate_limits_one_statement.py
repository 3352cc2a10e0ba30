"""PostgreSQL's rated start in one statement (``db/postgresql/rate_limits.start_rated``): it
decides as ``core.rate_limits.Window`` decides, or leaves the start to the transaction having
written nothing; and its locks keep a window's last start to one of two starters."""

from __future__ import annotations

import math
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import event, given, settings
from hypothesis import strategies as st

from django_jobs.core import starting
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.rate_limits import ensure_rate_rows, times
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import Waiting
from django_jobs.core.starting import start_jobs
from django_jobs.models import ClaimedExecution, Job, JobStatus, RateLimit, UniqueUntil
from tests import rate_tasks
from tests.test_races import Paused, Runner, wait_for

DB = "default"
ALL = QueueSelector(("*",))

pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the one statement of db/postgresql/rate_limits.py"
)


def pg():
    from django_jobs.db.postgresql import rate_limits

    return rate_limits


# --- what it decides is what the window decides ------------------------------------------------

BASE = datetime(2026, 1, 1, tzinfo=UTC)
RATES = [(1, 60.0), (2, 1.0), (3, 1.0), (5, 0.5), (4, 3600.0), (100, 1.0), (10_000, 1.0)]
# What no start time is, written into a row by hand, a restore or a bug: Window drops it.
GARBAGE = ["x", True, None, [1.0], {"t": 1.0}, 10**400, 1e20, -1e20, 5e-7, 0, 4e9, 9e15]


@st.composite
def moments(draw, clock: float, period: float, hostile: bool) -> object:
    """One element of a window's list: mostly times behind ``clock`` as starts and plans
    leave them, or at it, or whole seconds (an int); in a hostile window also times a
    little ahead of it (a clock ahead, a plan) and things that are no time at all."""
    kinds = ["behind"] * 6 + ["at", "int", "micro"] + (["ahead", "garbage"] if hostile else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "behind":
        return clock - draw(st.floats(0, 3 * period, allow_nan=False))
    if kind == "at":
        return clock
    if kind == "ahead":
        return clock + draw(st.floats(0, 2, allow_nan=False, exclude_min=True))
    if kind == "int":
        return math.floor(clock) - draw(st.integers(0, 5))
    if kind == "micro":
        return clock - draw(st.integers(0, 2_000_000)) / 1e6
    return draw(st.sampled_from(GARBAGE))


def in_order(values: list) -> list:
    return sorted(values, key=lambda t: t if isinstance(t, int | float) else 0)


@st.composite
def windows(
    draw, clock: float, period: float, reserved: list[datetime], clean: bool
) -> tuple[list, list]:
    """A key's starts and plan. Mostly as starts leave them: in order, each start planned
    too, sometimes the last one from a clock ahead of ours; the plan holding the times of
    jobs back from waiting. Unless ``clean``, now and then a hostile one: any order,
    plans ahead, garbage."""
    hostile = not clean and not draw(st.integers(0, 4))
    starts = draw(st.lists(moments(clock, period, hostile), max_size=6))
    planned = draw(st.lists(moments(clock, period, hostile), max_size=4))
    if hostile:
        return starts, planned
    if draw(st.integers(0, 3)) == 0:
        starts.append(clock + draw(st.floats(0, 2, allow_nan=False, exclude_min=True)))
    starts = in_order(starts)
    planned = in_order([*planned, *starts[len(starts) // 2 :]])
    for at in reserved:
        planned += [at.timestamp()] * draw(st.integers(0, 2))
    return starts, in_order(planned)


# Rates no window of at most six starts fills, for starts a limit does not hold back.
ROOMY = [(100, 1.0), (50, 60.0), (10_000, 1.0)]


@st.composite
def scenarios(draw, clean: bool = False) -> dict:
    """Up to three keys, each with its row (or none), its window and one to three claimed
    jobs of one rate (or, now and then, another one), some of them back from waiting.
    ``clean``: a start no limit holds back, of windows as starts leave them (a clock
    ahead and jobs back from waiting included), which the statement must decide."""
    now = BASE + timedelta(microseconds=draw(st.integers(0, 10**13)))
    clock = now.timestamp()
    keys = []
    for n in range(draw(st.sampled_from([1, 1, 2, 3]))):
        limit, period = draw(st.sampled_from(ROOMY if clean else RATES))
        reserved = [
            now - timedelta(microseconds=draw(st.integers(1 if clean else -10, 3_000_000)))
            for _ in range(draw(st.integers(0, 2)))
        ]
        starts, planned = draw(windows(clock, period, reserved, clean))
        jobs = []
        for _ in range(draw(st.integers(1, 3))):
            rate = (limit, period)
            if not clean and not draw(st.integers(0, 19)):
                rate = draw(st.sampled_from(RATES))
            if not clean and not draw(st.integers(0, 39)):
                rate = draw(st.sampled_from([(0, 1.0), (20_000, 1.0), (3, 0.0), (3, math.nan)]))
            back = reserved and draw(st.booleans())
            jobs.append((rate, draw(st.sampled_from(reserved)) if back else None))
        row = clean or draw(st.integers(0, 19)) > 0
        keys.append({"key": f"k{n}", "row": row, "starts": starts, "planned": planned})
        keys[-1]["jobs"] = jobs
    plain = draw(st.integers(0, 1))  # a job unique until its start, without a rate
    return {"now": now, "keys": keys, "plain": plain}


def plant(scenario: dict, process_id: int) -> list[int]:
    """The scenario's rows: rate rows, claimed jobs (each with a past attempt or not)."""
    now = scenario["now"]
    RateLimit.objects.bulk_create(
        RateLimit(key=k["key"], limit=3, period=1.0, starts=k["starts"], planned=k["planned"])
        for k in scenario["keys"]
        if k["row"]
    )
    jobs = [
        Job(
            task_path="tests.rate_tasks.call_api",
            queue_name="default",
            status=JobStatus.CLAIMED,
            rate_key=k["key"],
            rate_limit=limit,
            rate_period=period,
            rate_reserved_at=reserved,
            attempts=n % 2,
            worker_ids=["earlier"] * (n % 2),
            started_at=now - timedelta(minutes=5) if n % 2 else None,
        )
        for k in scenario["keys"]
        for n, ((limit, period), reserved) in enumerate(k["jobs"])
    ]
    jobs += [
        Job(
            task_path="tests.tasks.add",
            queue_name="default",
            status=JobStatus.CLAIMED,
            unique_key="one",
            unique_lock="one",
            unique_until=UniqueUntil.START,
        )
        for _ in range(scenario["plain"])
    ]
    Job.objects.bulk_create(jobs)
    ClaimedExecution.objects.bulk_create(
        ClaimedExecution(job_id=job.pk, process_id=process_id) for job in jobs
    )
    return sorted(job.pk for job in jobs)


def written(ids: list[int]) -> tuple:
    """What a start leaves: the jobs, their executions, and each window as ``Window``
    reads it (``times()``: a whole second written as 5 or as 5.0 is one time)."""
    jobs = list(
        Job.objects.filter(pk__in=ids)
        .order_by("pk")
        .values_list(
            "pk",
            "status",
            "attempts",
            "worker_ids",
            "started_at",
            "last_attempted_at",
            "rate_reserved_at",
            "unique_lock",
        )
    )
    claims = sorted(ClaimedExecution.objects.filter(job_id__in=ids).values_list("pk", flat=True))
    windows = [
        (row.key, row.limit, row.period, times(row.starts), times(row.planned), row.updated_at)
        for row in RateLimit.objects.order_by("key")
    ]
    return jobs, claims, windows


# Django 6.1 names it savepoint_create() (savepoint() deprecated); 6.0 has only savepoint().
new_savepoint = getattr(transaction, "savepoint_create", None) or transaction.savepoint


def compare(process_id: int, scenario: dict) -> bool:
    """Start the scenario's jobs by the statement, then (rolled back to before it) by the
    transaction: whatever the statement decides, the transaction decides the same, to the
    microsecond; what it leaves, it leaves untouched. Whether it decided."""
    now = scenario["now"]
    with transaction.atomic():
        ids = plant(scenario, process_id)
        before = written(ids)
        tried = new_savepoint()
        one, missing = pg().start_rated(DB, ids, process_id, "this worker", now)
        by_statement = written(ids)
        transaction.savepoint_rollback(tried)
        locked = starting.start_locked(DB, ids, process_id, "this worker", now)
        by_window = written(ids)
        transaction.set_rollback(True)
    rowless = sorted(k["key"] for k in scenario["keys"] if not k["row"])
    if one is None:
        # Left to the transaction, having written nothing; naming the keys without a row.
        assert by_statement == before
        assert sorted(missing) == rowless
        event("left to the transaction")
        return False
    assert not any(isinstance(row, Waiting) for row in locked.values())
    assert (one, missing, rowless) == (locked, [], [])
    assert by_statement == by_window
    event("decided by the statement")
    return True


@given(scenario=scenarios())
@settings(max_examples=500)
def decides_as_the_window(process_id: int, scenario: dict) -> None:
    compare(process_id, scenario)


SEEN: dict[str, int] = {}


@given(scenario=scenarios(clean=True))
@settings(max_examples=200)
def decides_what_no_limit_holds_back(process_id: int, scenario: dict) -> None:
    assert compare(process_id, scenario)
    clock = scenario["now"].timestamp()
    if any(isinstance(t, float) and t > clock for k in scenario["keys"] for t in k["starts"]):
        SEEN["a clock ahead"] = SEEN.get("a clock ahead", 0) + 1
    if any(reserved for k in scenario["keys"] for _, reserved in k["jobs"]):
        SEEN["back from waiting"] = SEEN.get("back from waiting", 0) + 1


@pytest.mark.django_db
def test_the_statement_decides_as_the_window_or_leaves_the_start_to_the_transaction():
    """Generated windows (garbage, plans ahead, clocks ahead, any order), rates (some out
    of bounds, some differing within a key), reservations and rows gone: whenever the
    statement decides, it starts what the transaction starts and writes what it writes
    (the same jobs, windows, times to the microsecond); otherwise it writes nothing."""
    decides_as_the_window(register_process(DB, "worker").pk)


@pytest.mark.django_db
def test_the_statement_decides_every_start_no_limit_holds_back():
    """Windows as starts leave them, with room: the statement decides each of them (as
    the transaction would), a clock ahead of ours and jobs back from waiting included."""
    SEEN.clear()
    decides_what_no_limit_holds_back(register_process(DB, "worker").pk)
    assert min(SEEN.get("a clock ahead", 0), SEEN.get("back from waiting", 0)) >= 10, SEEN


@pytest.mark.django_db
@pytest.mark.parametrize("fraction", [0.0078125, 0.0234375, 0.25, 0.999999999])
def test_a_start_after_a_clock_ahead_is_stamped_as_datetime_fromtimestamp_stamps_it(fraction):
    """A key's last start recorded by a clock ahead of ours: our start is recorded at that
    time, stamped as Python stamps it (7812.5 microseconds to 7812, 23437.5 to 23438,
    half to even; .999999999 s up to the next second)."""
    process = register_process(DB, "worker")
    now = BASE + timedelta(seconds=10)
    ahead = now.timestamp() + 1 + fraction
    scenario = {
        "now": now,
        "keys": [{"key": "k", "row": True, "starts": [ahead], "planned": [ahead], "jobs": []}],
        "plain": 0,
    }
    scenario["keys"][0]["jobs"] = [((3, 1.0), None)]
    ids = plant(scenario, process.pk)
    started, _ = pg().start_rated(DB, ids, process.pk, "this worker", now)
    assert started is not None
    stamp = datetime.fromtimestamp(ahead, tz=UTC)
    assert started[ids[0]].last_attempted_at == stamp
    assert Job.objects.get(pk=ids[0]).last_attempted_at == stamp
    assert RateLimit.objects.get().starts == [ahead, ahead]


# --- one round trip, and the transaction for what it leaves -------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_start_the_limit_does_not_hold_back_is_one_statement():
    worker = register_process(DB, "worker")
    ids = [int(rate_tasks.call_api.enqueue(account).id) for account in ("a", "b", "a")]
    ensure_rate_rows(DB, ["tests.rate_tasks.call_api/a", "tests.rate_tasks.call_api/b"])
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    with CaptureQueriesContext(connection) as queries:
        started = start_jobs(DB, claimed, worker.pk, worker.name)
    assert sorted(job.pk for job in started) == ids
    assert [query["sql"][:9] for query in queries.captured_queries] == ["WITH h AS"]
    assert {len(row.starts) for row in RateLimit.objects.all()} == {1, 2}


@pytest.mark.django_db(transaction=True)
def test_a_key_without_a_row_gets_one_and_the_statement_is_tried_again():
    """A key started for the first time anywhere (or pruned since): the statement names
    it, writing nothing; its row is created, and the statement starts the job."""
    worker = register_process(DB, "worker")
    ensure_rate_rows(DB, ["tests.rate_tasks.call_api/a"])
    ids = [int(rate_tasks.call_api.enqueue(account).id) for account in ("a", "b")]
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    with CaptureQueriesContext(connection) as queries:
        started = start_jobs(DB, claimed, worker.pk, worker.name)
    assert sorted(job.pk for job in started) == ids
    statements = [query["sql"][:11] for query in queries.captured_queries]
    assert statements == ["WITH h AS M", "INSERT INTO", "WITH h AS M"]
    assert sorted(RateLimit.objects.values_list("key", flat=True)) == [
        "tests.rate_tasks.call_api/a",
        "tests.rate_tasks.call_api/b",
    ]
    assert [len(row.starts) for row in RateLimit.objects.all()] == [1, 1]


@pytest.mark.django_db(transaction=True)
def test_a_start_over_the_limit_is_left_to_the_transaction(monkeypatch):
    """Three jobs of a 1/m key: the statement writes nothing, the transaction starts one
    and sends two to wait."""
    answers = []
    original = pg().start_rated

    def recorded(*args):
        answers.append(original(*args))
        return answers[-1]

    monkeypatch.setattr(pg(), "start_rated", recorded)
    worker = register_process(DB, "worker")
    ids = [int(rate_tasks.once_a_minute.enqueue(n).id) for n in range(3)]
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    assert [job.pk for job in start_jobs(DB, claimed, worker.pk, worker.name)] == ids[:1]
    # Its key had no row: named, created, then the statement again, which leaves it.
    assert answers == [(None, ["tests.rate_tasks.once_a_minute"]), (None, [])]
    assert Job.objects.filter(status=JobStatus.SCHEDULED, attempts=0).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_job_back_from_waiting_is_started_by_the_transaction_without_trying(monkeypatch):
    """Its key's plan is most likely ahead (a backlog): no round trip for nothing."""
    monkeypatch.setattr(pg(), "start_rated", lambda *args: pytest.fail("tried"))
    worker = register_process(DB, "worker")
    job_id = int(rate_tasks.call_api.enqueue("a").id)
    Job.objects.filter(pk=job_id).update(rate_reserved_at=timezone.now())
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    assert [job.pk for job in start_jobs(DB, claimed, worker.pk, worker.name)] == [job_id]


# --- two starters at once: the statement's lock on the rate row decides ------------------------


def race_through_one_statement(monkeypatch) -> int:
    """Two workers start one job each of a 1/m key by the one statement; the first runs it
    in a transaction and is paused after it (its locks held, its window written, not
    committed). Returns how many jobs started."""
    rate_tasks.once_a_minute.enqueue(1)
    rate_tasks.once_a_minute.enqueue(2)
    first_worker, second_worker = register_process(DB, "worker"), register_process(DB, "worker")
    (first_job,) = claim_jobs(DB, first_worker.pk, ALL, 1)
    (second_job,) = claim_jobs(DB, second_worker.pk, ALL, 1)
    # Made sure of before: neither start inserts the row (an insert would be a lock too).
    ensure_rate_rows(DB, [first_job.rate_key])
    paused = Paused(monkeypatch, pg(), "start_rated")

    def first_start() -> list[Job]:
        with transaction.atomic():
            return start_jobs(DB, [first_job], first_worker.pk, first_worker.name)

    first = Runner(first_start, paused)
    first.start()
    assert paused.reached.wait(10)
    second = Runner(lambda: start_jobs(DB, [second_job], second_worker.pk, second_worker.name))
    second.start()
    wait_for(second.blocked_or_done, "the second start")
    paused.resume.set()
    return len(first.finish()) + len(second.finish())


@pytest.mark.django_db(transaction=True)
def test_the_statement_locks_the_rate_row_so_two_starters_take_one_start(monkeypatch):
    """The second statement waits for the rate row, then reads the window the first wrote:
    full, so it writes nothing, and the transaction sends its job to wait."""
    assert race_through_one_statement(monkeypatch) == 1
    assert Job.objects.filter(status=JobStatus.RUNNING).count() == 1
    assert Job.objects.filter(status=JobStatus.SCHEDULED, attempts=0).count() == 1
    assert len(RateLimit.objects.get().starts) == 1


@pytest.mark.django_db(transaction=True)
def test_unprotected_the_statement_reading_the_rate_row_unlocked_starts_both(monkeypatch):
    """The twin: without the rate rows' ``FOR UPDATE`` the second statement decides on the
    window as its snapshot has it (empty), waits only to write, then overwrites the
    first's start: two starts in one minute of a 1/m key."""
    statement = pg().start_rated_statement(DB)
    unlocked = statement.replace("WHERE key = o.k FOR UPDATE)", "WHERE key = o.k)")
    assert unlocked != statement
    monkeypatch.setattr(pg(), "start_rated_statement", lambda db: unlocked)
    assert race_through_one_statement(monkeypatch) == 2
    assert Job.objects.filter(status=JobStatus.RUNNING).count() == 2
    assert len(RateLimit.objects.get().starts) == 1  # the first's start, overwritten


def first_key_locked_while_the_last_waits(monkeypatch) -> bool:
    """One start of two jobs of two keys while another transaction holds the later key's
    rate row: whether the earlier key's row is locked while the statement waits."""
    worker = register_process(DB, "worker")
    rate_tasks.call_api.enqueue("a")
    rate_tasks.call_api.enqueue("b")
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    first, last = sorted(job.rate_key for job in claimed)
    ensure_rate_rows(DB, [first, last])
    held, release = threading.Event(), threading.Event()

    def hold_the_last_key() -> None:
        with transaction.atomic():
            RateLimit.objects.select_for_update().get(key=last)
            held.set()
            assert release.wait(20)

    holder = Runner(hold_the_last_key)
    holder.start()
    assert held.wait(10)
    starter = Runner(lambda: start_jobs(DB, claimed, worker.pk, worker.name))
    starter.start()
    wait_for(starter.blocked_or_done, "the start")
    try:
        with transaction.atomic():
            list(RateLimit.objects.select_for_update(nowait=True).filter(key=first))
        locked = False
    except OperationalError:
        locked = True
    release.set()
    holder.finish()
    assert len(starter.finish()) == 2
    return locked


@pytest.mark.django_db(transaction=True)
def test_the_statement_locks_the_rate_rows_in_ascending_key_order(monkeypatch):
    """docs/design.md section 4: rate rows in ascending key order, so two starts sharing
    two keys cannot each hold one and wait for the other. Waiting for the later key, the
    statement already holds the earlier."""
    assert first_key_locked_while_the_last_waits(monkeypatch)


@pytest.mark.django_db(transaction=True)
def test_unprotected_the_statement_locking_in_descending_order_waits_holding_nothing(
    monkeypatch,
):
    """The twin: keys taken in descending order, the statement waits for the later key
    first, and the earlier is free: the order the other test sees is the statement's."""
    statement = pg().start_rated_statement(DB)
    descending = statement.replace(
        'ORDER BY k COLLATE "C") AS o', 'ORDER BY k COLLATE "C" DESC) AS o'
    )
    assert descending != statement
    monkeypatch.setattr(pg(), "start_rated_statement", lambda db: descending)
    assert not first_key_locked_while_the_last_waits(monkeypatch)


def test_the_statement_is_short_enough_for_psycopgs_cache():
    """psycopg converts the placeholders of a statement over 4,096 characters again at each
    execution (``MAX_CACHED_STATEMENT_LENGTH``)."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    assert len(pg().start_rated_statement(DB)) <= MAX_CACHED_STATEMENT_LENGTH
