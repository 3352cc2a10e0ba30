"""Every number a task declares is finite and bounded where it is written, and nothing
a job row says is executed except its task.

A NaN timeout never times out; an infinite lease, a backoff of 1e12 seconds or an
attempt count of 2000 once raised ``OverflowError`` inside a worker's transaction;
a row's ``{"path": "os._exit"}`` backoff was imported and called. Declarations fail
at once, naming the option, and a row's values are read as data: bounded, or the
default.
"""

from __future__ import annotations

import logging
import math
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.tasks import task as django_task
from django.tasks.exceptions import InvalidTask
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from django_jobs import Exponential, Snooze
from django_jobs import task as jobs_task
from django_jobs.core.claimed import fail_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.rate_limits import Window
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_job, start_jobs
from django_jobs.limits import MAX_ATTEMPTS, MAX_SECONDS
from django_jobs.models import Job, JobStatus, RateLimit, ScheduledExecution
from django_jobs.tasks.backoff import DEFAULT_BACKOFF
from django_jobs.tasks.rates import Rate, parse_rate
from django_jobs.tasks.retries import retry_delay
from tests import rate_tasks

HERE = __name__  # tests.test_bounded_options, as a job row names it
CENTURY = timedelta(seconds=MAX_SECONDS)
# No example database: the checkout is shared by concurrent runs.
PROPERTY = settings(max_examples=300)

# Calls of the backoff functions below, by name: a row must never make one run.
calls: list[tuple[str, int]] = []


def recording_backoff(attempt: int) -> float:
    calls.append(("recording_backoff", attempt))
    return 1.0


def declared_backoff(attempt: int) -> float:
    calls.append(("declared_backoff", attempt))
    return attempt * 7.0


def failing_backoff(attempt: int) -> float:
    raise RuntimeError("the backoff itself is broken")


# What returning_backoff returns: set by the test that uses it.
returned: dict[str, Any] = {"value": 1.0}


def returning_backoff(attempt: int) -> Any:
    return returned["value"]


def echo(value: Any = None) -> Any:
    return value


@jobs_task(max_attempts=3, backoff=declared_backoff)
def with_declared_backoff(value: Any = None) -> Any:
    return value


@jobs_task(max_attempts=3, backoff=failing_backoff)
def with_failing_backoff(value: Any = None) -> Any:
    return value


@jobs_task(max_attempts=3, backoff=returning_backoff)
def with_returning_backoff(value: Any = None) -> Any:
    return value


@jobs_task(max_attempts=3, backoff=5)
def with_fixed_backoff(value: Any = None) -> Any:
    return value


@pytest.fixture(autouse=True)
def no_calls_yet():
    calls.clear()


def short(value: Any) -> str:
    """A test id: the repr of a 400-digit int is no name."""
    text = repr(value)
    return text if len(text) <= 30 else f"{text[:12]}...({len(text)} chars)"


def default_range(attempt: int) -> tuple[float, float]:
    """Where the default backoff's delay falls for ``attempt``, jitter included."""
    delay = DEFAULT_BACKOFF.undithered(attempt)
    return delay * (1 - DEFAULT_BACKOFF.jitter), delay * (1 + DEFAULT_BACKOFF.jitter)


def is_default(delay: float, attempt: int) -> bool:
    low, high = default_range(attempt)
    return low <= delay <= min(high, DEFAULT_BACKOFF.max)


# --- task options, at declaration and in using() ------------------------------------


BAD_SECONDS = [
    math.nan,
    math.inf,
    -math.inf,
    0,
    -1,
    1e12,
    MAX_SECONDS + 1,
    10**400,
    timedelta(days=40_000),
    timedelta(0),
    True,
    "60",
]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=short)
@pytest.mark.parametrize("option", ["timeout", "concurrency_duration"])
def test_a_duration_must_be_finite_positive_and_within_a_century(option, value):
    with pytest.raises(InvalidTask, match=option):
        jobs_task(echo, concurrency_key="k", **{option: value})
    declared = jobs_task(echo, concurrency_key="k")
    with pytest.raises(InvalidTask, match=option):
        declared.using(**{option: value})


@pytest.mark.parametrize("value", [0.001, 1, 3600.0, MAX_SECONDS, timedelta(days=36_600)])
@pytest.mark.parametrize("option", ["timeout", "concurrency_duration"])
def test_durations_within_bounds_are_kept(option, value):
    declared = jobs_task(echo, concurrency_key="k", **{option: value})
    assert getattr(declared, option) == value
    assert getattr(declared.using(**{option: value}), option) == value


@pytest.mark.parametrize(
    "value", [0, -1, MAX_ATTEMPTS + 1, 10**400, True, 2.0, "3", None], ids=short
)
def test_max_attempts_is_an_integer_from_one_to_the_maximum(value):
    with pytest.raises(InvalidTask, match="max_attempts must be an integer from 1 to 1,000,000"):
        jobs_task(echo, max_attempts=value)
    with pytest.raises(InvalidTask, match="max_attempts"):
        with_fixed_backoff.using(max_attempts=value)
    assert jobs_task(echo, max_attempts=MAX_ATTEMPTS).max_attempts == MAX_ATTEMPTS


@pytest.mark.parametrize("value", [0, 1_000_001, 10**400, True], ids=short)
def test_concurrency_limit_is_bounded(value):
    with pytest.raises(InvalidTask, match="concurrency_limit"):
        jobs_task(echo, concurrency_key="k", concurrency_limit=value)


@pytest.mark.parametrize(
    "value", [1e12, math.inf, math.nan, -1, MAX_SECONDS * 2, 10**400], ids=short
)
def test_a_fixed_backoff_out_of_range_is_refused_at_declaration(value):
    with pytest.raises(InvalidTask, match="backoff"):
        jobs_task(echo, backoff=value)
    with pytest.raises(InvalidTask, match="backoff"):
        with_fixed_backoff.using(backoff=value)


def test_a_backoff_function_must_have_a_name_a_row_can_give():
    class Callable:
        def __call__(self, attempt: int) -> float:
            return 1.0

    for value in (lambda attempt: 1.0, Callable()):
        with pytest.raises(InvalidTask, match="module level"):
            jobs_task(echo, backoff=value)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"base": math.nan}, "base"),
        ({"base": -1}, "base"),
        ({"base": 1e12}, "base"),
        ({"max": math.inf}, "max"),
        ({"max": -5}, "max"),
        ({"max": 10**400}, "max"),
        ({"factor": 0.5}, "factor"),
        ({"factor": math.inf}, "factor"),
        ({"factor": math.nan}, "factor"),
        ({"factor": "2"}, "factor"),
        ({"jitter": 1}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"jitter": math.nan}, "jitter"),
        ({"base": True}, "base"),
    ],
)
def test_exponential_checks_its_own_fields(fields, named):
    with pytest.raises(ValueError, match=f"Exponential {named} must be"):
        Exponential(**fields)


# --- Exponential never overflows -------------------------------------------------------


@pytest.mark.parametrize("attempt", [2000, 10**6, 10**9, 10**100, -(10**9), 0], ids=short)
def test_exponential_reaches_its_cap_without_overflowing(attempt):
    spec = Exponential(base=2.0, factor=2.0, max=3600.0, jitter=0.25)
    delay = spec(attempt)
    assert math.isfinite(delay) and 0 <= delay <= spec.max
    if attempt > 20:
        assert delay >= spec.max * (1 - spec.jitter)


def test_exponential_grows_then_holds_at_max():
    spec = Exponential(base=1, factor=3, max=100, jitter=0)
    assert [spec(a) for a in range(1, 8)] == [1, 3, 9, 27, 81, 100, 100]
    assert spec(10**6) == 100


def test_a_tiny_base_and_a_slow_factor_still_reach_the_cap():
    """``cap / base`` and ``factor ** steps`` both overflow a float here; the delay
    must not."""
    spec = Exponential(base=5e-324, factor=1.0000001, max=MAX_SECONDS, jitter=0)
    # 7.3e9: factor ** steps alone overflows a float, the delay is still below the cap.
    for attempt in (10, 10**8, 7_300_000_000, 10**10, 10**12):
        delay = spec(attempt)
        assert math.isfinite(delay) and 0 <= delay <= MAX_SECONDS
    assert spec(10**12) == MAX_SECONDS


@given(
    base=st.floats(0, MAX_SECONDS),
    factor=st.floats(1, 1e300),
    cap=st.floats(0, MAX_SECONDS),
    jitter=st.floats(0, 0.99),
    attempt=st.integers(min_value=-10, max_value=10**30),
)
@PROPERTY
def test_exponential_is_always_a_delay_within_its_max(base, factor, cap, jitter, attempt):
    delay = Exponential(base=base, factor=factor, max=cap, jitter=jitter)(attempt)
    assert math.isfinite(delay) and 0 <= delay <= cap


# --- a row's backoff is data ---------------------------------------------------------


def test_a_row_naming_any_function_does_not_run_it(caplog):
    row = {"path": f"{HERE}.recording_backoff"}
    with caplog.at_level(logging.WARNING, logger="django_jobs.backoff"):
        # Its task declares another function; no task at all; a task that does not load.
        for task_path in (f"{HERE}.with_declared_backoff", None, "tests.gone.task"):
            assert is_default(retry_delay(row, 3, task_path), 3)
        assert is_default(retry_delay(row, 3), 3)  # the old two-argument call
    assert calls == []
    assert "recording_backoff" in caplog.text and "default backoff is used" in caplog.text


def test_a_row_naming_os_exit_gets_the_default_delay(monkeypatch):
    """Were the row's path imported, this stand-in would be what it found and called."""
    exits: list[Any] = []
    monkeypatch.setattr(os, "_exit", lambda *args: exits.append(args))
    for task_path in (None, f"{HERE}.with_declared_backoff", "os._exit"):
        assert is_default(retry_delay({"path": "os._exit"}, 2, task_path), 2)
    assert exits == []


def test_the_backoff_function_a_task_declares_is_used():
    row = {"path": f"{HERE}.declared_backoff"}
    assert retry_delay(row, 4, f"{HERE}.with_declared_backoff") == 28.0
    assert calls == [("declared_backoff", 4)]


def test_the_declared_function_of_another_task_is_not_used():
    row = {"path": f"{HERE}.declared_backoff"}
    assert is_default(retry_delay(row, 4, f"{HERE}.with_fixed_backoff"), 4)
    assert calls == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (math.nan, None),
        (math.inf, None),
        ("60", None),
        (None, None),
        (True, None),
        (1e12, MAX_SECONDS),
        (10**400, MAX_SECONDS),
        (-5, 0.0),
        (12, 12.0),
    ],
    ids=short,
)
def test_what_a_backoff_function_returns_is_bounded_or_replaced(monkeypatch, value, expected):
    monkeypatch.setitem(returned, "value", value)
    row = {"path": f"{HERE}.returning_backoff"}
    delay = retry_delay(row, 2, f"{HERE}.with_returning_backoff")
    assert delay == expected if expected is not None else is_default(delay, 2)


def test_a_backoff_function_that_raises_gives_the_default(caplog):
    row = {"path": f"{HERE}.failing_backoff"}
    with caplog.at_level(logging.WARNING, logger="django_jobs.backoff"):
        assert is_default(retry_delay(row, 5, f"{HERE}.with_failing_backoff"), 5)
    assert "RuntimeError: the backoff itself is broken" in caplog.text


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"fixed": 30.0}, 30.0),
        ({"fixed": 1e300}, MAX_SECONDS),
        ({"fixed": 10**400}, MAX_SECONDS),
        ({"fixed": -3}, 0.0),
        ({"fixed": "soon"}, None),
        ({"fixed": None}, None),
        ({"fixed": [1]}, None),
        ({"exponential": {"base": 1, "factor": 2, "max": 8, "jitter": 0}}, 4.0),
        ({"exponential": {"base": 1e300}}, None),
        ({"exponential": {"base": 1, "shell": "rm -rf /"}}, None),
        ({"exponential": "fast"}, None),
        ({"exponential": {"factor": 10**400, "jitter": 0}}, 3600.0),
        ({"fixed": 1, "path": "os.system"}, None),
        ({"schedule": 5}, None),
        (["fixed", 5], None),
        ("fixed", None),
        (None, None),
        ({}, None),
    ],
    ids=short,
)
def test_a_rows_fixed_and_exponential_forms_are_read_defensively(row, expected):
    delay = retry_delay(row, 3, f"{HERE}.with_fixed_backoff")
    assert delay == expected if expected is not None else is_default(delay, 3)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_like = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
exponential_fields = st.dictionaries(
    st.sampled_from(["base", "factor", "max", "jitter", "other"]), json_scalars, max_size=5
)
backoff_rows = st.one_of(
    st.none(),
    json_like,
    st.dictionaries(st.sampled_from(["fixed", "exponential", "path", "x"]), json_like, max_size=2),
    st.builds(lambda value: {"fixed": value}, json_scalars),
    st.builds(lambda fields: {"exponential": fields}, exponential_fields),
    st.builds(
        lambda path: {"path": path},
        st.sampled_from(
            [
                f"{HERE}.recording_backoff",
                f"{HERE}.declared_backoff",
                f"{HERE}.failing_backoff",
                "os._exit",
                "builtins.print",
            ]
        )
        | st.text(max_size=30),
    ),
)
task_paths = st.sampled_from(
    [
        None,
        f"{HERE}.with_declared_backoff",
        f"{HERE}.with_failing_backoff",
        f"{HERE}.with_fixed_backoff",
        "tests.gone.task",
        "os._exit",
        "",
    ]
)


@given(row=backoff_rows, attempt=st.integers(min_value=-10, max_value=10**9), path=task_paths)
@PROPERTY
def test_retry_delay_never_raises_and_is_always_a_bounded_delay(row, attempt, path):
    delay = retry_delay(row, attempt, path)
    assert isinstance(delay, float)
    assert math.isfinite(delay) and 0.0 <= delay <= MAX_SECONDS
    assert "recording_backoff" not in {name for name, _ in calls}


# --- a row's backoff through a real failure, on the test database --------------------


@pytest.fixture
def worker(transactional_db):
    return register_process("default", "worker")


def fail_once(worker, job_id: int) -> Job:
    (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
    assert job.pk == job_id and start_job("default", job, worker.pk, worker.name)
    fail_job(
        "default", job_id, worker.pk, ErrorInfo("builtins.ValueError", "x", "x"), worker_id="w"
    )
    return Job.objects.get(pk=job_id)


@pytest.mark.parametrize(
    "row",
    [
        {"path": f"{HERE}.recording_backoff"},
        {"fixed": 1e300},
        {"exponential": {"base": 1e300, "max": 1e300}},
    ],
    ids=["foreign-path", "huge-fixed", "bad-exponential"],
)
def test_a_failure_with_a_hostile_backoff_row_is_retried_within_bounds(worker, row):
    job_id = int(with_declared_backoff.enqueue("v").id)
    Job.objects.filter(pk=job_id).update(backoff=row)
    before = timezone.now()
    job = fail_once(worker, job_id)
    assert job.status == JobStatus.SCHEDULED
    scheduled_at = ScheduledExecution.objects.get(job_id=job_id).scheduled_at
    assert before <= scheduled_at <= timezone.now() + CENTURY
    assert calls == []


def test_a_failure_retries_after_the_delay_its_task_declares(worker):
    """The row names the task's own function: that function object gives the delay."""
    job_id = int(with_declared_backoff.enqueue("v").id)
    assert Job.objects.get(pk=job_id).backoff == {"path": f"{HERE}.declared_backoff"}
    before = timezone.now()
    job = fail_once(worker, job_id)
    assert job.status == JobStatus.SCHEDULED
    scheduled_at = ScheduledExecution.objects.get(job_id=job_id).scheduled_at
    delay = timedelta(seconds=7)
    assert before + delay <= scheduled_at <= timezone.now() + delay
    assert calls == [("declared_backoff", 1)]


# --- Snooze ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "message"),
    [
        (math.nan, "finite"),
        (math.inf, "finite"),
        (1e12, "at most"),
        (10**400, "at most"),
        (-1, ">= 0"),
        ("5", "number of seconds"),
    ],
    ids=short,
)
def test_snooze_refuses_what_no_datetime_can_hold(seconds, message):
    with pytest.raises(ValueError, match=f"Snooze seconds must be .*{message}"):
        Snooze(seconds)


def test_snooze_keeps_a_delay_within_a_century():
    assert Snooze(MAX_SECONDS).seconds == MAX_SECONDS
    assert Snooze(timedelta(minutes=2)).seconds == 120.0
    assert Snooze().seconds == 0.0


# --- rates ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    ["1/99999999999999d", "1/36601d", f"1/{'9' * 400}s", f"{'9' * 5000}/s", "10001/s"],
    ids=lambda spec: spec[:20],
)
def test_a_rate_past_a_century_or_too_many_starts_is_refused_where_declared(spec):
    with pytest.raises(ValueError, match=r"the (period|count) must be"):
        parse_rate(spec)
    with pytest.raises(InvalidTask, match="rate_limit"):
        jobs_task(echo, rate_limit=spec)


def test_a_century_is_the_longest_rate():
    assert parse_rate("1/36600d") == Rate(1, MAX_SECONDS)
    assert parse_rate("0010/m") == Rate(10, 60.0)


GARBAGE_TIMES = ["soon", None, 1e308, 10**400, [1], {"t": 1}, True]


@pytest.mark.parametrize(
    "rate",
    [
        Rate(1, math.inf),
        Rate(1, math.nan),
        Rate(1, 1e300),
        Rate(1, -5.0),
        Rate(10**400, 60.0),
        Rate(0, 60.0),
        Rate(None, None),  # type: ignore[arg-type]
        Rate(2, 60.0),
    ],
    ids=short,
)
def test_a_window_from_a_hostile_row_gives_times_a_datetime_can_hold(rate):
    now = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    window = Window(RateLimit(key="k", starts=[*GARBAGE_TIMES, now - 1], planned=GARBAGE_TIMES))
    for _ in range(5):
        decision = window.decide(now, rate)
        assert math.isfinite(decision.at) and now <= decision.at <= now + MAX_SECONDS
        datetime.fromtimestamp(decision.at, tz=UTC)
    window.write_back()
    assert all(now - 1 <= t <= now + MAX_SECONDS for t in window.row.starts + window.row.planned)


def test_a_start_through_a_hostile_rate_row_on_the_database(worker):
    """The job's stored rate and its key's row edited to what no declaration allows:
    the start transaction still admits one, plans the next within a century, and
    rewrites the row with usable values."""
    ids = [int(rate_tasks.once_a_minute.enqueue(i).id) for i in range(2)]
    Job.objects.filter(pk__in=ids).update(rate_period=1e300)
    RateLimit.objects.create(
        key="tests.rate_tasks.once_a_minute", starts=["soon", 1e308], planned=[{"x": 1}]
    )
    jobs = claim_jobs("default", worker.pk, QueueSelector(("*",)), 10)
    started = start_jobs("default", jobs, worker.pk, worker.name)
    assert [job.pk for job in started] == ids[:1]
    waiting = Job.objects.get(pk=ids[1])
    assert waiting.status == JobStatus.SCHEDULED
    assert waiting.rate_reserved_at <= timezone.now() + CENTURY
    row = RateLimit.objects.get(key="tests.rate_tasks.once_a_minute")
    assert row.period == MAX_SECONDS and len(row.starts) == 1


async def async_generator():
    yield 1


def generator():
    yield 1


@pytest.mark.parametrize(
    ("func", "said"),
    [
        (async_generator, "async_generator is an async generator function"),
        (generator, "generator is a generator function"),
    ],
)
def test_a_function_that_yields_is_refused_at_declaration(func, said):
    """Its jobs could never store a result: each would fail in a worker. Before: declared,
    and every job failed there (an unstorable async_generator, or the lane's own check)."""
    with pytest.raises(InvalidTask, match=said + r": a task returns its result"):
        jobs_task(func)
    # Django's own decorator with our backend builds the task with our task_class: the same.
    with pytest.raises(InvalidTask, match=said):
        django_task(backend="default")(func)
