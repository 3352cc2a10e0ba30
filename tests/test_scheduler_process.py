"""The scheduler in real ``run_jobs`` processes: ticks enqueued, never twice, across a crash.

The recurring task comes from the ``JOBS_RECURRING`` environment variable the
test project reads. Every wait polls a condition (``wait_until``).
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from itertools import pairwise

import pytest

from django_jobs.models import Job, JobStatus, Process, RecurringExecution
from tests.harness import wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

EVERY_SECOND = {
    "JOBS_RECURRING": json.dumps(
        {"tick": {"task": "tests.tasks.echo", "schedule": "every 1 second", "args": ["tick"]}}
    )
}
SECOND = timedelta(seconds=1)


def ticks() -> list:
    return list(RecurringExecution.objects.order_by("run_at").values_list("run_at", flat=True))


def assert_each_tick_once_and_none_missed() -> list:
    """One job per tick (no job outside the tick rows), ticks one second apart."""
    rows = list(RecurringExecution.objects.order_by("run_at").values_list("run_at", "job_id"))
    run_ats = [run_at for run_at, _ in rows]
    job_ids = [job_id for _, job_id in rows]
    assert None not in job_ids and len(set(job_ids)) == len(job_ids)
    jobs = set(Job.objects.filter(task_path="tests.tasks.echo").values_list("pk", flat=True))
    assert jobs == set(job_ids), "a job without its tick row (enqueued twice?)"
    gaps = [b - a for a, b in pairwise(run_ats)]
    assert gaps == [SECOND] * len(gaps), f"ticks missed or repeated: {run_ats}"
    return run_ats


def test_single_process_mode_runs_a_scheduler_thread(run_jobs):
    proc = run_jobs("--single-process", env=EVERY_SECOND)
    wait_until(lambda: len(ticks()) >= 2, what="two ticks enqueued")
    assert_each_tick_once_and_none_missed()
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()


def test_two_supervisors_and_a_killed_scheduler_never_duplicate_a_tick(run_jobs):
    """Two ``run_jobs`` at once, one's scheduler SIGKILLed and replaced, the other stopped:
    every tick has exactly one job, none is missed, and the replacement carries on alone."""
    first, second = run_jobs(env=EVERY_SECOND), run_jobs(env=EVERY_SECOND)
    schedulers = Process.objects.filter(kind=Process.Kind.SCHEDULER)
    wait_until(lambda: schedulers.count() == 2, what="both schedulers registered")
    wait_until(lambda: len(ticks()) >= 2, what="two ticks enqueued")

    supervisor = Process.objects.get(kind=Process.Kind.SUPERVISOR, pid=first.pid)
    victim = schedulers.get(supervisor=supervisor).pid
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: schedulers.filter(supervisor=supervisor).exclude(pid=victim).exists(),
        what="a replacement scheduler",
    )
    assert f"scheduler process {victim} exited unexpectedly" in first.output()
    assert not schedulers.filter(pid=victim).exists()

    second.send(signal.SIGTERM)  # from now on only the replacement can enqueue
    assert second.wait(20) == 0, second.output()
    seen = len(ticks())
    wait_until(lambda: len(ticks()) >= seen + 2, what="two more ticks from the replacement")
    assert_each_tick_once_and_none_missed()
    # The ticks' jobs are ordinary jobs: a worker runs them.
    wait_until(
        lambda: Job.objects.filter(status=JobStatus.SUCCEEDED).exists(), what="a tick's job run"
    )

    first.send(signal.SIGTERM)
    assert first.wait(20) == 0, first.output()
    assert "scheduler stopped" in first.output()
    assert not Process.objects.exists()
    assert_each_tick_once_and_none_missed()
