"""inspection.running_too_long (the stuck page's and ``manage.py jobs``' "running far too
long"): a task's usual duration is read with LIMITs only, from the latest successes of
every task at once, else from a bounded read of the task's own jobs, never by walking
the history back to a task's last success."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs.models import JobStatus
from django_jobs.observability import inspection
from tests.factories import FinishedJobFactory, JobFactory

pytestmark = pytest.mark.django_db

DB = "default"
COMMON, LAPSED, NEVER = "tests.tasks.add", "tests.tasks.echo", "tests.tasks.fail"


def succeeded(task_path: str, finished: datetime, count: int, seconds: float = 1.0) -> None:
    FinishedJobFactory.create_batch(
        count,
        task_path=task_path,
        last_attempted_at=finished - timedelta(seconds=seconds),
        finished_at=finished,
    )


def running(task_path: str, for_: timedelta) -> int:
    return JobFactory(
        task_path=task_path, status=JobStatus.RUNNING, last_attempted_at=timezone.now() - for_
    ).pk


@pytest.fixture
def few_recent(monkeypatch):
    """The latest successes read for every task at once: 10 here, 5,000 in use."""
    monkeypatch.setattr(inspection, "RECENT_SUCCESSES", 10)


def test_a_task_is_judged_by_its_latest_successes_or_else_by_its_own_jobs(few_recent):
    now = timezone.now()
    # LAPSED succeeded in 1 s days ago and fails since; COMMON fills the latest successes.
    succeeded(LAPSED, now - timedelta(days=3), 5)
    JobFactory.create_batch(
        3, task_path=LAPSED, status=JobStatus.FAILED, finished_at=now - timedelta(hours=1)
    )
    succeeded(COMMON, now, 10)
    late = [running(COMMON, timedelta(minutes=5)), running(LAPSED, timedelta(minutes=5))]
    running(COMMON, timedelta(seconds=2))  # under 5 x 1 s: not late
    running(NEVER, timedelta(hours=5))  # no success to judge it by
    with CaptureQueriesContext(connection) as captured:
        found = inspection.running_too_long(DB, now)
    assert sorted(found) == sorted(late)
    reads = [q["sql"] for q in captured.captured_queries]
    latest = [sql for sql in reads if "'succeeded'" in sql and "DESC" in sql]
    assert len(latest) == 1 and "LIMIT 10" in latest[0], reads
    # A task's own jobs: by its index, bounded, never ordered by time (which walked the
    # (status, finished_at) index back to its last success).
    per_task = [sql for sql in reads if "task_path" in sql.split("FROM")[1]]
    assert per_task and all(
        "ORDER BY" not in sql and f"LIMIT {inspection.TASK_ROWS_READ}" in sql for sql in per_task
    ), per_task


def test_a_common_task_is_judged_by_its_last_50_successes():
    now = timezone.now()
    succeeded(COMMON, now - timedelta(hours=1), 60, seconds=600)  # older: 10 minutes each
    succeeded(COMMON, now, 50, seconds=1)  # the last 50: 1 s each
    late = running(COMMON, timedelta(minutes=1))
    with CaptureQueriesContext(connection) as captured:
        assert inspection.running_too_long(DB, now) == [late]
    # Found among the latest successes: the task's own jobs are not read.
    assert not [q for q in captured.captured_queries if 'task_path" =' in q["sql"]]
