"""One job through the executor, in this process: signals, logs, outcomes."""

from __future__ import annotations

import logging

import pytest
from django.tasks import TaskResultStatus
from django.tasks.signals import task_finished, task_started

from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.models import FailedExecution, Job, JobStatus
from django_jobs.runtime.context import ExecutionContext
from django_jobs.runtime.executor import execute_job
from django_jobs.runtime.lifecycle import Lifecycle
from tests import tasks

# transaction=True: the executor closes obsolete connections, as a worker thread must.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run_claimed():
    worker = register_process("default", "worker")
    ctx = ExecutionContext("default", worker.pk, worker.name, Lifecycle(), 1.0)

    def run() -> Job:
        (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
        execute_job(job, ctx)
        return Job.objects.get(pk=job.pk)

    run.ctx = ctx
    return run


@pytest.fixture
def signals():
    seen: list[tuple[str, str, str]] = []

    def started(sender, task_result, **kwargs):
        seen.append(("started", task_result.id, task_result.status))

    def finished(sender, task_result, **kwargs):
        seen.append(("finished", task_result.id, task_result.status))

    task_started.connect(started)
    task_finished.connect(finished)
    yield seen
    task_started.disconnect(started)
    task_finished.disconnect(finished)


def test_success_sends_signals_and_logs(run_claimed, signals, caplog):
    caplog.set_level(logging.INFO, logger="django_jobs")
    result = tasks.add.enqueue(2, 3)
    job = run_claimed()
    assert (job.status, job.return_value, job.attempts) == (JobStatus.SUCCEEDED, 5, 1)
    assert signals == [
        ("started", result.id, TaskResultStatus.RUNNING),
        ("finished", result.id, TaskResultStatus.SUCCESSFUL),
    ]
    messages = [r.getMessage() for r in caplog.records if r.name == "django_jobs.worker"]
    assert messages[0] == f"job started task=tests.tasks.add job={result.id} attempt=1"
    assert messages[1].startswith(f"job finished task=tests.tasks.add job={result.id} attempt=1")
    assert "duration=" in messages[1]


def test_failure_with_retry_left_reports_ready(run_claimed, signals, caplog):
    result = tasks.always_fails.enqueue("nope")
    job = run_claimed()
    assert (job.status, job.attempts) == (JobStatus.READY, 1)  # backoff 0: ready again
    assert signals[-1] == ("finished", result.id, TaskResultStatus.READY)
    failure = FailedExecution.objects.get(job_id=job.pk)
    assert failure.exception_class_path == "builtins.ValueError"
    assert failure.message == "nope" and "ValueError: nope" in failure.traceback
    assert any("job failed task=tests.tasks.always_fails" in r.getMessage() for r in caplog.records)


def test_last_failure_reports_failed(run_claimed, signals):
    tasks.always_fails.using(max_attempts=1).enqueue()
    job = run_claimed()
    assert job.status == JobStatus.FAILED
    assert signals[-1][2] == TaskResultStatus.FAILED


@pytest.mark.parametrize(
    ("task", "error"),
    [
        (tasks.raise_system_exit, "builtins.SystemExit"),
        (tasks.raise_keyboard_interrupt, "builtins.KeyboardInterrupt"),
    ],
)
def test_system_exit_and_keyboard_interrupt_are_failures(run_claimed, task, error):
    task.enqueue()
    job = run_claimed()
    assert job.status == JobStatus.FAILED
    assert FailedExecution.objects.get(job_id=job.pk).exception_class_path == error


def test_a_return_value_that_is_not_json_fails_the_job_unretried(run_claimed):
    tasks.echo.enqueue("x")
    Job.objects.update(task_path="tests.tasks.returns_a_set", max_attempts=3)
    job = run_claimed()
    # The body ran to its end: not run again for a value it would most likely return again.
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
    failure = FailedExecution.objects.get(job_id=job.pk)
    assert failure.exception_class_path == "django_jobs.exceptions.ResultNotStored"
    assert "the return value is not JSON serializable" in failure.message


def test_async_tasks_run_on_an_event_loop(run_claimed):
    tasks.async_double.enqueue(21)
    job = run_claimed()
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, 42)


def test_context_attempt_agrees_with_attempts(run_claimed):
    tasks.report_attempt.using(max_attempts=3, backoff=0).enqueue(fail_until=2)
    for _ in range(3):
        job = run_claimed()
    assert (job.status, job.attempts, job.return_value) == (JobStatus.SUCCEEDED, 3, 3)


def test_a_job_claimed_during_shutdown_is_handed_back_unstarted(run_claimed, signals):
    tasks.add.enqueue(1, 1)
    run_claimed.ctx.lifecycle.request_stop("test")
    job = run_claimed()
    assert (job.status, job.attempts) == (JobStatus.READY, 0)
    assert signals == []
