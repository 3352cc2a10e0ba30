"""The worker process around ``async def`` jobs (issue 39, items 2 to 4 and its bad input),
with real ``run_jobs`` processes and real signals: a SIGKILL with 500 async jobs in
flight, a graceful stop, the fault-isolation invariant, the connections the async ORM
holds, a body that blocks the loop, and jobs that attack the loop itself.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.db import connection

from django_jobs import bulk_enqueue
from django_jobs.models import (
    FINISHED_STATUSES,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
)
from django_jobs.runtime.worker import unrecorded_bound
from testproject.demo.models import AuditEvent
from tests import async_job_tasks as at
from tests.async_job_tasks import LOOP_THREAD
from tests.harness import error_paths, job_row, wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

PROCESS_DIED = "django_jobs.exceptions.ProcessDied"


# --- a SIGKILL with 500 async jobs in flight --------------------------------------------------

KILL_JOBS, IN_FLIGHT, THREADS = 1500, 500, 2


def test_a_sigkill_with_500_async_jobs_in_flight_loses_none(run_jobs, figure):
    """1,500 async jobs of 1 to 4 s on one worker process with room for 500 at once
    (``--async-jobs 500``); the process is SIGKILLed while it holds 500 claims, at least
    450 bodies in their await (each wrote its start and not its end), and some hundreds
    have ended. Its supervisor recovers the claims and starts another worker: every job
    ends SUCCEEDED (max_attempts=2: a body the kill cut short ran again, its first
    attempt recorded ProcessDied), and a body that completed before the kill ran again
    only within the documented window (docs/running.md, "How much a crash can cost":
    ``2 x threads + async_jobs``), counted from the bodies' own start and end stamps."""
    bulk_enqueue([(at.audited_wait, [1.0 + (i % 60) * 0.05], {}) for i in range(KILL_JOBS)])
    began = time.monotonic()
    proc = run_jobs("--processes", "1", "--threads", str(THREADS), "--async-jobs", str(IN_FLIGHT))
    first_run = AuditEvent.objects.filter(key="kill", attempt=1)

    def loaded() -> tuple[int, int, int] | None:
        claims = ClaimedExecution.objects.count()
        awaiting = first_run.filter(ended__isnull=True).count()
        ended = first_run.filter(ended__isnull=False).count()
        full = claims >= IN_FLIGHT * 0.96 and awaiting >= IN_FLIGHT * 0.9 and ended >= 200
        return (claims, awaiting, ended) if full else None

    claims, awaiting, ended = wait_until(
        loaded, 120, interval=0.02, what="500 jobs in flight and 200 ended"
    )
    os.kill(Process.objects.get(kind="worker").pid, signal.SIGKILL)
    wait_until(
        lambda: not Job.objects.exclude(status__in=FINISHED_STATUSES).exists(),
        240,
        interval=0.2,
        what="every job finished",
    )
    elapsed = time.monotonic() - began
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]

    assert Job.objects.count() == KILL_JOBS
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
    paths = set(FailedExecution.objects.values_list("exception_class_path", flat=True))
    assert paths <= {PROCESS_DIED}
    runs: dict[int, list[AuditEvent]] = {}
    for event in AuditEvent.objects.filter(key="kill").order_by("attempt", "pk"):
        runs.setdefault(event.job_id, []).append(event)
    assert len(runs) == KILL_JOBS  # none lost: every job's body ran
    cut_short = {pk for pk, events in runs.items() if events[0].ended is None}
    completed_twice = {
        pk for pk, events in runs.items() if len(events) > 1 and events[0].ended is not None
    }
    died = set(
        FailedExecution.objects.filter(exception_class_path=PROCESS_DIED).values_list(
            "job_id", flat=True
        )
    )
    # Each body the kill cut short was recorded as a failed attempt and ran again, to its
    # end; no body ran a third time.
    assert cut_short <= died
    assert all(len(runs[pk]) == 2 and runs[pk][1].ended is not None for pk in cut_short)
    assert max(len(events) for events in runs.values()) <= 2
    bound = unrecorded_bound(THREADS, IN_FLIGHT)
    figure(
        f"async sigkill[{connection.vendor}] jobs={KILL_JOBS} at the kill: claims={claims} "
        f"bodies awaiting={awaiting} ended={ended}; cut short={len(cut_short)} "
        f"ProcessDied={len(died)} completed but run again={len(completed_twice)} "
        f"(bound {bound}) elapsed={elapsed:.1f}s"
    )
    assert len(cut_short) >= IN_FLIGHT * 0.9
    assert len(completed_twice) <= bound, sorted(completed_twice)[:20]


def test_successes_the_completer_has_not_written_hold_their_slots_on_the_loop(run_jobs, figure):
    """The lane's part of the window: a body that has returned holds its slot until its
    success is written, so a SIGKILL can cost at most ``async_jobs`` completed async jobs
    (plus the threads' ``2 x threads``). The completer is slowed to one batch a second
    (a database that takes that long to commit); 400 async jobs of 0.05 s; the worker is
    killed once 60 bodies have ended. Before, a slot was free again as soon as its success
    was handed to the completer: the loop ran ahead of the writes, and the kill cost 100
    and more completed jobs with 20 slots."""
    slots = 20
    proc = run_jobs("--processes", "1", "--threads", str(THREADS), "--async-jobs", str(slots))
    slowed = at.slows_the_completer.enqueue(1.0)
    wait_until(lambda: job_row(slowed).status == JobStatus.SUCCEEDED, 30, what="slowed")
    bulk_enqueue([(at.audited_wait, [0.05], {}) for _ in range(400)])
    wait_until(
        lambda: AuditEvent.objects.filter(ended__isnull=False).count() >= 60,
        60,
        what="60 bodies ended",
    )
    os.kill(Process.objects.get(kind="worker").pid, signal.SIGKILL)
    wait_until(
        lambda: not Job.objects.exclude(status__in=FINISHED_STATUSES).exists(),
        120,
        interval=0.2,
        what="every job finished",
    )
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
    first_runs = AuditEvent.objects.filter(key="kill", attempt=1, ended__isnull=False)
    again = set(AuditEvent.objects.filter(key="kill", attempt=2).values_list("job_id", flat=True))
    completed_twice = set(first_runs.values_list("job_id", flat=True)) & again
    bound = unrecorded_bound(THREADS, slots)
    figure(
        f"async window, slowed completer[{connection.vendor}]: completed but run again="
        f"{len(completed_twice)} (bound {bound})"
    )
    assert len(completed_twice) <= bound, sorted(completed_twice)
