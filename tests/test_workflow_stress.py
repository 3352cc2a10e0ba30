"""Workflows under real processes: random graphs, failures, retries, SIGKILLed workers.

About 100 random graphs (2,000 nodes: chains, diamonds, wide fan-ins, random DAGs, some
waiting for a node of an earlier graph) run on ``run_jobs`` (2 processes x 8 threads)
while two busy worker processes are SIGKILLed. The audit is made from what each node's
body recorded itself (tests/workflow_stress_tasks.py) joined with the rows: every node
started only after each dependency succeeded (``run``: ended), ran at most once per
attempt, and nothing is stranded; the policies did what they say. Figures go under
"figures" (the seed with them); ``WORKFLOW_STRESS_SEED``, ``WORKFLOW_STRESS_GRAPHS`` and
``WORKFLOW_STRESS_NODES`` replay or resize a run. The full size (1,000 graphs, 20,000
nodes) is bench/workflow_soak.py.
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection

from tests import workflow_stress_tasks as ws

GRAPHS = int(os.environ.get("WORKFLOW_STRESS_GRAPHS", 100))
NODES = int(os.environ.get("WORKFLOW_STRESS_NODES", 2000))


@pytest.mark.stress
@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_random_workflows_start_after_their_dependencies_once_and_strand_nothing(
    run_jobs, tmp_path, figure
):
    seed = int(os.environ.get("WORKFLOW_STRESS_SEED", time.time_ns() % 1_000_000))
    config = ws.Config(
        graphs=GRAPHS,
        nodes=NODES,
        processes=2,
        threads=8,
        kills=2,
        seed=seed,
        work_dir=tmp_path,
        backlog=300,
        timeout=300.0,
        progress=print,
    )
    report = ws.WorkflowStress(config, lambda args, env: run_jobs(*args, env=env)).run()
    table = report.table()
    figure(f"workflow stress[{connection.vendor}]\n{table}")
    print(table)
    assert report.over() == [], table
    info = report.info
    # The run was real: every kind of end happened.
    assert info["graphs"] >= GRAPHS and info["nodes"] >= NODES, table
    assert info["worker kills"] == 2, table
    assert info["retries"] > 0 and info["succeeded after a retry"] > 0, table
    assert info["failed for good (ran)"] > 0, table
    assert info["ended by dependency (DependencyFailed)"] > 0, table


# --- the generator and the audit, without processes ------------------------------------


def test_the_generator_is_seeded_and_makes_every_shape():
    graphs = ws.generate(7, 100, 2000)
    again = ws.generate(7, 100, 2000)
    assert graphs == again
    assert len(graphs) >= 100 and sum(len(g.nodes) for g in graphs) >= 2000
    assert {g.shape for g in graphs} == set(ws.SHAPES)
    assert any(g.use_chain for g in graphs)
    nodes = [n for g in graphs for n in g.nodes]
    for n in nodes:
        assert all(0 <= i < n.index for i in n.after)
        assert all(g < n.graph for g, _ in n.external)
    assert {n.effective_policy for n in nodes if n.after} == {"cancel", "run", "fail"}
    assert any(n.fails_for_good for n in nodes) and any(n.key for n in nodes)
    assert any(n.external for n in nodes) and any(n.queue != "default" for n in nodes)
    assert any(n.fail_on and not n.fails_for_good for n in nodes)  # retried, then succeeds


def scenario(*, a_fails: bool = False):
    """Graph 0: a; b after a; c after a ("run"); d after b. Lawful rows and records:
    a succeeds (or fails for good: b and d end by DependencyFailed, c runs anyway)."""
    graph = ws.GraphPlan(
        0,
        "dag",
        [
            ws.NodePlan(0, 0, [], fail_on=[1] if a_fails else []),
            ws.NodePlan(0, 1, [0]),
            ws.NodePlan(0, 2, [0], policy="run"),
            ws.NodePlan(0, 3, [1]),
        ],
    )
    job_ids = {(0, i): 10 + i for i in range(4)}
    records = ws.Records()

    def body(job: int, start: float, end: float, ok: bool = True, attempt: int = 1) -> None:
        records.starts[job, attempt].append({"t": start, "pid": 100})
        records.ends[job, attempt].append({"t": end, "ok": ok})

    def row(status: str, attempts: int, finished: float, policy: str | None = "cancel"):
        return ws.JobRow(status, attempts, 1, 1, policy, attempts or None, finished)

    body(10, 1, 2, ok=not a_fails)
    body(12, 3.5, 4.5)
    jobs = {
        10: row("failed" if a_fails else "succeeded", 1, 2.1, None),
        12: row("succeeded", 1, 4.6, "run"),
    }
    failures = {}
    if a_fails:
        failures = {10: [(1, ws.PLANNED_FAILURE)], 11: [(0, ws.DEPENDENCY_FAILED)]}
        failures[13] = [(0, ws.DEPENDENCY_FAILED)]
        jobs[11], jobs[13] = row("failed", 0, 2.1), row("failed", 0, 2.2)
    else:
        body(11, 3, 4)
        body(13, 5, 6)
        jobs[11], jobs[13] = row("succeeded", 1, 4.1), row("succeeded", 1, 6.1)
    snap = ws.Snapshot(
        jobs=jobs,
        edges=[(11, 10, True), (12, 10, True), (13, 11, True)],
        failures=failures,
        workflows={1: None},
        leftovers={"awaiting": 0, "ready": 0},
    )
    return [graph], job_ids, snap, records


def over(graphs, job_ids, snap, records, killed=None) -> dict[str, int]:
    report = ws.audit(graphs, job_ids, snap, records, killed or {}, 0, 8)
    return {f.name: f.value for f in report.over()}


@pytest.mark.parametrize("a_fails", [False, True])
def test_the_audit_passes_a_lawful_run(a_fails):
    assert over(*scenario(a_fails=a_fails)) == {}


def test_the_audit_sees_a_node_started_early_or_twice():
    graphs, job_ids, snap, records = scenario()
    records.starts[11, 1] = [{"t": 1.5, "pid": 100}]  # b before a's end
    records.starts[13, 1].append({"t": 5.5, "pid": 101})  # d's attempt 1 twice
    found = over(graphs, job_ids, snap, records)
    assert found["started before a dependency succeeded"] == 1
    assert found["started before a dependency had ended (its row)"] == 1
    assert found["(job, attempt) started twice"] == 1
    records.starts[14, 2] = [{"t": 9, "pid": 100}]  # a start of no attempt counted
    assert over(graphs, job_ids, snap, records)["body starts beyond the attempts counted"] == 1


def test_the_audit_sees_a_run_anyway_node_started_before_its_dependency_ended():
    graphs, job_ids, snap, records = scenario(a_fails=True)
    records.ends[10, 1] = [{"t": 3.6, "ok": False}]  # a's body still ran when c started
    assert over(graphs, job_ids, snap, records) == {"run anyway before a dependency ended": 1}


def test_the_audit_sees_a_dependent_of_a_failure_that_ran_and_a_stranded_job():
    graphs, job_ids, snap, records = scenario(a_fails=True)
    records.starts[11, 1] = [{"t": 3, "pid": 100}]
    records.ends[11, 1] = [{"t": 4, "ok": True}]
    snap.jobs[11] = ws.JobRow("succeeded", 1, 1, 1, "cancel", 1, 4.1)
    del snap.failures[11]
    snap.jobs[13].status = "awaiting"
    snap.leftovers["awaiting"] = 1
    snap.edges[2] = (13, 11, False)
    found = over(graphs, job_ids, snap, records)
    assert found["started though a dependency did not succeed"] == 1
    assert found["dependents of a failure not ended by DependencyFailed"] == 1
    assert found["jobs not ended"] == 1 and found["execution rows left"] == 1
    assert found["unsettled edges of ended jobs"] == 1
    assert found["ended by DependencyFailed without cause"] == 1  # d: b succeeded


def test_the_audit_bounds_completed_but_failed_bodies_by_the_kills():
    graphs, job_ids, snap, records = scenario()
    # a's attempt 1 returned, then its worker was killed before the success committed.
    snap.failures[10] = [(1, ws.PROCESS_DIED)]
    snap.jobs[10] = ws.JobRow("succeeded", 2, 2, 1, None, 2, 2.6)
    records.starts[10, 2] = [{"t": 2.4, "pid": 101}]
    records.ends[10, 2] = [{"t": 2.5, "ok": True}]
    report = ws.audit(graphs, job_ids, snap, records, {100: 2.2}, 1, 8)
    assert report.figure("completed but failed (ProcessDied)").value == 1
    assert report.over() == []
    assert over(graphs, job_ids, snap, records) == {
        "ProcessDied without a kill": 1,
        "completed but failed (ProcessDied)": 1,
    }


def test_the_audit_takes_a_cancel_while_a_retry_waits_only_from_an_ended_workflow():
    graphs, job_ids, snap, records = scenario()
    # d's attempt 1 died with its worker; waiting for its retry, its workflow's end
    # cancelled it: two errors of attempt 1.
    graphs[0].nodes[3].max_attempts = 2
    snap.jobs[13] = ws.JobRow("failed", 1, 2, 1, "cancel", None, 6.1, cancel_requested=True)
    snap.failures[13] = [(1, ws.PROCESS_DIED), (1, ws.JOB_CANCELLED)]
    records.ends[13, 1] = []
    killed = {100: 5.5}
    found = {f.name: f.value for f in ws.audit(graphs, job_ids, snap, records, killed, 1, 8).over()}
    assert found == {"outcomes not as planned": 1}
    snap.workflows[1] = "failed"
    found = {f.name: f.value for f in ws.audit(graphs, job_ids, snap, records, killed, 1, 8).over()}
    assert found == {"workflows ended without a fail-policy cause": 1}
