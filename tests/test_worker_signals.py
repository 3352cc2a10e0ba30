"""Real signals to real ``run_jobs`` processes: graceful and immediate stops, crashes.

A job's runs are counted in a file it appends to (``tests.tasks.record_run`` and
``slow_first_attempt``), so "nothing ran twice beyond the recorded attempts" is
checked against what actually ran, not only against what the database says.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.utils import timezone

from django_jobs.models import ClaimedExecution, FailedExecution, JobStatus, Process
from testproject.demo.models import AuditEvent
from tests import shutdown_tasks, tasks
from tests.harness import error_paths, job_row, pid_alive, runs_of, wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

MODES = {
    "supervisor": ["--processes", "1", "--threads", "3"],
    "single-process": ["--single-process", "--threads", "3"],
}
WORKER_SHUTDOWN = "django_jobs.exceptions.WorkerShutdown"
PROCESS_DIED = "django_jobs.exceptions.ProcessDied"


def wait_started(*markers, timeout: float = 20.0) -> None:
    wait_until(lambda: all(m.exists() for m in markers), timeout, what=f"{markers} started")


def assert_nothing_left_behind() -> None:
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_finishes_short_jobs_fails_long_ones_and_hands_back_the_rest(
    run_jobs, tmp_path, mode
):
    """The long jobs run Python, so the interrupt at the deadline ends them and their
    own threads record them (tests/test_shutdown_deadline.py has one blocked in C)."""
    log, gate = tmp_path / "runs", tmp_path / "stop-sent"
    short = shutdown_tasks.runs_until.using(priority=10).enqueue(str(log), "short", str(gate))
    retried = shutdown_tasks.loops_in_python.using(priority=10, max_attempts=2).enqueue(
        key="retried", seconds=30
    )
    failed = shutdown_tasks.loops_in_python.using(priority=10).enqueue(key="failed", seconds=30)
    waiting = tasks.record_run.using(priority=-10).enqueue(str(log), "waiting")
    proc = run_jobs(*MODES[mode], env={"JOBS_SHUTDOWN_TIMEOUT": "2"})
    wait_until(lambda: runs_of(log) == ["short"], what="the short job started")
    wait_until(lambda: AuditEvent.objects.count() == 2, what="the long jobs started")

    began = time.monotonic()
    proc.send(signal.SIGTERM)
    # The worker (a child, asked by its supervisor) has stopped claiming: the short job
    # ends now, within the shutdown timeout, and no thread it frees takes the waiting one.
    proc.wait_for_output("asked by the supervisor" if mode == "supervisor" else "(SIGTERM)")
    gate.touch()
    assert proc.wait(15) == 0, proc.output()
    assert time.monotonic() - began < 10, proc.output()

    # Shorter than the shutdown timeout: it finished, one attempt, no error.
    job = job_row(short)
    assert (job.status, job.attempts, job.return_value) == (JobStatus.SUCCEEDED, 1, "short")
    assert error_paths(short) == []
    # Longer: a failed attempt, retried (ready again) while attempts remain...
    job = job_row(retried)
    assert (job.status, job.attempts) == (JobStatus.READY, 1), proc.output()
    assert error_paths(retried) == [WORKER_SHUTDOWN]
    # ... failed for good when none remain.
    job = job_row(failed)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1), proc.output()
    assert error_paths(failed) == [WORKER_SHUTDOWN]
    # Never started: costs nothing, still ready.
    job = job_row(waiting)
    assert (job.status, job.attempts) == (JobStatus.READY, 0)
    assert runs_of(log) == ["short"]
    assert_nothing_left_behind()

    # The retried job and the waiting one run on the next start, once each.
    proc = run_jobs("--once", "--threads", "1")
    assert proc.wait(30) == 0, proc.output()
    assert job_row(waiting).status == JobStatus.SUCCEEDED
    job = job_row(retried)
    assert (job.status, job.attempts, job.return_value) == (JobStatus.SUCCEEDED, 2, 2)
    assert error_paths(retried) == [WORKER_SHUTDOWN]
    assert sorted(runs_of(log)) == ["short", "waiting"]
    runs = sorted(AuditEvent.objects.values_list("key", "attempt"))
    assert runs == [("failed", 1), ("retried", 1), ("retried", 2)]


@pytest.mark.parametrize("second", ["SIGTERM", "SIGQUIT"])
def test_a_second_signal_stops_the_supervisor_at_once_and_claims_are_recovered_once(
    run_jobs, tmp_path, second
):
    log, marker = tmp_path / "runs", tmp_path / "started"
    result = tasks.slow_first_attempt.using(max_attempts=2, backoff=0).enqueue(
        str(log), "job", 30, str(marker)
    )
    proc = run_jobs("--processes", "1", "--threads", "1")
    wait_started(marker)
    tree = proc.tree()
    if second == "SIGTERM":
        proc.send(signal.SIGTERM)
        proc.wait_for_output("shutting down gracefully (SIGTERM)")
    began = time.monotonic()
    proc.send(getattr(signal, second))
    proc.wait(10)
    assert time.monotonic() - began < 5, proc.output()
    wait_until(lambda: not any(pid_alive(pid) for pid in tree), 5, what="children gone")

    # The supervisor settled its child's claim: one failed attempt, retried.
    job = job_row(result)
    assert (job.status, job.attempts) == (JobStatus.READY, 1), proc.output()
    assert error_paths(result) == [PROCESS_DIED]
    assert_nothing_left_behind()

    proc = run_jobs("--once")
    assert proc.wait(30) == 0, proc.output()
    job = job_row(result)
    assert (job.status, job.attempts, job.return_value) == (JobStatus.SUCCEEDED, 2, 2)
    assert error_paths(result) == [PROCESS_DIED]  # recovered exactly once
    assert runs_of(log) == ["job", "job"]


def test_a_second_sigterm_stops_single_process_mode_at_once_and_a_later_run_recovers(
    run_jobs, tmp_path
):
    log, marker = tmp_path / "runs", tmp_path / "started"
    result = tasks.slow_first_attempt.using(max_attempts=2, backoff=0).enqueue(
        str(log), "job", 30, str(marker)
    )
    proc = run_jobs("--single-process", "--threads", "1")
    wait_started(marker)
    proc.send(signal.SIGTERM)
    proc.wait_for_output("shutting down gracefully (SIGTERM)")
    began = time.monotonic()
    proc.send(signal.SIGTERM)
    proc.wait(10)
    assert time.monotonic() - began < 5, proc.output()
    # Nothing settled on the way out: the claim waits for pruning.
    (process,) = Process.objects.all()
    assert ClaimedExecution.objects.get().process_id == process.pk
    assert job_row(result).status == JobStatus.RUNNING

    later = run_jobs("--single-process", "--threads", "1")
    wait_until(
        lambda: job_row(result).status == JobStatus.SUCCEEDED, 20, what="recovered and rerun"
    )
    job = job_row(result)
    assert (job.attempts, job.return_value) == (2, 2)
    assert error_paths(result) == [PROCESS_DIED]
    assert runs_of(log) == ["job", "job"]
    assert not Process.objects.filter(pk=process.pk).exists()
    later.send(signal.SIGTERM)
    assert later.wait(15) == 0, later.output()


def test_sigkill_of_a_worker_child_is_recovered_and_the_worker_replaced(run_jobs, tmp_path):
    log = tmp_path / "runs"
    retried_mark, failed_mark = tmp_path / "retried", tmp_path / "failed"
    retried = tasks.slow_first_attempt.using(max_attempts=2, backoff=0).enqueue(
        str(log), "retried", 30, str(retried_mark)
    )
    failed = tasks.slow_first_attempt.enqueue(str(log), "failed", 30, str(failed_mark))
    proc = run_jobs("--processes", "1", "--threads", "2")
    wait_started(retried_mark, failed_mark)

    victim = Process.objects.get(kind="worker")
    assert set(ClaimedExecution.objects.values_list("process_id", flat=True)) == {victim.pk}
    supervisor = Process.objects.get(kind="supervisor")
    os.kill(victim.pid, signal.SIGKILL)

    wait_until(
        lambda: Process.objects.filter(kind="worker").exclude(pk=victim.pk).exists(),
        what="a replacement worker",
    )
    replacement = Process.objects.get(kind="worker")
    assert replacement.pid != victim.pid and pid_alive(replacement.pid)
    assert replacement.supervisor_id == supervisor.pk
    wait_until(lambda: job_row(retried).status == JobStatus.SUCCEEDED, what="the retried job")
    after = tasks.add.enqueue(5, 5)  # the replacement takes new work too
    wait_until(lambda: job_row(after).status == JobStatus.SUCCEEDED, what="a new job")

    job = job_row(retried)
    assert (job.attempts, job.return_value) == (2, 2)
    assert job.worker_ids == [victim.name, replacement.name]
    assert error_paths(retried) == [PROCESS_DIED]
    job = job_row(failed)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)  # no attempts left
    assert error_paths(failed) == [PROCESS_DIED]
    assert sorted(runs_of(log)) == ["failed", "retried", "retried"]
    assert not Process.objects.filter(pk=victim.pk).exists()
    assert Process.objects.get(kind="supervisor").pk == supervisor.pk  # the same supervisor
    proc.wait_for_output(f"worker process {victim.pid} exited unexpectedly")

    proc.send(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output()
    assert_nothing_left_behind()


def test_a_killed_tree_is_pruned_after_the_alive_threshold_by_the_next_run(run_jobs, tmp_path):
    log, marker = tmp_path / "runs", tmp_path / "started"
    result = tasks.slow_first_attempt.using(max_attempts=2, backoff=0).enqueue(
        str(log), "job", 30, str(marker)
    )
    first = run_jobs("--processes", "1", "--threads", "1")
    wait_started(marker)
    wait_until(lambda: Process.objects.count() == 3, what="all three registered")
    stale = {p.pk: p for p in Process.objects.all()}
    tree = first.tree()
    first.kill()  # SIGKILL, supervisor and children at once
    wait_until(lambda: not any(pid_alive(pid) for pid in [first.pid, *tree]), 5, what="all dead")
    killed_at = timezone.now()
    claim = ClaimedExecution.objects.select_related("process").get()
    assert claim.job_id == int(result.id)
    last_beat = claim.process.last_heartbeat_at  # of the worker holding the job

    second = run_jobs("--processes", "1", "--threads", "1")
    wait_until(
        lambda: job_row(result).status == JobStatus.SUCCEEDED, 30, what="recovered and rerun"
    )
    wait_until(
        lambda: not Process.objects.filter(pk__in=stale).exists(), 10, what="all three pruned"
    )
    (failure,) = FailedExecution.objects.filter(job_id=int(result.id))
    assert failure.exception_class_path == PROCESS_DIED
    # Not before the alive threshold (3 s in FAST_ENV) ran out.
    assert (failure.failed_at - last_beat).total_seconds() >= 3.0, (failure.failed_at, last_beat)
    assert failure.failed_at > killed_at
    job = job_row(result)
    assert (job.attempts, job.return_value) == (2, 2)
    assert runs_of(log) == ["job", "job"]
    assert "pruned dead process" in second.output()
    second.send(signal.SIGTERM)
    assert second.wait(15) == 0, second.output()
    assert_nothing_left_behind()


def test_a_sigterm_to_every_process_at_once_is_one_graceful_stop(run_jobs, tmp_path):
    """systemd's default KillMode, Heroku and container runtimes signal every process of
    the service at once: a worker child then gets the platform's SIGTERM and the
    supervisor's request. Counted as two SIGTERMs, that stopped it at once and failed
    a job that had time to finish; the supervisor's request (SIGUSR1) never escalates."""
    log, marker = tmp_path / "runs", tmp_path / "started"
    result = tasks.record_run.enqueue(str(log), "job", 2.0, str(marker))
    proc = run_jobs("--processes", "1", "--threads", "1", env={"JOBS_SHUTDOWN_TIMEOUT": "20"})
    wait_started(marker)
    children = proc.tree()
    assert children, "no child processes"
    for pid in [proc.pid, *children]:
        os.kill(pid, signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
    assert "stopping immediately" not in proc.output(), proc.output()
    job = job_row(result)
    assert (job.status, job.attempts) == (JobStatus.SUCCEEDED, 1), proc.output()
    assert runs_of(log) == ["job"]
    assert_nothing_left_behind()
