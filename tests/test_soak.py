"""The chaos soak (bench/soak.py) in its short form, on the database under test.

About 45 seconds of the soak's mixed workload on real ``run_jobs`` processes
pointed at pytest-django's test database, with worker and supervisor SIGKILLs
and (PostgreSQL, MariaDB) every worker connection terminated, in shuffled
rounds; never a server restart (other tests share the servers). Then the
workers stop, a clean ``run_jobs`` drains what is left, and the audit, made
from the records the job bodies wrote themselves, must put every figure
within its bound. ``SOAK_SECONDS`` and ``SOAK_SEED`` change the length and the
seed (the seed is printed with the table, under "figures").
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection

from bench import soak_tasks
from bench.soak import (
    Config,
    hostile_verdict,
    max_overlap,
    most_in_any_period,
    overlapping_pairs,
    run_soak,
    windows_over_limit,
)
from tests.harness import database_url

SECONDS = float(os.environ.get("SOAK_SECONDS", 45))


@pytest.mark.soak
@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_a_short_chaos_soak_keeps_every_audited_figure_within_its_bound(tmp_path, figure):
    seed = int(os.environ.get("SOAK_SEED", time.time_ns() % 1_000_000))
    config = Config(
        duration=SECONDS,
        processes=2,
        threads=3,
        seed=seed,
        rate=8.0,
        # A fault every 4-7 s: about 8 in 45 s, so each round of kinds comes at least once.
        fault_every=(4.0, 7.0),
        drain_timeout=40.0,
        work_dir=tmp_path,
        database_url=database_url(),
    )
    began = time.monotonic()
    report = run_soak(config)
    table = report.table()
    figure(f"soak[{connection.vendor}] {time.monotonic() - began:.0f}s\n{table}")

    assert report.over() == [], table
    faults = report.info["faults"]
    # The faults happened, and the load was real: a soak that ran nothing proves nothing.
    assert faults.get("kill_worker", 0) >= 1, table
    assert faults.get("kill_supervisor", 0) >= 1, table
    if connection.vendor != "sqlite":
        assert faults.get("connections terminated", 0) >= 1, table
    assert set(report.info["hostile_outcomes"]) == set(soak_tasks.HOSTILE), table
    assert report.info["batches"] >= 1 and report.info["ticks"] >= SECONDS / 2, table
    assert report.info["jobs_total"] >= 5 * SECONDS, table
    assert report.info["statuses"].get("succeeded", 0) >= 3 * SECONDS, table


def test_the_audit_arithmetic_sees_what_it_must():
    """The figures can be non-zero: each measure flags a made-up violation and passes
    its lawful twin."""
    assert max_overlap([(0, 2), (1, 3), (2.5, 4)]) == 2
    assert max_overlap([(0, 1), (1, 2)]) == 1  # an end at t comes before a start at t
    assert overlapping_pairs([(0, 2, 7), (1, 3, 8)]) == 1
    assert overlapping_pairs([(0, 2, 7), (2, 3, 8)]) == 0
    assert overlapping_pairs([(0, 2, 7), (1, 3, 7)]) == 0  # one job: not a unique clash
    assert overlapping_pairs([(0, 2, 1), (1, 3, 2)], same=True) == 1  # two attempts at once
    starts = [0.0, 0.1, 0.2, 0.3, 0.9, 1.0]
    assert most_in_any_period(starts, 1.0) == 5
    assert windows_over_limit(starts, 4, 1.0) == 2  # the periods ending at 0.9 and at 1.0
    assert windows_over_limit([0.0, 0.25, 0.5, 0.75, 1.0, 1.25], 4, 1.0) == 0
    failed = {"status": "failed", "return_value": None}
    assert hostile_verdict("nul_error", failed, [(1, "builtins.ValueError", "bad\\x00m", 0)])
    assert not hostile_verdict("nul_error", failed, [(1, "builtins.ValueError", "", 0)])
    assert not hostile_verdict("nul_error", {"status": "running"}, [])
    succeeded = {"status": "succeeded", "return_value": "a\x00b"}
    assert hostile_verdict("nul_return", succeeded, [])
    assert not hostile_verdict("nul_return", {**succeeded, "return_value": "ab"}, [])
