"""No job can stop the runtime (docs/design.md, invariant 10).

Whatever one job brings (its return value, its exception, its progress, its
options, its row), that job ends in a defined state with an error naming the
cause, a job enqueued after it succeeds, and no thread of the worker dies. Each
test runs real ``run_jobs`` processes on the test database (PostgreSQL, MariaDB
or SQLite, as DATABASE_URL says); the property tests generate the bad data with
Hypothesis.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from django_jobs.models import (
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
    ReadyExecution,
    ScheduledExecution,
)
from django_jobs.tasks.serialization import json_return_value
from tests import hostile_tasks as hostile
from tests.harness import wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

WORKER = ("--processes", "1", "--threads", "2")
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED}
# What a worker's output shows when a thread of it died or it gave up on itself.
DEAD_THREAD_SIGNS = ("Exception in thread", "cannot go on", "the completer stopped")

# A handful of examples per run, each a few jobs through one live worker (the suite's
# Hypothesis profile, tests/conftest.py, sets the rest).
PROPERTY = settings(max_examples=8)


@pytest.fixture
def run_jobs_once(run_jobs):
    """One worker for every example of a property test: started at the first call."""
    started: list = []

    def start():
        if not started:
            started.append(run_jobs(*WORKER))
        return started[0]

    return start


def encode(value: Any) -> str:
    """A value as the JSON text a hostile task decodes (NaN and infinities included)."""
    return json.dumps(value)


def nest(depth: int) -> dict[str, int]:
    return {"$nest": depth}


def settled(ids: list[int], timeout: float = 30.0) -> dict[int, Job]:
    """Wait until every job of ``ids`` has ended; return their rows."""

    def ended() -> dict[int, Job] | None:
        jobs = {job.pk: job for job in Job.objects.filter(pk__in=ids)}
        return jobs if all(job.status in TERMINAL for job in jobs.values()) else None

    return wait_until(ended, timeout, what=f"jobs {ids} to end")


def same_json(stored: Any, returned: Any) -> bool:
    """Equal as JSON numbers are equal: PostgreSQL's ``jsonb`` keeps a number as a decimal
    (``1.4e17`` reads back as the int ``143703662246291540``) and MariaDB's a double."""
    if isinstance(stored, dict) and isinstance(returned, dict):
        return stored.keys() == returned.keys() and all(
            same_json(stored[key], returned[key]) for key in stored
        )
    if isinstance(stored, list) and isinstance(returned, list):
        return len(stored) == len(returned) and all(
            same_json(a, b) for a, b in zip(stored, returned, strict=True)
        )
    numbers = (int, float)
    if (
        isinstance(stored, numbers)
        and isinstance(returned, numbers)
        and not isinstance(stored, bool)
        and not isinstance(returned, bool)
    ):
        return math.isclose(stored, returned, rel_tol=1e-15, abs_tol=0.0)
    return stored == returned


def last_failure(job_id: int) -> FailedExecution:
    return FailedExecution.objects.filter(job_id=job_id).latest("attempt")


def assert_runtime_healthy(worker) -> None:
    """A job enqueued now succeeds, the process is alive, and no thread of it died."""
    canary = hostile.canary.enqueue()
    job = settled([int(canary.id)])[int(canary.id)]
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, "alive")
    assert worker.proc.poll() is None, worker.output()
    output = worker.output()
    for sign in DEAD_THREAD_SIGNS:
        assert sign not in output, output


# --- the strategies ----------------------------------------------------------------------

# Any text, NUL, control characters and lone surrogates included.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
json_like = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4)
    ),
    max_leaves=12,
)
hostile_values = json_like | st.integers(min_value=1, max_value=5000).map(nest)
# What a row can hold on every database (a test writes it there): no NUL, no lone
# surrogate, no NaN; anything else goes.
row_text = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)))
row_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | row_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(row_text, children, max_size=4)
    ),
    max_leaves=12,
)


# --- a thread that cannot go on ----------------------------------------------------------


def test_a_worker_whose_completer_dies_exits_and_is_replaced(run_jobs):
    """Never a process that heartbeats while doing no work: the broken worker process exits
    non-zero, its supervisor replaces it, recovery settles its claim."""
    worker = run_jobs(*WORKER)
    sabotage = hostile.breaks_the_completer.enqueue()
    job = settled([int(sabotage.id)])[int(sabotage.id)]
    assert job.status == JobStatus.FAILED
    assert last_failure(job.pk).exception_class_path == "django_jobs.exceptions.ProcessDied"
    # The broken process settles its own claim as it stops; its supervisor sees it exit
    # just after that.
    worker.wait_for_output("exited unexpectedly (code 1); replacing it")
    assert "cannot go on (the completer thread stopped)" in worker.output()
    canary = hostile.canary.enqueue()
    job = settled([int(canary.id)])[int(canary.id)]
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, "alive")
    assert worker.proc.poll() is None


# --- return values -----------------------------------------------------------------------


def test_a_nul_in_a_return_value_ends_that_job_and_the_worker_goes_on(run_jobs):
    """The finding: on PostgreSQL the completer thread died on the NUL, and the worker
    never recorded another job while it went on heartbeating."""
    worker = run_jobs(*WORKER)
    bad = hostile.returns.enqueue(encode("before\x00after"))
    job = settled([int(bad.id)])[int(bad.id)]
    if connection.vendor == "postgresql":
        assert job.status == JobStatus.FAILED
        failure = last_failure(job.pk)
        assert failure.exception_class_path == "django_jobs.exceptions.ResultNotStored"
        assert "NUL character" in failure.message and "PostgreSQL" in failure.message
    else:  # MariaDB and SQLite store it
        assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, "before\x00after")
    assert_runtime_healthy(worker)


@pytest.mark.parametrize(
    ("value", "cause"),
    [
        (nest(5000), "nested more than 100 levels"),
        ({"$chars": 1024 * 1024}, "over the limit of 1,048,576 bytes"),
        ({"$chars": 30 * 1024 * 1024}, "takes 31,457,282 bytes of JSON"),
        ("\ud800", "lone surrogate"),
    ],
    ids=["nested-5000", "over-max_result_size", "30-MB", "lone-surrogate"],
)
def test_a_return_value_no_database_stores_fails_its_job_naming_the_cause(run_jobs, value, cause):
    worker = run_jobs(*WORKER)
    bad = hostile.returns.enqueue(encode(value))
    job = settled([int(bad.id)])[int(bad.id)]
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
    failure = last_failure(job.pk)
    assert failure.exception_class_path == "django_jobs.exceptions.ResultNotStored"
    assert cause in failure.message
    assert_runtime_healthy(worker)


@PROPERTY
@given(values=st.lists(hostile_values, min_size=1, max_size=5))
def test_any_return_value_ends_its_job_in_a_defined_state(run_jobs_once, values):
    """Stored as returned, or failed with ``ResultNotStored`` for a cause that is real."""
    worker = run_jobs_once()
    results = [hostile.returns.enqueue(encode(value)) for value in values]
    jobs = settled([int(result.id) for result in results])
    for value, result in zip(values, results, strict=True):
        assert_return_value_recorded(jobs[int(result.id)], value)
    assert_runtime_healthy(worker)


def assert_return_value_recorded(job: Job, value: object) -> None:
    """``job`` returned ``value`` (as ``hostile.returns`` decodes it): stored as returned
    where it can be, else failed with ``ResultNotStored`` for a cause that is real (also
    tests/test_async_runtime.py's, for async bodies)."""
    try:
        expected = json_return_value(hostile.decoded(encode(value)), "default")
    except Exception:
        storable, expected = False, None
    else:
        storable = True
    if job.status == JobStatus.SUCCEEDED:
        assert storable, (value, job.return_value)
        assert same_json(job.return_value, expected), (job.return_value, expected)
    else:
        failure = last_failure(job.pk)
        assert failure.exception_class_path == "django_jobs.exceptions.ResultNotStored"
        assert failure.message.startswith(("the return value", "the database refused"))


# --- exceptions ----------------------------------------------------------------------------


def test_a_nul_in_an_exception_message_is_recorded_escaped(run_jobs):
    worker = run_jobs(*WORKER)
    bad = hostile.raises.using(backoff=0).enqueue(encode("bad\x00message"))
    job = settled([int(bad.id)])[int(bad.id)]
    assert (job.status, job.attempts) == (JobStatus.FAILED, 3)
    failure = last_failure(job.pk)
    assert failure.exception_class_path == "builtins.ValueError"
    assert failure.message == "bad\\x00message"
    assert "\x00" not in failure.traceback
    assert_runtime_healthy(worker)


def test_an_exception_whose_str_raises_is_recorded(run_jobs):
    worker = run_jobs(*WORKER)
    bad = hostile.raises_unprintable.enqueue()
    job = settled([int(bad.id)])[int(bad.id)]
    assert job.status == JobStatus.FAILED
    failure = last_failure(job.pk)
    assert failure.exception_class_path == "tests.hostile_tasks.Unprintable"
    assert failure.message == "<Unprintable whose str() raised RuntimeError>"
    assert_runtime_healthy(worker)


def test_a_huge_exception_is_cut_to_the_configured_sizes(run_jobs):
    worker = run_jobs(*WORKER, env={"JOBS_MAX_ERROR_SIZE": "5000"})
    # 30 MB of message: built in the task (an argument may take 1 MiB).
    bad = hostile.raises.using(max_attempts=1).enqueue(encode({"$chars": 30 * 1024 * 1024}))
    job = settled([int(bad.id)])[int(bad.id)]
    failure = last_failure(job.pk)
    assert len(failure.message) == 2000 and failure.message.endswith("more characters cut]")
    assert len(failure.traceback) == 5000 and "more characters cut]" in failure.traceback
    assert_runtime_healthy(worker)


def test_a_newline_in_an_error_forges_no_log_line(run_jobs):
    worker = run_jobs(*WORKER)
    forged = "boom\n2026-01-01 00:00:00 [1] INFO django_jobs.worker: FORGED \x1b[31mred"
    bad = hostile.raises.using(max_attempts=1).enqueue(encode(forged))
    settled([int(bad.id)])
    wait_until(lambda: "FORGED" in worker.output(), what="the failure's log line")
    lines = worker.output().splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines)
    assert "\x1b" not in worker.output()
    assert any("boom\\n2026-01-01" in line and "\\x1b[31m" in line for line in lines)
    assert_runtime_healthy(worker)


@PROPERTY
@given(values=st.lists(hostile_values, min_size=1, max_size=4))
def test_any_exception_message_is_recorded_and_the_job_ends(run_jobs_once, values):
    worker = run_jobs_once()
    results = [hostile.raises.using(max_attempts=1).enqueue(encode(v)) for v in values]
    jobs = settled([int(result.id) for result in results])
    for job in jobs.values():
        assert job.status == JobStatus.FAILED
        failure = last_failure(job.pk)
        assert failure.exception_class_path == "builtins.ValueError"
        assert "\x00" not in failure.message and len(failure.message) <= 2000
    assert_runtime_healthy(worker)


# --- progress, snoozes --------------------------------------------------------------------


@PROPERTY
@given(values=st.lists(hostile_values, min_size=1, max_size=4))
def test_any_progress_message_ends_its_job_in_a_defined_state(run_jobs_once, values):
    """A string is written (no NUL, cut to 255); anything else fails the job's attempt with
    set_progress's own TypeError."""
    worker = run_jobs_once()
    results = [hostile.reports_progress.enqueue(encode(v)) for v in values]
    jobs = settled([int(result.id) for result in results])
    for value, result in zip(values, results, strict=True):
        job = jobs[int(result.id)]
        message = hostile.decoded(encode(value))
        if isinstance(message, str):
            assert job.status == JobStatus.SUCCEEDED
            assert job.progress_message == message.replace("\x00", "\\x00")[:255]
        else:
            assert job.status == JobStatus.FAILED
            assert "message must be a str" in last_failure(job.pk).message
    assert_runtime_healthy(worker)


@pytest.mark.parametrize(
    ("done", "stored"),
    [(1e300, 1e300), (math.nan, None), (math.inf, None), (10**400, None), ({"$nest": 5000}, None)],
    ids=["1e300", "nan", "inf", "10**400", "nested-5000"],
)
def test_a_progress_count_is_stored_or_refused_in_the_job(run_jobs, done, stored):
    """A count no column holds ends that job's attempt with set_progress's own error."""
    worker = run_jobs(*WORKER)
    result = hostile.reports_done.enqueue(encode(done))
    job = settled([int(result.id)])[int(result.id)]
    if stored is None:
        assert job.status == JobStatus.FAILED
        assert last_failure(job.pk).message.startswith("set_progress(): done must be")
    else:
        assert (job.status, job.progress_done) == (JobStatus.SUCCEEDED, stored)
    assert_runtime_healthy(worker)


@pytest.mark.parametrize(
    "seconds", [math.nan, math.inf, -1, 1e12, 10**30, "soon", None, [1]], ids=repr
)
def test_a_snooze_of_no_usable_delay_fails_the_attempt_clearly(run_jobs, seconds):
    worker = run_jobs(*WORKER)
    bad = hostile.snoozes.enqueue(encode(seconds))
    job = settled([int(bad.id)])[int(bad.id)]
    assert (job.status, job.attempts) == (JobStatus.FAILED, 2)
    failure = last_failure(job.pk)
    assert failure.exception_class_path == "builtins.ValueError"
    assert failure.message.startswith("Snooze "), failure.message
    assert_runtime_healthy(worker)


# --- rows: what a row says is data, never code, and never overflows ------------------------


def test_a_backoff_path_in_a_row_is_not_called(run_jobs, tmp_path):
    """The finding: ``{"path": "os._exit"}`` made the worker call ``os._exit(attempt)``."""
    result = hostile.fails.enqueue()
    Job.objects.filter(pk=result.id).update(backoff={"path": "os._exit"})
    worker = run_jobs(*WORKER)
    wait_until(
        lambda: ScheduledExecution.objects.filter(job_id=result.id).exists(),
        what="the failed attempt's retry",
    )
    retry_at = ScheduledExecution.objects.get(job_id=result.id).scheduled_at
    assert retry_at <= timezone.now() + timedelta(seconds=3), "not the default backoff's delay"
    assert_runtime_healthy(worker)


def test_a_job_past_attempt_1025_retries_after_a_bounded_delay(run_jobs):
    """The finding: the default backoff overflowed a float, then a datetime."""
    result = hostile.fails.enqueue()
    Job.objects.filter(pk=result.id).update(attempts=1500, max_attempts=2000)
    worker = run_jobs(*WORKER)
    wait_until(
        lambda: ScheduledExecution.objects.filter(job_id=result.id).exists(),
        what="the failed attempt's retry",
    )
    retry_at = ScheduledExecution.objects.get(job_id=result.id).scheduled_at
    assert retry_at <= timezone.now() + timedelta(hours=1, minutes=16)  # max 3600 s + jitter
    assert_runtime_healthy(worker)


def test_run_jobs_starts_when_recovery_meets_a_row_that_would_overflow(run_jobs):
    """The finding: start-up recovery raised ``OverflowError`` in ``fail_claimed``, so
    ``run_jobs`` could not start on that database at all."""
    result = hostile.fails.enqueue()
    dead = Process.objects.create(
        kind=Process.Kind.WORKER,
        name="worker-gone",
        hostname="elsewhere",
        pid=1,
        last_heartbeat_at=timezone.now() - timedelta(days=1),
    )
    Job.objects.filter(pk=result.id).update(
        status=JobStatus.RUNNING,
        attempts=1500,
        max_attempts=2000,
        backoff={"exponential": {"base": 1e300, "factor": 1e300, "max": 1e300, "jitter": 0}},
    )
    job = Job.objects.get(pk=result.id)
    ReadyExecution.objects.filter(job_id=result.id).delete()
    ClaimedExecution.objects.create(
        job_id=result.id, process=dead, queue_name=job.queue_name, created_at=timezone.now()
    )
    worker = run_jobs(*WORKER)
    wait_until(
        lambda: Job.objects.get(pk=result.id).status != JobStatus.RUNNING,
        what="the dead process's claim to be recovered",
    )
    failure = last_failure(result.id)
    assert failure.exception_class_path == "django_jobs.exceptions.ProcessDied"
    assert not ClaimedExecution.objects.filter(process=dead).exists()
    assert_runtime_healthy(worker)


def test_an_infinite_lease_in_a_row_does_not_stop_the_claim(run_jobs):
    """The finding: ``concurrency_duration=inf`` made every claim raise (the job blocked
    its queue for every worker). MariaDB's DOUBLE cannot hold one: a huge one there."""
    duration = 1e300 if connection.vendor == "mysql" else math.inf
    result = hostile.keyed.enqueue("a")
    Job.objects.filter(pk=result.id).update(concurrency_duration=duration)
    worker = run_jobs(*WORKER)
    job = settled([int(result.id)])[int(result.id)]
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, "a")
    assert_runtime_healthy(worker)


@PROPERTY
@given(backoff=st.dictionaries(st.sampled_from(["fixed", "exponential", "path", "x"]), row_json))
def test_any_backoff_in_a_row_ends_in_a_defined_state(run_jobs_once, backoff):
    worker = run_jobs_once()
    result = hostile.fails.using(max_attempts=2).enqueue()
    Job.objects.filter(pk=result.id).update(backoff=backoff)
    wait_until(
        lambda: (
            Job.objects.get(pk=result.id).status in {JobStatus.SCHEDULED, JobStatus.FAILED}
            and FailedExecution.objects.filter(job_id=result.id).exists()
        ),
        what="the failed attempt to be recorded",
    )
    scheduled = ScheduledExecution.objects.filter(job_id=result.id).first()
    if scheduled is not None:
        assert scheduled.scheduled_at <= timezone.now() + timedelta(days=100 * 366)
    assert_runtime_healthy(worker)


# --- rows Python cannot read back -----------------------------------------------------------

# JSON a database stores that Python's json refuses (db/json_values.py): an integer past
# sys.int_max_str_digits (4,300) everywhere, arrays nested past Python's recursion limit on
# PostgreSQL (SQLite's JSON_VALID check refuses nesting past 1,000, MariaDB's past 32). Text
# that is not JSON at all, every database's check refuses.
UNREADABLE = {
    "huge_int": "[" + "9" * 5000 + "]",
    "deep": "[" * 5000 + "]" * 5000,
}


def write_json_text(job_id: int, column: str, text: str) -> None:
    """Write ``text`` as it is into ``column`` of a job's row, as a script or a hand would."""
    table = Job._meta.db_table
    value = "CAST(%s AS jsonb)" if connection.vendor == "postgresql" else "%s"
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {column} = {value} WHERE id = %s", [text, job_id])


def writable(kind: str) -> bool:
    return kind != "deep" or connection.vendor == "postgresql"


@pytest.mark.parametrize("column", ["args", "kwargs"])
@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_arguments_python_cannot_read_fail_their_job_and_the_queue_goes_on(run_jobs, column, kind):
    """The finding: one job whose arguments held a 5,000-digit integer stopped its queue.
    Every claim that read its row raised (SQLite, MariaDB: rolled back; PostgreSQL: after
    the claim committed), the worker backed off and claimed it again, forever: in 25 s not
    one job ran, not even the one enqueued before it. Now the row reads, the job fails for
    good naming the column, and the jobs around it run."""
    if not writable(kind):
        pytest.skip(f"{connection.vendor} refuses this JSON itself")
    before = hostile.canary.enqueue()
    poisoned = hostile.canary.enqueue()
    after = hostile.canary.enqueue()
    text = UNREADABLE[kind]
    if column == "kwargs":
        text = '{"x": ' + text + "}"
    write_json_text(int(poisoned.id), column, text)
    worker = run_jobs(*WORKER)
    ids = [int(before.id), int(poisoned.id), int(after.id)]

    def all_ended() -> dict[int, tuple[str, int]] | None:
        # Read without the JSON columns: the test's own reads must not be what fails.
        rows = Job.objects.filter(pk__in=ids).values_list("pk", "status", "attempts")
        found = {pk: (status, attempts) for pk, status, attempts in rows}
        return found if all(status in TERMINAL for status, _ in found.values()) else None

    ended = wait_until(all_ended, 30, what="the three jobs to end")
    assert ended[int(before.id)][0] == JobStatus.SUCCEEDED
    assert ended[int(after.id)][0] == JobStatus.SUCCEEDED
    assert ended[int(poisoned.id)][0] == JobStatus.FAILED
    failure = last_failure(int(poisoned.id))
    assert failure.exception_class_path == "django_jobs.exceptions.UnreadableJob"
    assert f"its {column} cannot be read" in failure.message, failure.message
    # Failed for good, its body never run: no attempt counted, no retry waiting.
    assert ended[int(poisoned.id)][1] == 0
    assert FailedExecution.objects.filter(job_id=poisoned.id).count() == 1
    assert not ScheduledExecution.objects.filter(job_id=poisoned.id).exists()
    assert_runtime_healthy(worker)


@pytest.mark.parametrize("column", ["worker_ids", "trace_context", "backoff"])
def test_other_columns_python_cannot_read_cost_their_job_nothing(run_jobs, column):
    """A job's own bookkeeping (its workers, its trace, its backoff) unreadable in its row:
    the job still runs as if the column were empty (a backoff of no known form takes the
    default, as any other does)."""
    result = hostile.canary.enqueue()
    write_json_text(int(result.id), column, UNREADABLE["huge_int"])
    worker = run_jobs(*WORKER)
    job = settled([int(result.id)])[int(result.id)]
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, "alive")
    assert_runtime_healthy(worker)


def test_a_job_whose_arguments_cannot_be_read_has_a_page_in_the_admin(admin_client):
    """The admin shows such a job's stored text and why it cannot be read, not a 500."""
    result = hostile.canary.enqueue()
    write_json_text(int(result.id), "args", UNREADABLE["huge_int"])
    job = Job.objects.get(pk=result.id)
    assert str(job.args.reason).startswith("Exceeds the limit (4300 digits)"), job.args
    response = admin_client.get(f"/admin/django_jobs/job/{result.id}/change/")
    assert response.status_code == 200
    assert b"cannot be read: Exceeds the limit" in response.content
