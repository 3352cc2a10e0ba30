"""The chaos soak (bench/soak.py) in its short form, on the database under test.

About 45 seconds of the soak's mixed workload on real ``run_jobs`` processes
pointed at pytest-django's test database, its fair queue's tenants included (a
heavy one's backlogs, light ones' jobs sent into them), with worker and
supervisor SIGKILLs and (PostgreSQL, MariaDB) every worker connection
terminated, in shuffled rounds; never a server restart (other tests share the
servers). Then the workers stop, a clean ``run_jobs`` drains what is left, and
the audit, made from the records the job bodies wrote themselves, must put
every figure within its bound, the fair jobs' shares of the claims included.
``SOAK_SECONDS`` and ``SOAK_SEED`` change the length and the seed (the seed is
printed with the table, under "figures").
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection

from bench import soak_tasks
from bench.soak import (
    Config,
    beside_backlogs,
    hostile_verdict,
    max_overlap,
    most_in_any_period,
    overlapping_pairs,
    run_soak,
    share_excesses,
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
    # The share audit had material: light tenants' jobs enqueued beside a backlog that FIFO
    # order would have run first, past their share.
    assert report.info["jobs_by_kind"].get("fair", 0) >= 2 * SECONDS, table
    assert report.info["fair_shares"]["light_beside_backlogs"] >= 3, table


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


def test_the_share_audit_flags_fifo_order_and_passes_fair_order():
    """Fifty jobs of "bulk" (weight 1) enqueued at 0.5 s, claimed one each 0.1 s from 1.1 s;
    two of "light" (weight 0.5) enqueued at 2.05 s, when ten of bulk's have been claimed."""
    weights = {"bulk": 1.0, "light": 0.5}
    bulk = [(1.0 + i / 10, i, "bulk") for i in range(1, 51)]
    waits = {51: ("light", 2.05, 0.0), 52: ("light", 2.05, 0.0)}

    def audit(first: dict[int, float]) -> dict:
        claims = [*bulk, *((at, job, "light") for job, at in first.items())]
        made = {job: (group, began, first[job]) for job, (group, began, _) in waits.items()}
        return share_excesses(made, claims, weights)

    # Start-time fair queuing: the first light job at the head (behind bulk's job there, the
    # older), the second two of bulk's turns later: 1 and 3 of bulk's claims, their shares
    # 1 * 1 / 0.5 + 1 and 1 * 2 / 0.5 + 1.
    fair = audit({51: 2.12, 52: 2.32})
    assert [(s.other, s.claims, s.bound) for s in fair.values()] == [("bulk", 1, 3), ("bulk", 3, 5)]
    assert all(s.excess <= 0 and s.contested for s in fair.values())
    # FIFO order: both wait for the forty of bulk's left.
    fifo = audit({51: 6.05, 52: 6.06})
    assert [(s.claims, s.bound) for s in fifo.values()] == [(40, 3), (40, 5)]
    assert all(s.excess > 16 for s in fifo.values())

    # The material: both waits began beside 40 of bulk's waiting, over share + tolerance 16
    # (not over 40: a backlog the tolerance hides is no test of the order).
    enqueued = {job: ("bulk", 0.5) for _, job, _ in bulk}
    enqueued |= {51: ("light", 2.05), 52: ("light", 2.05)}
    first = {job: at for at, job, _ in bulk} | {51: 2.12, 52: 2.32}
    made = {job: (group, began, first[job]) for job, (group, began, _) in waits.items()}
    assert beside_backlogs(made, enqueued, first, weights, 16) == {51, 52}
    assert beside_backlogs(made, enqueued, first, weights, 40) == set()
