"""Stress: many keyed jobs, real worker processes, failures, retries and a SIGKILL.

The jobs audit their own start and end times; the invariants of docs/design.md
section 5 (1 never over-admitted, 2 never stranded, 3 never lost, 4 attempts
honest, 6 no deadlock) are then proved from that audit, not from the queue's
own bookkeeping. Figures are printed (run with -s to see them).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import defaultdict

import pytest
from django.db import connection

from django_jobs import bulk_enqueue
from django_jobs.models import (
    FINISHED_STATUSES,
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)
from testproject.demo.models import AuditEvent
from tests.harness import max_overlap, wait_until
from tests.stress_tasks import audited

KEYS = 12
MAX_ATTEMPTS = 3


def plan_jobs(count: int, rng: random.Random) -> list[tuple[str, int, float, int]]:
    plans = []
    for _ in range(count):
        key = f"k{rng.randrange(KEYS)}"
        limit = 1 + int(key[1:]) % 3
        duration = rng.choice([0.0, 0.005, 0.01, 0.02, 0.05])
        fail_attempts = rng.choices([0, 1, 2, 3], weights=[70, 15, 10, 5])[0]
        plans.append((key, limit, duration, fail_attempts))
    return plans


@pytest.mark.stress
@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_invariants_hold_under_load_with_a_worker_killed(run_jobs, figure):
    count = int(os.environ.get("STRESS_JOBS", 200 if connection.vendor == "sqlite" else 500))
    seed = int(os.environ.get("STRESS_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    plans = plan_jobs(count, rng)
    results = bulk_enqueue(
        [
            (
                audited.using(concurrency_limit=limit),
                [],
                {
                    "key": key,
                    "limit": limit,
                    "duration": duration,
                    "fail_attempts": fail,
                },
            )
            for key, limit, duration, fail in plans
        ]
    )
    plan_by_job = {int(r.id): plan for r, plan in zip(results, plans, strict=True)}

    began = time.monotonic()
    proc = run_jobs("--processes", "2", "--threads", "4")
    wait_until(
        lambda: AuditEvent.objects.count() >= count // 3, 60, what="a third of the jobs started"
    )
    victim = wait_until(
        lambda: Process.objects.filter(kind="worker").order_by("pk").first(),
        10,
        what="a worker row",
    )
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.time()

    def unfinished() -> int:
        return Job.objects.exclude(status__in=FINISHED_STATUSES).count()

    wait_until(lambda: unfinished() == 0, 180, interval=0.2, what="every job finished")
    elapsed = time.monotonic() - began
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
    assert Process.objects.filter(kind="worker", pid=victim.pid).count() == 0

    # --- Invariant 1: never over-admitted, per key, from what actually ran.
    events = list(AuditEvent.objects.all())
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        by_key[event.key].append((event.started, event.ended if event.ended else killed_at))
    overlap = {key: max_overlap(intervals) for key, intervals in by_key.items()}
    limits = {key: 1 + int(key[1:]) % 3 for key in by_key}
    over = {key: (overlap[key], limits[key]) for key in overlap if overlap[key] > limits[key]}

    # --- Invariant 3: never lost.
    jobs = {job.pk: job for job in Job.objects.all()}
    lost = sorted(set(plan_by_job) - set(jobs))
    leftovers = {
        "ready": ReadyExecution.objects.count(),
        "scheduled": ScheduledExecution.objects.count(),
        "claimed": ClaimedExecution.objects.count(),
        "blocked": BlockedExecution.objects.count(),
    }

    # --- Invariant 2: never stranded; every slot came back.
    leaked = [(s.key, s.value, s.limit) for s in Semaphore.objects.all() if s.value != s.limit]

    # --- Invariant 4 / 5: attempts honest, nothing run twice at once.
    starts: dict[int, list[AuditEvent]] = defaultdict(list)
    for event in events:
        starts[event.job_id].append(event)
    duplicated = [
        job_id
        for job_id, rows in starts.items()
        if len({row.attempt for row in rows}) != len(rows)
        or max_overlap([(r.started, r.ended or killed_at) for r in rows]) > 1
    ]
    failures: dict[int, int] = defaultdict(int)
    died: dict[int, int] = defaultdict(int)
    for job_id, error in FailedExecution.objects.values_list("job_id", "exception_class_path"):
        failures[job_id] += 1
        died[job_id] += error == "django_jobs.exceptions.ProcessDied"
    mismatched = []
    for job_id, job in jobs.items():
        ran = len(starts[job_id])
        expected_failures = job.attempts - (1 if job.status == JobStatus.SUCCEEDED else 0)
        # The one allowance: the SIGKILL can land after an attempt was counted and
        # before the function's first line wrote its audit row. Such an attempt
        # must then have been recovered as ProcessDied.
        unaudited = job.attempts - ran
        if (
            not 0 <= unaudited <= died[job_id]
            or len(job.worker_ids) != job.attempts
            or failures[job_id] != expected_failures
            or (job.status == JobStatus.SUCCEEDED and job.return_value != job.attempts)
            or (job.status == JobStatus.FAILED and job.attempts != MAX_ATTEMPTS)
        ):
            mismatched.append((job_id, job.status, job.attempts, ran, failures[job_id]))

    # --- Invariant 6: no deadlock reported by the database.
    deadlocks = proc.output().lower().count("deadlock")

    succeeded = sum(1 for job in jobs.values() if job.status == JobStatus.SUCCEEDED)
    figure(
        f"stress[{connection.vendor}] seed={seed} jobs={count} keys={len(by_key)} "
        f"elapsed={elapsed:.1f}s ({count / elapsed:.0f} jobs/s) starts={len(events)} "
        f"succeeded={succeeded} failed={count - succeeded} killed_pid={victim.pid}\n"
        f"  max overlap per key (limit): "
        + " ".join(f"{k}={overlap[k]}({limits[k]})" for k in sorted(overlap))
        + f"\n  over-admitted={len(over)} lost={len(lost)} leftovers={leftovers} "
        f"leaked_slots={len(leaked)} duplicated={len(duplicated)} "
        f"attempt_mismatches={len(mismatched)} deadlocks={deadlocks}"
    )
    assert over == {}, f"over-admitted keys (overlap, limit): {over}"
    assert lost == []
    assert leftovers == {"ready": 0, "scheduled": 0, "claimed": 0, "blocked": 0}
    assert leaked == [], f"semaphores not back at their limit: {leaked}"
    assert duplicated == []
    assert mismatched == [], mismatched[:10]
    assert deadlocks == 0, proc.output()[-3000:]
