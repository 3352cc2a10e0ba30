"""``manage.py run_jobs`` as a real process: draining, queue selection, modes, task errors.

Every wait is on a condition (``wait_until``) with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from django_jobs.models import ClaimedExecution, FailedExecution, JobStatus, Pause, Process
from tests import tasks
from tests.harness import error_paths, job_row, pid_alive, runs_of, wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def assert_nothing_left_behind() -> None:
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


def test_once_drains_every_ready_job_and_logs_each_start_and_finish(run_jobs):
    results = [
        tasks.add.enqueue(1, 2),
        tasks.add.using(priority=10).enqueue(3, 4),
        tasks.echo.enqueue("hello"),  # queue "emails"
        tasks.echo.using(queue_name="reports", priority=-5).enqueue({"k": [1, 2]}),
        tasks.async_double.enqueue(21),
    ]
    proc = run_jobs("--once", "--threads", "2")
    assert proc.wait(30) == 0, proc.output()

    for result in results:
        result.refresh()
        assert result.status == "SUCCESSFUL", proc.output()
        assert result.attempts == 1
    assert [r.return_value for r in results] == [3, 7, "hello", {"k": [1, 2]}, 42]
    log = proc.output()
    for result in results:
        task_path = job_row(result).task_path
        started = re.findall(
            rf"job started task={re.escape(task_path)} job={result.id} attempt=1\n", log
        )
        finished = re.findall(
            rf"job finished task={re.escape(task_path)} job={result.id} attempt=1 "
            rf"duration=\d+\.\d{{3}}s\n",
            log,
        )
        assert len(started) == 1 and len(finished) == 1, log
    assert_nothing_left_behind()


def test_only_the_selected_queues_are_served(run_jobs):
    served = [tasks.echo.enqueue("e"), tasks.add.enqueue(1, 1)]  # emails, default
    ignored = [
        tasks.add.using(queue_name="reports").enqueue(2, 2),
        tasks.add.using(queue_name="slow").enqueue(3, 3),
    ]
    proc = run_jobs("--once", "--queues", "emails,default")
    assert proc.wait(30) == 0, proc.output()
    assert [job_row(r).status for r in served] == [JobStatus.SUCCEEDED] * 2
    for result in ignored:
        job = job_row(result)
        assert (job.status, job.attempts) == (JobStatus.READY, 0)


def test_queue_order_comes_before_priority_and_prefix_wildcards_match(run_jobs, tmp_path):
    log = tmp_path / "runs"

    def enqueue(label: str, queue: str, priority: int):
        return tasks.record_run.using(queue_name=queue, priority=priority).enqueue(str(log), label)

    # Enqueued in an order that matches neither the queue order nor the priorities.
    slow = enqueue("slow", "slow", 100)  # not selected
    enqueue("reports-0", "reports", 0)
    enqueue("default-50-a", "default", 50)
    enqueue("emails-low", "emails", -5)
    enqueue("reports-daily-20", "reports-daily", 20)
    enqueue("default-50-b", "default", 50)
    enqueue("emails-high", "emails", 0)

    proc = run_jobs("--once", "--threads", "1", "--queues", "emails,default,reports*")
    assert proc.wait(30) == 0, proc.output()
    assert runs_of(log) == [
        "emails-high",
        "emails-low",
        "default-50-a",
        "default-50-b",
        "reports-daily-20",
        "reports-0",
    ]
    assert (job_row(slow).status, job_row(slow).attempts) == (JobStatus.READY, 0)


def test_a_paused_queue_is_not_served(run_jobs):
    paused = tasks.echo.enqueue("waits")  # emails
    other = tasks.add.enqueue(1, 2)
    Pause.objects.create(queue_name="emails")
    proc = run_jobs("--once")  # all queues; --once must not wait for the paused job
    assert proc.wait(30) == 0, proc.output()
    assert job_row(other).status == JobStatus.SUCCEEDED
    job = job_row(paused)
    assert (job.status, job.attempts) == (JobStatus.READY, 0)

    Pause.objects.all().delete()
    proc = run_jobs("--once")
    assert proc.wait(30) == 0, proc.output()
    assert job_row(paused).status == JobStatus.SUCCEEDED


def test_supervisor_mode_registers_its_processes_and_stops_on_sigterm(run_jobs):
    proc = run_jobs("--processes", "2", "--threads", "2")
    wait_until(
        lambda: (
            sorted(Process.objects.values_list("kind", flat=True))
            == ["dispatcher", "supervisor", "worker", "worker"]
        ),
        what="a supervisor, two workers and a dispatcher registered",
    )
    supervisor = Process.objects.get(kind="supervisor")
    children = Process.objects.exclude(pk=supervisor.pk)
    assert supervisor.pid == proc.pid
    assert {p.supervisor_id for p in children} == {supervisor.pk}
    assert {p.pid for p in children} <= set(proc.tree())
    assert {p.metadata["threads"] for p in children.filter(kind="worker")} == {2}

    results = [tasks.add.enqueue(i, 1) for i in range(12)]
    wait_until(
        lambda: all(job_row(r).status == JobStatus.SUCCEEDED for r in results),
        what="every job done",
    )
    assert [job_row(r).return_value for r in results] == [i + 1 for i in range(12)]

    # Every process heartbeats.
    first = dict(Process.objects.values_list("pk", "last_heartbeat_at"))
    wait_until(
        lambda: all(
            beat > first[pk] for pk, beat in Process.objects.values_list("pk", "last_heartbeat_at")
        ),
        what="a fresh heartbeat from every process",
    )

    tree = proc.tree()
    began = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output()
    assert time.monotonic() - began < 10, proc.output()
    assert_nothing_left_behind()
    wait_until(lambda: not any(pid_alive(pid) for pid in tree), 5, what="no child outlives it")


def test_system_exit_and_keyboard_interrupt_fail_the_job_not_the_worker(run_jobs):
    exits = tasks.raise_system_exit.enqueue()
    interrupted = tasks.raise_keyboard_interrupt.using(priority=-1).enqueue()
    later = tasks.add.using(priority=-10).enqueue(2, 2)  # runs after both
    proc = run_jobs("--processes", "1", "--threads", "1")
    wait_until(lambda: job_row(later).status == JobStatus.SUCCEEDED, what="the later job ran")

    assert job_row(exits).status == JobStatus.FAILED
    assert job_row(interrupted).status == JobStatus.FAILED
    assert error_paths(exits) == ["builtins.SystemExit"]
    assert error_paths(interrupted) == ["builtins.KeyboardInterrupt"]
    # The same worker process ran all three: it was never killed nor replaced.
    workers = {tuple(job_row(r).worker_ids) for r in (exits, interrupted, later)}
    assert len(workers) == 1, workers
    worker = Process.objects.get(kind="worker")
    assert workers == {(worker.name,)}
    assert "exited unexpectedly" not in proc.output()
    proc.send(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output()


@pytest.mark.parametrize(
    "path",
    ["tests.tasks.not_a_task", "tests.no_such_module.task", "tests.tasks.no_such_function"],
)
def test_a_path_that_is_not_a_task_fails_clearly_and_runs_nothing(run_jobs, tmp_path, path):
    ran = tmp_path / "ran"
    result = tasks.add.using(max_attempts=3).enqueue(1, 1)
    job = job_row(result)
    job.task_path = path
    job.args = [str(ran)]
    job.save(update_fields=["task_path", "args"])
    proc = run_jobs("--once")
    assert proc.wait(30) == 0, proc.output()

    job = job_row(result)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 0)  # not run, not retried
    (error,) = FailedExecution.objects.filter(job_id=job.pk)
    assert error.exception_class_path == "django_jobs.exceptions.TaskNotFound"
    assert path in error.message
    if path == "tests.tasks.not_a_task":
        assert "not a django.tasks.Task" in error.message
    assert not ran.exists()
    assert f"job={job.pk}" in proc.output() and "job started" not in proc.output()


def test_retries_until_success_with_honest_attempts(run_jobs):
    result = tasks.report_attempt.using(max_attempts=3, backoff=0).enqueue(fail_until=2)
    proc = run_jobs("--once")
    assert proc.wait(30) == 0, proc.output()
    result.refresh()
    assert result.status == "SUCCESSFUL"
    assert result.attempts == 3
    assert result.return_value == 3  # TaskContext.attempt agreed with the row
    assert [e.exception_class_path for e in result.errors] == ["builtins.RuntimeError"] * 2
    assert list(
        FailedExecution.objects.filter(job_id=int(result.id))
        .order_by("attempt")
        .values_list("attempt", "message")
    ) == [(1, "failing attempt 1"), (2, "failing attempt 2")]


def test_single_process_mode_runs_jobs_and_stops_on_sigint(run_jobs):
    first = tasks.add.enqueue(3, 4)
    proc = run_jobs("--single-process", "--threads", "2")
    wait_until(lambda: job_row(first).status == JobStatus.SUCCEEDED, what="the first job")
    (process,) = Process.objects.all()
    assert process.pid == proc.pid and process.metadata.get("single_process") is True
    assert proc.tree() == [] or all(  # threads only: no worker child processes
        not Process.objects.filter(pid=pid).exists() for pid in proc.tree()
    )
    second = tasks.echo.enqueue("later")  # picked up while running, not only at start
    wait_until(lambda: job_row(second).status == JobStatus.SUCCEEDED, what="the second job")

    began = time.monotonic()
    proc.send(signal.SIGINT)
    assert proc.wait(15) == 0, proc.output()
    assert time.monotonic() - began < 10
    assert "shutting down gracefully (SIGINT)" in proc.output()
    assert_nothing_left_behind()


def test_a_process_pruned_as_dead_stops_and_exits_non_zero(run_jobs):
    """Someone declared it dead and recovered its claims: it must not carry on as if
    alive, and a process manager must see a failure to restart it (exit code 1)."""
    proc = run_jobs("--single-process")
    wait_until(Process.objects.exists, what="registered")
    Process.objects.all().delete()
    assert proc.wait(15) == 1, proc.output()
    assert "was pruned; stopping" in proc.output()
