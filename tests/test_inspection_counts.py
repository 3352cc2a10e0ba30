"""inspection.count_queues, the one place queues are counted (manage.py jobs, the dashboard,
the metrics): each caller names the window of finished jobs it shows, and none reads
finished jobs outside it."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs.models import Job, JobStatus
from django_jobs.observability.inspection import (
    OUTCOMES,
    STATES,
    count_queues,
    queue_counts,
)
from tests.factories import (
    AwaitingExecutionFactory,
    BlockedExecutionFactory,
    ClaimedExecutionFactory,
    FinishedJobFactory,
    ReadyExecutionFactory,
    ScheduledExecutionFactory,
)

pytestmark = pytest.mark.django_db

DB = "default"


def ago(**delta: float) -> datetime:
    return timezone.now() - timedelta(**delta)


@pytest.fixture
def jobs():
    first = ReadyExecutionFactory(created_at=ago(minutes=3))
    ReadyExecutionFactory(created_at=ago(minutes=1))
    ScheduledExecutionFactory(job__queue_name="emails", queue_name="emails")
    BlockedExecutionFactory()
    AwaitingExecutionFactory()  # a workflow's job, waiting for the jobs it depends on
    ClaimedExecutionFactory()
    FinishedJobFactory(finished_at=ago(seconds=10))
    FinishedJobFactory(status=JobStatus.FAILED, finished_at=ago(minutes=10))
    discarded = JobStatus.DISCARDED
    FinishedJobFactory(queue_name="reports", status=discarded, finished_at=ago(minutes=30))
    FinishedJobFactory(finished_at=ago(hours=3))
    return first


def job_table_queries(queries) -> list[str]:
    return [q["sql"] for q in queries if Job._meta.db_table in q["sql"]]


def test_without_a_window_only_the_execution_tables_are_read(jobs):
    with CaptureQueriesContext(connection) as queries:
        counts = count_queues(DB)
    assert len(queries) == 5 and not job_table_queries(queries)
    assert counts.pending == {
        "default": {"ready": 2, "scheduled": 0, "blocked": 1, "awaiting": 1, "running": 1},
        "emails": {"ready": 0, "scheduled": 1, "blocked": 0, "awaiting": 0, "running": 0},
    }
    assert counts.finished == {} and counts.oldest_ready_at == {}


def test_a_window_is_one_more_query_bounded_by_finished_at(jobs):
    since = ago(minutes=15)
    with CaptureQueriesContext(connection) as queries:
        counts = count_queues(DB, finished_since=since, oldest_ready=True)
    assert len(queries) == 6
    (finished,) = job_table_queries(queries)
    assert "finished_at" in finished and ">=" in finished
    assert counts.finished == {"default": {"succeeded": 1, "failed": 1, "discarded": 0}}
    assert list(counts.finished["default"]) == list(OUTCOMES)
    assert counts.oldest_ready_at == {"default": jobs.created_at}

    until = ago(minutes=5)
    earlier = count_queues(DB, finished_since=ago(hours=1), finished_until=until)
    assert earlier.finished == {
        "default": {"succeeded": 0, "failed": 1, "discarded": 0},
        "reports": {"succeeded": 0, "failed": 0, "discarded": 1},
    }


def test_manage_py_jobs_table_counts_the_last_hour(jobs):
    table = queue_counts(DB, timezone.now())
    assert list(table) == ["default", "emails", "reports"]
    assert all(list(row) == list(STATES) for row in table.values())
    assert table["default"] == {
        "ready": 2,
        "scheduled": 0,
        "blocked": 1,
        "awaiting": 1,
        "running": 1,
        "failed_last_hour": 1,
        "finished_last_hour": 2,
    }
    assert table["reports"]["finished_last_hour"] == 1
    assert table["reports"]["ready"] == 0
