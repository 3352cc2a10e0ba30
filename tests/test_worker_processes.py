"""Real ``run_jobs`` processes, real signals, real crashes.

Every wait is on a condition (``wait_until``) with a deadline; nothing sleeps
and hopes.
"""

from __future__ import annotations

import os
import re
import signal
import time
from itertools import pairwise

import pytest
from django.db import connection

from django_jobs.models import ClaimedExecution, FailedExecution, Job, JobStatus, Pause, Process
from testproject.demo.models import AuditEvent
from tests import shutdown_tasks, tasks
from tests.harness import database_url, wait_until
from tests.proxy import CuttableProxy

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def job_of(result) -> Job:
    return Job.objects.get(pk=int(result.id))


def status_of(result) -> str:
    return job_of(result).status


def errors_of(result) -> list[str]:
    return list(
        FailedExecution.objects.filter(job_id=int(result.id))
        .order_by("attempt")
        .values_list("exception_class_path", flat=True)
    )


def test_once_drains_the_queues_and_logs_each_job(run_jobs):
    results = [tasks.add.enqueue(i, i) for i in range(3)] + [tasks.echo.enqueue("hi")]
    proc = run_jobs("--once", "--threads", "2")
    assert proc.wait() == 0, proc.output()
    for result in results:
        result.refresh()
        assert result.status == "SUCCESSFUL", proc.output()
        assert result.attempts == 1
    assert [r.return_value for r in results] == [0, 2, 4, "hi"]
    log = proc.output()
    for result in results:
        assert re.search(rf"job started task=\S+ job={result.id} attempt=1\b", log)
        assert re.search(
            rf"job finished task=\S+ job={result.id} attempt=1 duration=\d+\.\d+s", log
        )


def test_queue_selection_order_and_pauses(run_jobs):
    default_jobs = [tasks.add.using(priority=50).enqueue(i, 0) for i in range(2)]
    email_jobs = [tasks.echo.enqueue(i) for i in range(2)]
    report_job = tasks.add.using(queue_name="reports-daily").enqueue(1, 1)
    slow_job = tasks.add.using(queue_name="slow").enqueue(2, 2)
    Pause.objects.create(queue_name="slow")

    proc = run_jobs("--once", "--threads", "1", "--queues", "emails,default,reports*")
    assert proc.wait() == 0, proc.output()
    started = {job.pk: job.started_at for job in Job.objects.filter(status=JobStatus.SUCCEEDED)}
    # Queue order wins over priority: every emails job (priority 5) started
    # before any default job (priority 50).
    assert max(started[int(r.id)] for r in email_jobs) < min(
        started[int(r.id)] for r in default_jobs
    )
    assert status_of(report_job) == JobStatus.SUCCEEDED  # prefix wildcard
    assert status_of(slow_job) == JobStatus.READY  # paused


def test_only_the_named_queues_are_served(run_jobs):
    email = tasks.echo.enqueue("e")
    default = tasks.add.enqueue(1, 1)
    proc = run_jobs("--once", "--queues", "emails")
    assert proc.wait() == 0, proc.output()
    assert status_of(email) == JobStatus.SUCCEEDED
    assert status_of(default) == JobStatus.READY


def test_supervisor_registers_processes_and_stops_on_sigterm(run_jobs):
    proc = run_jobs("--processes", "2", "--threads", "2")
    wait_until(
        lambda: (
            sorted(Process.objects.values_list("kind", flat=True))
            == ["dispatcher", "supervisor", "worker", "worker"]
        ),
        what="supervisor, two workers and a dispatcher registered",
    )
    supervisor = Process.objects.get(kind="supervisor")
    assert supervisor.pid == proc.pid
    assert set(
        Process.objects.exclude(pk=supervisor.pk).values_list("supervisor_id", flat=True)
    ) == {supervisor.pk}
    results = [tasks.add.enqueue(i, 1) for i in range(10)]
    wait_until(lambda: all(status_of(r) == JobStatus.SUCCEEDED for r in results))
    before = Process.objects.get(kind="worker", pk=Process.objects.filter(kind="worker").first().pk)
    wait_until(
        lambda: Process.objects.get(pk=before.pk).last_heartbeat_at > before.last_heartbeat_at,
        what="a heartbeat",
    )
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    assert Process.objects.count() == 0


def test_sigterm_lets_a_running_job_finish(run_jobs, tmp_path):
    marker = tmp_path / "started"
    result = tasks.sleep_then_return.enqueue(1.5, str(marker))
    proc = run_jobs("--threads", "1")
    wait_until(marker.exists, what="the job started")
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    result.refresh()
    assert result.status == "SUCCESSFUL" and result.attempts == 1
    assert ClaimedExecution.objects.count() == 0


def test_a_job_outliving_the_shutdown_timeout_is_a_failed_attempt(run_jobs, tmp_path):
    """In Python, so the interrupt at the deadline ends it (tests/test_shutdown_deadline.py)."""
    result = shutdown_tasks.loops_in_python.using(max_attempts=2, backoff=60).enqueue(
        key="long", seconds=30
    )
    waiting = tasks.add.enqueue(1, 1)
    proc = run_jobs("--threads", "1", "--single-process", env={"JOBS_SHUTDOWN_TIMEOUT": "1"})
    wait_until(
        lambda: AuditEvent.objects.filter(job_id=int(result.id)).exists(),
        what="the long job started",
    )
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    job = job_of(result)
    assert job.attempts == 1
    assert job.status == JobStatus.SCHEDULED  # retried later: one attempt left
    assert errors_of(result) == ["django_jobs.exceptions.WorkerShutdown"]
    # The job that never started cost nothing.
    assert (job_of(waiting).status, job_of(waiting).attempts) in {
        (JobStatus.READY, 0),
        (JobStatus.SUCCEEDED, 1),
    }


def test_second_sigterm_stops_at_once_and_the_claim_is_settled(run_jobs, tmp_path):
    marker = tmp_path / "started"
    result = tasks.sleep_then_return.enqueue(30, str(marker))
    proc = run_jobs("--threads", "1")
    wait_until(marker.exists, what="the job started")
    proc.send(signal.SIGTERM)
    proc.wait_for_output("shutting down gracefully")
    began = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(10) == 0, proc.output()
    assert time.monotonic() - began < 5
    assert ClaimedExecution.objects.count() == 0
    assert status_of(result) == JobStatus.FAILED
    assert errors_of(result) == ["django_jobs.exceptions.ProcessDied"]
    assert Process.objects.count() == 0


def test_sigkill_of_a_worker_child_is_recovered_and_replaced(run_jobs, tmp_path):
    marker = tmp_path / "started"
    result = tasks.sleep_then_return.using(max_attempts=2, backoff=0).enqueue(1.0, str(marker))
    proc = run_jobs("--processes", "1", "--threads", "1")
    wait_until(marker.exists, what="the job started")
    claim = ClaimedExecution.objects.select_related("process").get(job_id=int(result.id))
    victim = claim.process
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(
        lambda: Process.objects.filter(kind="worker").exclude(pid=victim.pid).exists(),
        what="a replacement worker",
    )
    wait_until(lambda: status_of(result) == JobStatus.SUCCEEDED, what="the retried job finished")
    job = job_of(result)
    assert job.attempts == 2 and len(job.worker_ids) == 2
    assert errors_of(result) == ["django_jobs.exceptions.ProcessDied"]
    assert not Process.objects.filter(pid=victim.pid).exists()
    proc.wait_for_output(f"worker process {victim.pid} exited unexpectedly")
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_a_killed_tree_is_pruned_by_the_next_run(run_jobs, tmp_path):
    marker = tmp_path / "started"
    result = tasks.sleep_then_return.using(max_attempts=2, backoff=0).enqueue(0.5, str(marker))
    first = run_jobs("--single-process", "--threads", "1")
    wait_until(marker.exists, what="the job started")
    first.kill()
    assert ClaimedExecution.objects.filter(job_id=int(result.id)).exists()
    second = run_jobs("--single-process", "--threads", "1")
    # Alive threshold is 3 s in the tests: the dead row is pruned, the job retried.
    wait_until(lambda: status_of(result) == JobStatus.SUCCEEDED, 30, what="recovered and rerun")
    assert errors_of(result) == ["django_jobs.exceptions.ProcessDied"]
    assert job_of(result).attempts == 2
    assert "pruned dead process" in second.output()
    second.send(signal.SIGTERM)
    assert second.wait(20) == 0


def test_system_exit_and_keyboard_interrupt_do_not_kill_the_worker(run_jobs):
    exits = tasks.raise_system_exit.enqueue()
    interrupts = tasks.raise_keyboard_interrupt.enqueue()
    later = tasks.add.using(priority=-10).enqueue(2, 2)
    proc = run_jobs("--once", "--threads", "1")
    assert proc.wait() == 0, proc.output()
    assert errors_of(exits) == ["builtins.SystemExit"]
    assert errors_of(interrupts) == ["builtins.KeyboardInterrupt"]
    assert status_of(later) == JobStatus.SUCCEEDED


@pytest.mark.parametrize("path", ["tests.tasks.not_a_task", "tests.no_such_module.task"])
def test_only_tasks_run(run_jobs, path, tmp_path):
    ran = tmp_path / "not-a-task-ran"
    result = tasks.add.enqueue(1, 1)
    # Arguments a call of the plain function would take: had it run, ``ran`` would exist.
    Job.objects.filter(pk=int(result.id)).update(task_path=path, args=[str(ran)])
    proc = run_jobs("--once")
    assert proc.wait() == 0, proc.output()
    job = job_of(result)
    assert job.status == JobStatus.FAILED and job.attempts == 0
    assert errors_of(result) == ["django_jobs.exceptions.TaskNotFound"]
    assert not ran.exists()


def test_retries_until_success_with_honest_attempts(run_jobs):
    result = tasks.report_attempt.using(max_attempts=3, backoff=0).enqueue(fail_until=2)
    proc = run_jobs("--once")
    assert proc.wait() == 0, proc.output()
    result.refresh()
    assert result.status == "SUCCESSFUL"
    assert result.attempts == 3 and result.return_value == 3
    assert [e.exception_class_path for e in result.errors] == ["builtins.RuntimeError"] * 2


def test_single_process_mode_stops_on_sigint(run_jobs):
    result = tasks.add.enqueue(3, 4)
    proc = run_jobs("--single-process")
    wait_until(lambda: status_of(result) == JobStatus.SUCCEEDED)
    proc.send(signal.SIGINT)
    assert proc.wait(20) == 0, proc.output()
    assert Process.objects.count() == 0


def test_worker_survives_the_database_going_away(run_jobs, tmp_path):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite is a file: there is no server to lose")
    settings = connection.settings_dict
    default_port = 5432 if connection.vendor == "postgresql" else 3306
    proxy = CuttableProxy(
        settings.get("HOST") or "127.0.0.1", int(settings.get("PORT") or default_port)
    )
    try:
        url = database_url(port=proxy.port)
        marker = tmp_path / "started"
        running = tasks.sleep_then_return.enqueue(1.0, str(marker))
        proc = run_jobs("--single-process", "--threads", "2", env={"DATABASE_URL": url})
        wait_until(marker.exists, what="the job started")
        proxy.cut()
        during = tasks.add.enqueue(20, 22)  # straight to the database, not through the proxy
        proc.wait_for_output("database unavailable", timeout=20)
        time.sleep(2)  # the outage itself: the worker must ride it out
        proxy.restore()
        wait_until(
            lambda: (
                status_of(running) == JobStatus.SUCCEEDED
                and status_of(during) == JobStatus.SUCCEEDED
            ),
            30,
            what="both jobs done after the outage",
        )
        assert job_of(running).attempts == 1
        assert errors_of(running) == []
        assert job_of(during).return_value == 42
        proc.send(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.output()
    finally:
        proxy.close()


def test_a_queue_cap_holds_across_worker_processes(run_jobs):
    """max_concurrency=1 on 'slow': two processes x three threads still run one at a time."""
    slow = [tasks.sleep_then_return.using(queue_name="slow").enqueue(0.2) for _ in range(6)]
    free = [tasks.add.enqueue(i, i) for i in range(6)]
    proc = run_jobs("--processes", "2", "--threads", "3", env={"JOBS_MAX_CONCURRENCY": "slow=1"})
    wait_until(
        lambda: all(status_of(r) == JobStatus.SUCCEEDED for r in slow + free),
        30,
        what="every job done",
    )
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    spans = sorted(Job.objects.filter(queue_name="slow").values_list("started_at", "finished_at"))
    overlaps = [a_end > b_start for (_, a_end), (b_start, _) in pairwise(spans)]
    assert not any(overlaps), spans
