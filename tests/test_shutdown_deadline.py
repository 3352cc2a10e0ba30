"""The shutdown deadline never frees a slot while its body may still run (docs/design.md
invariant 9, seed 000), with real ``run_jobs`` processes and real signals.

At ``shutdown_timeout`` a body still running gets ``WorkerShutdown`` raised in its
thread (an ``async def`` body: its asyncio task cancelled). One in Python ends there
and is recorded by its own thread, even inside an ``except Exception:`` of its own
(``WorkerShutdown`` is a ``BaseException``). One blocked in C code does not end: its
process exits without settling it, and the next job of its key starts only once that
process is gone. Before, the worker recorded it as a failed attempt on its way out,
which freed the slot while the body still ran.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from django_jobs.models import ClaimedExecution, FailedExecution, JobStatus, Process
from testproject.demo.models import AuditEvent
from tests import shutdown_tasks
from tests.harness import error_paths, job_row, pid_alive, wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

WORKER_SHUTDOWN = "django_jobs.exceptions.WorkerShutdown"
INTERRUPTED = "interrupted: still running after the 1s shutdown timeout (ran "
PROCESS_DIED = "django_jobs.exceptions.ProcessDied"
# A short deadline; a grace long enough that a Python body surely ends within it,
# so a test that stops in less proves the worker did not wait it out.
DEADLINE = {"JOBS_SHUTDOWN_TIMEOUT": "1", "JOBS_INTERRUPT_GRACE": "5"}
MODES = {
    "supervisor": ["--processes", "1", "--threads", "3"],
    "single-process": ["--single-process", "--threads", "3"],
}


def started(result, proc) -> AuditEvent:
    return wait_until(
        lambda: AuditEvent.objects.filter(job_id=int(result.id)).order_by("pk").first(),
        30,
        what=f"job {result.id} started; run_jobs said:\n{proc.output()}",
    )


def audits(result) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(job_id=int(result.id)).order_by("attempt"))


@pytest.mark.parametrize("mode", ["supervisor", "single-process"])
def test_a_body_blocked_in_c_keeps_its_slot_until_its_process_is_gone(run_jobs, mode):
    """Limit 1. Job A's body sleeps in C past the deadline; the worker running it gets
    SIGTERM. The next job of the key, B, starts only once the process running A has
    exited, and checks that as it starts; A's attempt is recorded after that by the
    recovery of a dead process (ProcessDied), then retried or failed per max_attempts.

    With a supervisor: its worker child exits with code 76 and the supervisor records
    A at once, then restarts the child; the other child runs B. Without one: the
    process exits 0 leaving its row and A's claim, and another process's dispatcher
    records A once the row's heartbeat is past the alive threshold (5 s here)."""
    supervised = mode == "supervisor"
    attempts = 2 if supervised else 1
    stuck = shutdown_tasks.blocked_in_c.using(max_attempts=attempts).enqueue(key="k", seconds=60)
    follower = shutdown_tasks.next_holder.enqueue(key="k")
    assert job_row(follower).status == JobStatus.BLOCKED
    # An alive threshold with room: A's claim must still be held once its process is
    # gone (single-process mode), before the heartbeat has aged past it.
    env = {**DEADLINE, "JOBS_INTERRUPT_GRACE": "0.5", "JOBS_ALIVE_THRESHOLD": "5"}
    if supervised:
        # Two worker processes: the other one takes B the moment the slot is freed.
        proc = run_jobs("--processes", "2", "--threads", "2", env=env)
        victim = started(stuck, proc).pid
        os.kill(victim, signal.SIGTERM)
        output = proc.output
    else:
        proc = run_jobs("--single-process", "--threads", "2", env=env)
        victim = started(stuck, proc).pid
        assert victim == proc.pid
        other = run_jobs("--single-process", "--threads", "2", env=env)
        wait_until(lambda: Process.objects.count() == 2, what="the second process registered")
        proc.send(signal.SIGTERM)
        # A stop it was asked for: exit 0, even though it left a body running.
        assert proc.wait(20) == 0, proc.output()
        # Gone, and A's claim (so the slot) still held by its row, which is kept for it.
        claim = ClaimedExecution.objects.select_related("process").get(job_id=int(stuck.id))
        assert claim.process.pid == victim
        assert job_row(follower).status == JobStatus.BLOCKED, proc.output()

        def output() -> str:
            return proc.output() + other.output()

    try:
        wait_until(lambda: job_row(follower).status == JobStatus.SUCCEEDED, 40, what="B ran")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; run_jobs said:\n{output()}") from None
    assert not pid_alive(victim)
    # B saw, as it started, no live process that had run a body of the key.
    assert job_row(follower).return_value == [], output()
    (b_run,) = audits(follower)
    assert b_run.pid != victim
    # A was recorded once its process had gone, not by that process on its way out.
    a_first = audits(stuck)[0]
    assert a_first.ended is None  # its body never ended: the process went with it
    (failure,) = FailedExecution.objects.filter(job_id=int(stuck.id))
    assert failure.exception_class_path == PROCESS_DIED, failure.message
    assert failure.failed_at.timestamp() <= b_run.started
    job = job_row(stuck)
    if supervised:
        assert "could not be interrupted" in failure.message, failure.message
        assert f"worker process {victim} exited, leaving a job" in output()
        # Retried (backoff 0): it waited for B's slot, then its second attempt returned.
        wait_until(lambda: job_row(stuck).status == JobStatus.SUCCEEDED, 30, what="A retried")
        job = job_row(stuck)
        assert (job.attempts, job.return_value) == (2, 2)
        assert audits(stuck)[1].started >= b_run.ended
    else:
        assert "stopped heartbeating" in failure.message, failure.message
        assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
        assert not Process.objects.filter(pid=victim).exists()
    assert error_paths(stuck) == [PROCESS_DIED]
    assert "exiting without settling it" in output()


@pytest.mark.parametrize("mode", MODES)
def test_a_body_in_python_past_the_deadline_is_interrupted_and_recorded(run_jobs, mode):
    """A body running Python at the deadline gets WorkerShutdown raised in it, ends, and
    is recorded by its own thread after it ended: retried while attempts remain, else
    failed. So does one inside a retry loop that swallows every ``Exception`` (once
    an ``Exception`` itself, WorkerShutdown was swallowed there and the body ran on
    past the grace). The process does not wait out the grace and exits normally,
    leaving nothing behind."""
    retried = shutdown_tasks.loops_in_python.using(max_attempts=2).enqueue(key="r", seconds=60)
    failed = shutdown_tasks.loops_in_python.enqueue(key="f", seconds=60)
    swallower = shutdown_tasks.retries_any_error.enqueue(key="s", seconds=60)
    proc = run_jobs(*MODES[mode], env=DEADLINE)
    for result in (retried, failed, swallower):
        started(result, proc)
    began = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    # The deadline (1 s), then well within the grace (5 s): the bodies ended at once.
    assert time.monotonic() - began < 4, proc.output()
    assert (job_row(retried).status, job_row(retried).attempts) == (JobStatus.READY, 1)
    for result in (failed, swallower):
        assert (job_row(result).status, job_row(result).attempts) == (JobStatus.FAILED, 1)
    for result, body in (
        (retried, "loops_in_python"),
        (failed, "loops_in_python"),
        (swallower, "retries_any_error"),
    ):
        (run,) = audits(result)
        (failure,) = FailedExecution.objects.filter(job_id=int(result.id))
        assert failure.exception_class_path == WORKER_SHUTDOWN
        assert failure.message.startswith(INTERRUPTED), failure.message
        # Raised inside the body (its frame is in the traceback), which ended before
        # its attempt was recorded: the slot was freed after the body, not during it.
        assert f"in {body}" in failure.traceback, failure.traceback
        assert run.ended is not None, proc.output()
        assert run.ended <= failure.failed_at.timestamp()
    proc.wait_for_output("interrupting them")
    assert "exiting without settling it" not in proc.output()
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


@pytest.mark.parametrize("mode", MODES)
def test_an_async_body_past_the_deadline_has_its_asyncio_task_cancelled(run_jobs, mode):
    """An ``async def`` body waits in its event loop, where an exception raised in its
    job's thread never lands: at the deadline its asyncio task is cancelled instead.

    One in ``asyncio.sleep(60)`` ends with CancelledError at once and is recorded as
    WorkerShutdown (not CancelledError), retried while attempts remain. One that takes
    the CancelledError as its cue to finish its step, and returns within the grace, is
    a success: nothing is left pending in its thread to turn its return into a
    failure. The process exits without waiting out the 10 s grace, leaving nothing
    behind. Before, the first body ran on until its process exited without it, and
    the second returned only to fail with the WorkerShutdown pending in its thread."""
    cancelled = shutdown_tasks.awaits.using(max_attempts=2).enqueue(seconds=60)
    finishing = shutdown_tasks.awaits.enqueue(seconds=3, finish_when_cancelled=True)
    proc = run_jobs(*MODES[mode], env={**DEADLINE, "JOBS_INTERRUPT_GRACE": "10"})
    started(cancelled, proc)
    started(finishing, proc)
    began = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
    # The deadline (1 s), the finishing body's last seconds, not the 10 s grace.
    assert time.monotonic() - began < 7, proc.output()

    job = job_row(cancelled)
    assert (job.status, job.attempts) == (JobStatus.READY, 1), proc.output()
    (failure,) = FailedExecution.objects.filter(job_id=job.pk)
    assert failure.exception_class_path == WORKER_SHUTDOWN
    assert failure.message.startswith(INTERRUPTED), failure.message
    assert failure.message.endswith(
        f"it raised CancelledError: django-jobs: job {job.pk} interrupted at the shutdown deadline"
    ), failure.message
    (run,) = audits(cancelled)
    assert run.ended is not None and run.ended <= failure.failed_at.timestamp()
    assert run.ended - run.started < 60

    job = job_row(finishing)
    assert (job.status, job.attempts) == (JobStatus.SUCCEEDED, 1), proc.output()
    assert job.return_value == "finished after its CancelledError"
    assert error_paths(finishing) == []

    proc.wait_for_output("interrupting them")
    assert "exiting without settling it" not in proc.output()
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0
