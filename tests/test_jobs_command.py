"""``manage.py jobs``: each fact, and each way of being stuck, planted and then reported."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from django_jobs.models import JobStatus, Process
from tests.factories import (
    BlockedExecutionFactory,
    ClaimedExecutionFactory,
    FinishedJobFactory,
    JobFactory,
    PauseFactory,
    ProcessFactory,
    ReadyExecutionFactory,
    ScheduledExecutionFactory,
    SemaphoreFactory,
)

pytestmark = pytest.mark.django_db


def report(*args: str) -> str:
    out = StringIO()
    call_command("jobs", *args, stdout=out)
    return out.getvalue()


def test_counts_keys_processes_and_each_kind_of_stuck_job():
    now = timezone.now()
    worker = ProcessFactory(metadata={"queues": ["default"], "threads": 2})
    dead = ProcessFactory(last_heartbeat_at=now - timedelta(hours=1))
    orphan = ClaimedExecutionFactory(process=dead).job_id
    running = ClaimedExecutionFactory(process=worker).job_id
    ReadyExecutionFactory(job__queue_name="default")
    unserved = ReadyExecutionFactory(job__queue_name="reports").job_id
    ReadyExecutionFactory(job__queue_name="emails")
    PauseFactory(queue_name="emails")
    overdue = ScheduledExecutionFactory(scheduled_at=now - timedelta(hours=2)).job_id
    SemaphoreFactory(key="free", limit=2, value=2)
    behind = BlockedExecutionFactory(job__concurrency_key="free", concurrency_key="free").job_id
    SemaphoreFactory(key="full", limit=1, value=0)
    ReadyExecutionFactory(job=JobFactory(concurrency_key="full"), concurrency_key="full")
    BlockedExecutionFactory(job__concurrency_key="full", concurrency_key="full")
    FinishedJobFactory.create_batch(2)
    FinishedJobFactory(status=JobStatus.FAILED)
    for _ in range(5):  # usual duration of tests.tasks.add: one second
        FinishedJobFactory(
            last_attempted_at=now - timedelta(seconds=1), finished_at=now - timedelta(seconds=0)
        )
    slow = JobFactory(status=JobStatus.RUNNING, last_attempted_at=now - timedelta(minutes=5))

    data = json.loads(report("--json"))

    assert data["queues"]["default"]["ready"] == 2
    assert data["queues"]["default"]["running"] == 2
    assert data["queues"]["default"]["scheduled"] == 1
    assert data["queues"]["default"]["blocked"] == 2
    assert data["queues"]["default"]["finished_last_hour"] == 8
    assert data["queues"]["default"]["failed_last_hour"] == 1
    assert data["paused"] == ["emails"]
    keys = {k["key"]: k for k in data["blocked_keys"]}
    assert (keys["free"]["holders"], keys["free"]["limit"], keys["free"]["blocked"]) == (0, 2, 1)
    assert (keys["full"]["holders"], keys["full"]["limit"]) == (1, 1)
    assert data["stuck"] == {
        "claimed_by_dead_process": [orphan],
        "blocked_behind_free_slot": [behind],
        "ready_in_unserved_queue": [unserved],
        "scheduled_long_past_due": [overdue],
        "running_far_too_long": [slow.pk],
    }
    by_id = {p["id"]: p for p in data["processes"]}
    assert by_id[worker.pk]["alive"] and by_id[worker.pk]["running_jobs"] == [running]
    assert not by_id[dead.pk]["alive"] and by_id[dead.pk]["running_jobs"] == [orphan]


def test_human_report_names_every_section():
    ReadyExecutionFactory()
    ProcessFactory(kind=Process.Kind.DISPATCHER)
    text = report()
    for heading in (
        "Queues",
        "Blocked concurrency keys",
        "Stuck jobs",
        "Processes",
        "Progress of running jobs",
    ):
        assert heading in text
    assert "default" in text and "dispatcher" in text
    assert "ready in unserved queue: 1" in text


def test_empty_queues():
    text = report()
    assert "no jobs" in text and "none running" in text and "none reported" in text
    data = json.loads(report("--json"))
    assert data["queues"] == {} and data["progress"] == []


def test_running_jobs_with_progress_in_text_and_json():
    at = timezone.now()
    halfway = ClaimedExecutionFactory(
        job=JobFactory(
            status=JobStatus.RUNNING,
            task_path="app.tasks.export",
            progress_done=1234,
            progress_total=2468,
            progress_message="rows exported",
            progress_at=at,
        )
    ).job_id
    counting = JobFactory(
        status=JobStatus.RUNNING, task_path="app.tasks.scan", progress_done=7.5, progress_at=at
    ).pk
    JobFactory(status=JobStatus.RUNNING, task_path="app.tasks.silent")  # reports nothing
    FinishedJobFactory(progress_done=10, progress_total=10, progress_at=at)  # not running

    data = json.loads(report("--json"))
    assert data["progress"] == [
        {
            "job_id": halfway,
            "task_path": "app.tasks.export",
            "queue_name": "default",
            "done": 1234,
            "total": 2468,
            "fraction": 0.5,
            "message": "rows exported",
            "updated_at": at.isoformat(),
        },
        {
            "job_id": counting,
            "task_path": "app.tasks.scan",
            "queue_name": "default",
            "done": 7.5,
            "total": None,
            "fraction": None,
            "message": "",
            "updated_at": at.isoformat(),
        },
    ]
    lines = report().split("Progress of running jobs")[1].splitlines()
    (export,) = [line for line in lines if "app.tasks.export" in line]
    assert export.split()[:6] == [str(halfway), "app.tasks.export", "50%", "·", "1,234", "of"]
    assert export.rstrip().endswith("rows exported")
    (scan,) = [line for line in lines if "app.tasks.scan" in line]
    assert "7.5 done" in scan
    assert not [line for line in lines if "silent" in line]


def test_values_from_the_database_are_printed_escaped_one_line_each():
    """A key, a queue, a task path or a progress message holding a newline or an ANSI
    escape cannot forge a line of the report or recolour the operator's terminal."""
    key = "acct\n\x1b[31mred"
    SemaphoreFactory(key=key, limit=1, value=0)
    BlockedExecutionFactory(job__concurrency_key=key, concurrency_key=key)
    ClaimedExecutionFactory(
        job=JobFactory(
            status=JobStatus.RUNNING,
            queue_name="q\x1b[0m",
            task_path="app.tasks.\x1b]0;pwned\x07export",
            progress_done=1,
            progress_total=2,
            progress_message="first line\nERROR forged\x1b[2J",
            progress_at=timezone.now(),
        ),
        queue_name="q\x1b[0m",
        process=ProcessFactory(hostname="box\r\nforged"),
    )
    text = report()
    assert not {"\x1b", "\x07", "\r"} & set(text)
    for shown in (
        "acct\\n\\x1b[31mred",
        "q\\x1b[0m",
        "app.tasks.\\x1b]0;pwned\\x07export",
        "first line\\nERROR forged\\x1b[2J",
        "box\\r\\nforged",
    ):
        assert len([line for line in text.splitlines() if shown in line]) == 1, shown
    assert not [line for line in text.splitlines() if line.startswith(("red", "ERROR", "forged"))]


def test_the_blocked_keys_read_are_capped_and_the_rest_counted():
    """The grouped query over blocked jobs has a LIMIT; the report says how many keys
    there are beyond it."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_jobs.models import BlockedExecution, Job
    from django_jobs.observability import inspection

    keys = [f"k{i:05}" for i in range(inspection.KEYS_READ + 20)]
    Job.objects.bulk_create(
        Job(
            task_path="tests.tasks.add",
            queue_name="default",
            status=JobStatus.BLOCKED,
            concurrency_key=key,
        )
        for key in keys
    )
    BlockedExecution.objects.bulk_create(
        BlockedExecution(job_id=pk, queue_name="default", concurrency_key=key)
        for pk, key in Job.objects.values_list("pk", "concurrency_key")
    )
    with CaptureQueriesContext(connection) as queries:
        data = json.loads(report("--json"))
    assert [key["key"] for key in data["blocked_keys"]] == keys[: inspection.KEYS_READ]
    assert data["blocked_key_count"] == len(keys)
    table = connection.ops.quote_name(BlockedExecution._meta.db_table)
    # The keys' grouped query (with each one's oldest blocked job), not the per-queue count.
    grouped = [q["sql"] for q in queries if f"FROM {table}" in q["sql"] and "MIN(" in q["sql"]]
    assert grouped and all(f"LIMIT {inspection.KEYS_READ}" in sql for sql in grouped), grouped
    assert f"the first {inspection.KEYS_READ} of {len(keys)} keys (by name)" in report()


def test_the_latest_workflows_with_their_state_in_text_and_json(django_capture_on_commit_callbacks):
    """Each workflow's state is ``workflow_states``' (the one place it is computed); the
    text shows the latest ``WORKFLOWS_SHOWN`` and says where the rest are."""
    from django_jobs import cancel_workflow, chain, workflow
    from django_jobs.core.workflows import workflow_states
    from django_jobs.models import Workflow
    from django_jobs.observability import inspection
    from tests import workflow_tasks as wt

    running = chain((wt.step, ["a"], {}), (wt.step, ["b"], {}), name="nightly\n\x1b[31mforged")
    with workflow() as unnamed:
        unnamed.add(wt.step, "x")
    with django_capture_on_commit_callbacks(execute=True):
        cancel_workflow(unnamed.result)

    data = json.loads(report("--json"))
    assert [(w["id"], w["status"]) for w in data["workflows"]] == [
        (unnamed.result.id, "cancelled"),
        (running.id, "running"),
    ]
    (shown,) = [w for w in data["workflows"] if w["id"] == running.id]
    assert shown["counts"] == {"ready": 1, "awaiting": 1} and shown["finished_at"] is None
    assert shown["name"] == "nightly\n\x1b[31mforged"
    states = workflow_states("default", Workflow.objects.all())
    assert {w["id"]: w["status"] for w in data["workflows"]} == {
        pk: state.status for pk, state in states.items()
    }

    text = report()
    section = text.split("Workflows (the latest")[1]
    lines = section.splitlines()
    (line,) = [line for line in lines if line.split()[:1] == [str(running.id)]]
    assert line.split()[1:4] == ["nightly\\n\\x1b[31mforged", "running", "0/2"]
    (line,) = [line for line in lines if line.split()[:1] == [str(unnamed.result.id)]]
    assert line.split()[1:4] == ["-", "cancelled", "1/1"]
    assert "\x1b" not in text and "lists every workflow" not in text

    for n in range(inspection.WORKFLOWS_SHOWN):
        chain(wt.merge, name=f"more {n}")
    data = json.loads(report("--json"))
    assert len(data["workflows"]) == inspection.WORKFLOWS_SHOWN
    assert running.id not in [w["id"] for w in data["workflows"]]
    assert "the admin's workflows page lists every workflow" in report()


def test_no_workflows():
    assert "Workflows (the latest" in report()
    assert report().rstrip().endswith("none")
    assert json.loads(report("--json"))["workflows"] == []


def test_past_the_rows_it_reads_the_last_hour_columns_cover_its_latest_minutes(monkeypatch):
    """``failed_last_hour`` and ``finished_last_hour`` read each job for its queue: past
    ``QUEUE_ROWS_READ`` jobs in the hour (10,000 in use, 3 here) they count its latest
    minutes, and the overview says from when."""
    from django_jobs.observability import inspection

    monkeypatch.setattr(inspection, "QUEUE_ROWS_READ", 3)
    now = timezone.now()
    FinishedJobFactory.create_batch(2, queue_name="emails", finished_at=now)
    FinishedJobFactory.create_batch(
        3, status=JobStatus.FAILED, finished_at=now - timedelta(minutes=20)
    )
    data = json.loads(report("--json"))
    assert data["finished_minutes"] in (20, 21)
    assert data["queues"] == {
        "emails": {
            "ready": 0,
            "scheduled": 0,
            "blocked": 0,
            "awaiting": 0,
            "running": 0,
            "failed_last_hour": 0,
            "finished_last_hour": 2,
        }
    }
    text = report()
    assert "only (the latest 2" in text and "more than 3 finished jobs" in text, text


def test_an_ordinary_hour_is_counted_whole():
    FinishedJobFactory(status=JobStatus.FAILED, finished_at=timezone.now() - timedelta(minutes=50))
    data = json.loads(report("--json"))
    assert data["finished_minutes"] == 60
    assert data["queues"]["default"]["failed_last_hour"] == 1
    assert "only (the latest" not in report()
