"""Fault isolation, in this process, on the test database: the net under the completer,
and what the enqueue refuses so that no worker ever meets it.

The real-process side (workers that survive generated hostile jobs) is in
``tests/test_fault_isolation.py``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DataError, connection
from django.tasks.exceptions import InvalidTask
from django.test import override_settings
from django.utils import timezone

from django_jobs import bulk_enqueue
from django_jobs import task as jobs_task
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.exceptions import InvalidTaskArguments
from django_jobs.models import FailedExecution, Job, JobStatus
from django_jobs.runtime.completer import write_isolated
from django_jobs.runtime.context import ExecutionContext, Success
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.tasks.results import build_result
from django_jobs.text import EscapeControlCharacters, clip, printable, storable_text
from tests import hostile_tasks as hostile
from tests import tasks

pytestmark = pytest.mark.django_db(transaction=True)

keyed = jobs_task(tasks.add.func, concurrency_key="{a}")


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def refused_by_the_database() -> object:
    """A value the database itself refuses in a finish (no check of ours in the way)."""
    if connection.vendor == "postgresql":
        return "a\x00b"  # jsonb has no room for \u0000
    if connection.vendor == "mysql":
        return nested(40)  # JSON_VALID refuses 32 levels and more
    pytest.skip("SQLite stores what the other two refuse; the Python-side case covers it")


@pytest.fixture
def claimed():
    """``n`` jobs claimed (and started) by a registered worker, with its context."""
    worker = register_process("default", "worker")
    ctx = ExecutionContext("default", worker.pk, worker.name, Lifecycle(), 1.0)

    def claim(n: int) -> list[Job]:
        for _ in range(n):
            hostile.canary.enqueue()
        jobs = claim_jobs("default", worker.pk, QueueSelector(("*",)), n, worker_id=worker.name)
        assert len(jobs) == n
        return sorted(jobs, key=lambda job: job.pk)

    claim.ctx = ctx
    return claim


def successes(jobs: list[Job], values: list[object]) -> list[Success]:
    return [
        Success(job, hostile.canary, build_result(job), value, 0.0)
        for job, value in zip(jobs, values, strict=True)
    ]


@pytest.mark.parametrize(
    "bad",
    [refused_by_the_database, lambda: nested(3000)],
    ids=["refused-by-the-database", "refused-in-python"],
)
def test_a_finish_batch_refused_for_one_job_fails_only_that_job(claimed, bad):
    """The net under the own-thread check: the batch is split until only the refused job
    is left; the others are recorded as they returned, the thread goes on."""
    jobs = claimed(5)
    values: list[object] = [1, "two", bad(), {"four": 4}, None]
    write_isolated(claimed.ctx, successes(jobs, values))
    rows = {job.pk: job for job in Job.objects.filter(pk__in=[job.pk for job in jobs])}
    refused = jobs[2].pk
    for job, value in zip(jobs, values, strict=True):
        if job.pk != refused:
            assert (rows[job.pk].status, rows[job.pk].return_value) == (JobStatus.SUCCEEDED, value)
    assert rows[refused].status == JobStatus.FAILED
    failure = FailedExecution.objects.get(job_id=refused)
    assert failure.exception_class_path == "django_jobs.exceptions.ResultNotStored"
    assert failure.message.startswith("the database refused to record this job's success")
    assert claimed.ctx.lifecycle.broken is None


# --- what the enqueue refuses -----------------------------------------------------------


@override_settings(DJANGO_JOBS={"max_arguments_size": 1000})
def test_arguments_over_max_arguments_size_are_refused_naming_the_argument():
    with pytest.raises(InvalidTaskArguments) as info:
        tasks.echo.enqueue("x" * 2000)
    assert str(info.value) == (
        "Task positional argument 0 takes 2,002 bytes of JSON, over the limit of 1,000 bytes "
        "(DJANGO_JOBS['max_arguments_size'])"
    )
    assert not Job.objects.exists()


@override_settings(DJANGO_JOBS={"max_arguments_size": 1000})
def test_arguments_over_the_limit_only_together_are_refused_as_a_whole():
    with pytest.raises(InvalidTaskArguments, match="Task arguments take more than 1,000 bytes"):
        tasks.add.enqueue("x" * 600, "y" * 600)
    assert not Job.objects.exists()


def test_arguments_nested_5000_deep_are_invalid_arguments_not_a_recursion_error():
    with pytest.raises(InvalidTaskArguments, match="positional argument 0 is nested more than"):
        tasks.echo.enqueue(nested(5000))
    assert not Job.objects.exists()


def test_the_nesting_allowed_is_what_the_database_stores():
    """MariaDB's JSON_VALID refuses 32 levels: an argument may nest 30 inside the args
    list there; 100 elsewhere. The deepest allowed is stored, one more is refused."""
    deepest = 30 if connection.vendor == "mysql" else 99
    result = tasks.echo.enqueue(nested(deepest))
    assert Job.objects.get(pk=result.id).args == [nested(deepest)]
    with pytest.raises(InvalidTaskArguments, match="nested"):
        tasks.echo.enqueue(nested(deepest + 1))


def test_a_nul_in_an_argument_is_refused_where_the_database_cannot_store_it():
    if connection.vendor == "postgresql":
        with pytest.raises(InvalidTaskArguments, match=r"NUL character .* PostgreSQL"):
            tasks.echo.enqueue("a\x00b")
        assert not Job.objects.exists()
    else:
        result = tasks.echo.enqueue("a\x00b")
        assert Job.objects.get(pk=result.id).args == ["a\x00b"]


def test_a_key_longer_than_its_column_is_refused_at_enqueue():
    with pytest.raises(InvalidTask, match=r"concurrency key .* is longer than 255 characters"):
        keyed.enqueue("k" * 300, 1)
    with pytest.raises(InvalidTask, match="is longer than 255 characters"):
        bulk_enqueue([(keyed, ["k" * 300, 1], {}), (keyed, ["k", 1], {})])
    assert not Job.objects.exists()


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_the_bulk_insert_refuses_a_queue_name_longer_than_its_column():
    """It cast every string column to ``varchar(n)[]``, and an explicit cast to varchar(n)
    cuts a longer value short without a word; the single insert raised."""
    from django_jobs.db.postgresql.insert import insert_ready_jobs

    now = timezone.now()
    jobs = [
        Job(task_path="tests.tasks.add", queue_name=name, args=[1, 2], enqueued_at=now)
        for name in ("q" * 200, "default")
    ]
    with pytest.raises(DataError, match="too long"):
        insert_ready_jobs("default", jobs)
    assert not Job.objects.exists()


# --- text ----------------------------------------------------------------------------------


def test_printable_escapes_every_control_character_and_keeps_the_rest():
    assert printable("a\nb\r\tc\x1b[31md\x00\x7f\x85\u2028é") == (
        "a\\nb\\r\\tc\\x1b[31md\\x00\\x7f\\x85\\u2028é"
    )
    assert printable("line\n\tindented\x1b", keep_lines=True) == "line\n\tindented\\x1b"


def test_storable_text_has_no_nul_and_says_what_it_cut():
    assert storable_text("a\x00b", 100) == "a\\x00b"
    cut = storable_text("z" * 1000, 100)
    assert len(cut) == 100 and cut.endswith("... [929 more characters cut]")
    assert clip("short", 100) == "short"


def test_the_log_filter_escapes_a_lines_values_and_its_exception():
    import logging

    try:
        raise ValueError("boom\nFORGED line \x1b[2J")
    except ValueError as exc:
        record = logging.LogRecord(
            "django_jobs.worker", logging.ERROR, __file__, 1, "job failed: %s (%d)", (exc, 3), None
        )
        record.exc_info = (type(exc), exc, exc.__traceback__)
    EscapeControlCharacters().filter(record)
    assert record.getMessage() == "job failed: boom\\nFORGED line \\x1b[2J (3)"
    assert "\x1b" not in record.exc_text and "\\x1b[2J" in record.exc_text


# --- the admin reads rows as data --------------------------------------------------------


def test_the_rate_limited_page_reads_a_hand_edited_row_without_raising(admin_client):
    """A period of 1e300 overflowed ``timedelta`` and ``fromtimestamp``; starts that are
    no numbers raised ``TypeError``. The page shows what it can, bounded."""
    from django.urls import reverse

    from django_jobs.admin.rate_limited import key_state
    from django_jobs.limits import MAX_SECONDS
    from django_jobs.models import RateLimit

    now = timezone.now()
    RateLimit.objects.create(
        key="hand-edited",
        limit=1,
        period=1e300,
        starts=["soon", None, [1], now.timestamp() - 5, 1e308],
        planned=[{"x": 1}, 1e308],
    )
    state = key_state(RateLimit.objects.get(key="hand-edited"), now)
    assert (state["in_window"], state["full"]) == (1, True)
    assert state["rate"] == f"1 per {timedelta(seconds=MAX_SECONDS)}"
    assert state["next_opening"].year > now.year
    response = admin_client.get(reverse("admin:django_jobs_ratelimitedkey_changelist"))
    assert response.status_code == 200
