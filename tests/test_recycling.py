"""Worker recycling with real processes: replaced after N jobs or past a memory limit,
with no job lost, cut short or run twice (issue: memory growth in long-running workers)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from django_jobs.models import FailedExecution, JobStatus, Process
from tests import tasks
from tests.harness import job_row, runs_of, wait_until

# Replacing a worker after N jobs or past a memory limit is the same on every database: tox
# runs this module in one database's environment (pyproject.toml, marker one_database).
pytestmark = [
    pytest.mark.workers,
    pytest.mark.one_database,
    pytest.mark.django_db(transaction=True),
]


def all_succeeded(results) -> bool:
    return all(job_row(r).status == JobStatus.SUCCEEDED for r in results)


def workers_of(results) -> Counter:
    """How many of the jobs each worker process ran (every job ran once)."""
    jobs = [job_row(r) for r in results]
    assert [job.attempts for job in jobs] == [1] * len(jobs)
    return Counter(job.worker_ids[0] for job in jobs)


def test_max_jobs_per_child_replaces_the_worker_after_exactly_n_jobs(run_jobs, tmp_path):
    log = tmp_path / "runs"
    labels = [f"j{i}" for i in range(12)]
    results = [tasks.record_run.enqueue(str(log), label, 0.05) for label in labels]
    proc = run_jobs("--processes", "1", "--threads", "2", "--max-jobs-per-child", "5")
    wait_until(lambda: all_succeeded(results), 60, what="every job succeeded")
    per_worker = workers_of(results)
    assert sorted(per_worker.values()) == [2, 5, 5], per_worker
    assert sorted(runs_of(log)) == sorted(labels)  # each body ran once
    assert not FailedExecution.objects.exists()
    assert proc.count("recycled; starting a fresh one") == 2, proc.output()
    assert "exited unexpectedly" not in proc.output()
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
    assert not Process.objects.exists()


def test_a_recycling_worker_lets_a_long_job_finish_past_the_shutdown_timeout(run_jobs, tmp_path):
    """Nobody is in a hurry: the job is not cut short (and retried) at shutdown_timeout."""
    log = tmp_path / "runs"
    long_job = tasks.record_run.enqueue(str(log), "long", 3.0)
    after = tasks.record_run.using(priority=-1).enqueue(str(log), "after")
    proc = run_jobs(
        "--processes",
        "1",
        "--threads",
        "2",
        "--max-jobs-per-child",
        "1",
        env={"JOBS_SHUTDOWN_TIMEOUT": "0.5"},
    )
    wait_until(lambda: all_succeeded([long_job, after]), 60, what="both jobs succeeded")
    assert len(workers_of([long_job, after])) == 2
    assert runs_of(log) == ["long", "after"]
    assert not FailedExecution.objects.exists()
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()


def test_max_memory_per_child_replaces_the_worker_once_it_has_run_a_job(run_jobs, tmp_path):
    """A limit below any Python process: each worker runs one claim, then makes way."""
    log = tmp_path / "runs"
    results = [tasks.record_run.enqueue(str(log), f"m{i}", 0.0) for i in range(3)]
    proc = run_jobs("--processes", "1", "--threads", "1", "--max-memory-per-child", "1")
    wait_until(lambda: all_succeeded(results), 60, what="every job succeeded")
    assert sorted(workers_of(results).values()) == [1, 1, 1]
    proc.wait_for_output("max_memory_per_child=1")
    assert sorted(runs_of(log)) == ["m0", "m1", "m2"]
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
