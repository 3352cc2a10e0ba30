"""Workflows under real processes: the node task, random graphs, the run and its audit.

Shared by tests/test_workflow_stress.py (CI-sized) and bench/workflow_soak.py (the full
size, by hand). ``run_jobs`` processes import this module for :func:`node`.

The node task records its own body: every attempt appends a line to a file of its
worker process when the body begins (job id, attempt, pid, ``time.time()``) and one
when it returns or raises (``ok``: it got to its return). One ``os.write`` per line on
an ``O_APPEND`` descriptor, so threads never interleave inside a line and a SIGKILL
can cut at most the last line of its own process's file. A file, not a table: a
record never depends on the queue's database, nor fails the job.

The graphs (:func:`generate`, seeded): chains (some through ``chain()``), stacked
diamonds, wide fan-ins (1 root -> k middles -> 1 sink, or k roots -> 1 sink) and
random DAGs (each node waits for a random subset of earlier ones); some roots also
wait for a node of a graph enqueued just before (``after=`` on an existing job, which
races with that job's own end). Nodes fail on planned attempts (retries), a few for
good; policies ``cancel`` (the default), ``run`` and, rarely, ``fail``; a few nodes
have a concurrency key, a priority, another queue.

:class:`WorkflowStress` starts ``run_jobs``, enqueues the graphs while they run
(keeping a bounded backlog), SIGKILLs busy worker processes, waits for every job to
end and every edge of an ended job to be settled (a follow-up lost with a killed
process waits for the dispatcher's maintenance sweep, up to ``maintenance_interval``,
60 s) and audits, from the bodies' own records joined with the Job, JobDependency,
FailedExecution and Workflow rows (:func:`audit`). Every figure has a bound (0 but
for the completed-but-failed bodies of docs/design.md invariant 8, 2 x threads a kill).
Deadlocks are figures too (invariant 6): PostgreSQL's count for the database, InnoDB's
status polled for this database's, and ``workflow()`` enqueues a deadlock rolled back.
When a figure is over its bound the report carries the evidence: the rows, records and
log lines of the jobs it names.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connection

from django_jobs import task
from tests.harness import descendant_pids, max_overlap, wait_until

# Seconds a SIGKILL may take to land after the harness reads the time and sends it; a body
# that starts within them in the victim ended with it (the audit's body_end).
KILL_LANDS_WITHIN = 0.5
AUDIT_DIR_ENV = "WORKFLOW_STRESS_DIR"
PLANNED_FAILURE = f"{__name__}.PlannedFailure"
PROCESS_DIED = "django_jobs.exceptions.ProcessDied"
JOB_CANCELLED = "django_jobs.exceptions.JobCancelled"
DEPENDENCY_FAILED = "django_jobs.exceptions.DependencyFailed"

# Concurrency keys of the few keyed nodes, and their limits.
KEYS = {"wfs-k0": 1, "wfs-k1": 2, "wfs-k2": 3}
OTHER_QUEUES = ("reports", "slow")
SHAPES = {"chain": 25, "diamonds": 20, "fan_in": 15, "dag": 40}

# The workers' clocks: harness.FAST_ENV's (heartbeat 0.5 s, dead after 3 s without one,
# so recovery of a killed worker's claims happens within the run), without DEBUG's
# query log growing for the whole run.
WORKER_ENV = {"DEBUG": "false", "JOBS_LOG_LEVEL": "INFO"}


class PlannedFailure(Exception):
    """The failure a node's plan asks of this attempt."""


# --- the task ----------------------------------------------------------------------------

_fd: int | None = None
_fd_pid: int | None = None


def write(record: dict[str, Any]) -> None:
    """Append ``record`` as one line of this process's record file."""
    global _fd, _fd_pid
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:
        path = os.path.join(os.environ[AUDIT_DIR_ENV], f"records-{pid}.jsonl")
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = pid
    os.write(_fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


@task(takes_context=True, max_attempts=1, backoff=0)
def node(context, graph: int, index: int, fail_on: list[int], sleep_ms: float) -> int:
    """One node of a random graph: records its start, sleeps ``sleep_ms``, fails if this
    attempt is in ``fail_on``, records its end. Returns the attempt that succeeded."""
    job, attempt = int(context.task_result.id), context.attempt
    write({"e": "start", "job": job, "attempt": attempt, "pid": os.getpid(), "t": time.time()})
    ok = False
    try:
        if sleep_ms:
            time.sleep(sleep_ms / 1000)
        if attempt in fail_on:
            raise PlannedFailure(
                f"graph {graph} node {index}: planned failure of attempt {attempt}"
            )
        ok = True
        return attempt
    finally:
        write({"e": "end", "job": job, "attempt": attempt, "t": time.time(), "ok": ok})


# --- the graphs ----------------------------------------------------------------------------


@dataclass
class NodePlan:
    graph: int
    index: int
    after: list[int]  # indexes of nodes of its own graph
    external: list[tuple[int, int]] = field(default_factory=list)  # (graph, index) before it
    policy: str | None = None  # None: the task's, "cancel"
    fail_on: list[int] = field(default_factory=list)
    max_attempts: int = 1
    sleep_ms: float = 0.0
    key: str | None = None
    priority: int = 0
    queue: str = "default"

    @property
    def fails_for_good(self) -> bool:
        return all(a in self.fail_on for a in range(1, self.max_attempts + 1))

    @property
    def effective_policy(self) -> str:
        return self.policy or "cancel"

    def task(self) -> Any:
        options: dict[str, Any] = {"max_attempts": self.max_attempts}
        if self.key:
            options.update(concurrency_key=self.key, concurrency_limit=KEYS[self.key])
        if self.priority:
            options["priority"] = self.priority
        if self.queue != "default":
            options["queue_name"] = self.queue
        return node.using(**options)

    def args(self) -> list[Any]:
        return [self.graph, self.index, self.fail_on, self.sleep_ms]


@dataclass
class GraphPlan:
    number: int
    shape: str
    nodes: list[NodePlan]
    use_chain: bool = False  # enqueued through chain() rather than workflow()


def shape_of(kind: str, rng: random.Random) -> list[list[int]]:
    """What each node of a new graph of ``kind`` waits for, by index (earlier ones)."""
    if kind == "chain":
        return [[]] + [[i - 1] for i in range(1, rng.randint(2, 30))]
    if kind == "diamonds":  # 1-3 diamonds in a row, each 2-8 wide
        parents: list[list[int]] = [[]]
        tip = 0
        for _ in range(rng.randint(1, 3)):
            middles = []
            for _ in range(rng.randint(2, 8)):
                parents.append([tip])
                middles.append(len(parents) - 1)
            parents.append(middles)
            tip = len(parents) - 1
        return parents
    if kind == "fan_in":  # wide: 1 root -> k middles -> 1 sink, or k roots -> 1 sink
        k = rng.randint(10, 60)
        if rng.random() < 0.5:
            parents = [[]] + [[0] for _ in range(k)]
            parents.append(list(range(1, k + 1)))
        else:
            parents = [[] for _ in range(k)]
            parents.append(list(range(k)))
        if rng.random() < 0.3:
            parents.append([len(parents) - 1])  # a tail after the sink
        return parents
    # A random DAG: each node waits for a random subset of earlier ones, mostly recent.
    n = rng.randint(5, 40)
    parents = [[]]
    for i in range(1, n):
        if rng.random() < 0.1:
            parents.append([])
            continue
        pool = range(max(0, i - 8), i) if rng.random() < 0.7 else range(i)
        size = min(len(pool), rng.choice([1, 1, 2, 2, 3, 4, 6]))
        parents.append(sorted(rng.sample(pool, size)))
    return parents


def generate(seed: int, graphs: int, nodes: int) -> list[GraphPlan]:
    """At least ``graphs`` graphs and ``nodes`` nodes (about 21 nodes a graph), from
    ``seed``: the same seed, the same graphs."""
    rng = random.Random(seed)
    plans: list[GraphPlan] = []
    total = 0
    while len(plans) < graphs or total < nodes:
        plans.append(make_graph(rng, len(plans), plans))
        total += len(plans[-1].nodes)
    return plans


def make_graph(rng: random.Random, number: int, before: list[GraphPlan]) -> GraphPlan:
    kind = rng.choices(list(SHAPES), weights=list(SHAPES.values()))[0]
    shape = shape_of(kind, rng)
    failing = rng.random() < 0.5  # half the graphs have nodes that fail for good
    use_chain = kind == "chain" and rng.random() < 0.3
    nodes = []
    for index, after in enumerate(shape):
        plan = NodePlan(graph=number, index=index, after=after)
        r = rng.random()
        if failing and r < 0.06:
            plan.max_attempts = rng.choice([1, 2])
            plan.fail_on = list(range(1, plan.max_attempts + 1))
        elif r < 0.21:
            plan.max_attempts = 3
            plan.fail_on = [1] if rng.random() < 0.75 else [1, 2]
        else:
            plan.max_attempts = rng.choice([1, 2, 3])
        if after and not use_chain:
            p = rng.random()
            plan.policy = (
                "fail" if p < 0.02 else "run" if p < 0.2 else "cancel" if p < 0.3 else None
            )
        plan.sleep_ms = rng.choice([0, 0, 1, 2, 5, 10, 20])
        if rng.random() < 0.05:
            plan.key = rng.choice(list(KEYS))
        if rng.random() < 0.1:
            plan.priority = rng.randint(-20, 20)
        if rng.random() < 0.1:
            plan.queue = rng.choice(OTHER_QUEUES)
        nodes.append(plan)
    if not use_chain and number >= 5 and rng.random() < 0.1:
        # A root also waits for a node of a graph enqueued just before, likely running.
        root = rng.choice([plan for plan in nodes if not plan.after])
        for _ in range(rng.randint(1, 2)):
            other = before[rng.randrange(max(0, number - 10), number)]
            pair = (other.number, rng.randrange(len(other.nodes)))
            if pair not in root.external:
                root.external.append(pair)
        if root.policy is None and rng.random() < 0.3:
            root.policy = rng.choice(["run", "cancel", "fail"])
    return GraphPlan(number=number, shape=kind, nodes=nodes, use_chain=use_chain)


def enqueue_graph(plan: GraphPlan, results: dict[tuple[int, int], Any]) -> None:
    """Enqueue one graph (``workflow()``, or ``chain()``); its nodes' results go into
    ``results`` by (graph, index), where later graphs find the external ones."""
    from django_jobs import chain, workflow

    if plan.use_chain:
        made = chain(
            *[(n.task(), n.args(), {}) for n in plan.nodes], name=f"wfs-{plan.number}"
        ).results
    else:
        with workflow(f"wfs-{plan.number}") as wf:
            added: list[Any] = []
            for n in plan.nodes:
                after = [added[i] for i in n.after] + [results[pair] for pair in n.external]
                added.append(
                    wf.add(n.task(), *n.args(), after=after, on_dependency_failure=n.policy)
                )
        made = [a.result for a in added]
    for n, result in zip(plan.nodes, made, strict=True):
        results[n.graph, n.index] = result


# --- what the run leaves: records and rows -----------------------------------------------


@dataclass
class Records:
    """The bodies' own lines: by (job, attempt), every start and every end."""

    starts: dict[tuple[int, int], list[dict]] = field(default_factory=lambda: defaultdict(list))
    ends: dict[tuple[int, int], list[dict]] = field(default_factory=lambda: defaultdict(list))
    cut: int = 0  # lines cut by a SIGKILL while written


def read_records(directory: Path) -> Records:
    records = Records()
    for path in sorted(directory.glob("records-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                records.cut += 1
                continue
            target = records.starts if record["e"] == "start" else records.ends
            target[record["job"], record["attempt"]].append(record)
    return records


@dataclass
class JobRow:
    status: str
    attempts: int
    max_attempts: int
    workflow_id: int | None
    policy: str | None
    return_value: Any = None
    finished_at: float | None = None
    cancel_requested: bool = False


@dataclass
class Snapshot:
    """The rows the audit reads, once everything has ended."""

    jobs: dict[int, JobRow]
    edges: list[tuple[int, int, bool]]  # (job, depends on, settled)
    failures: dict[int, list[tuple[int, str]]]  # job -> (attempt, exception class path)
    workflows: dict[int, str | None]  # workflow -> ended_as
    leftovers: dict[str, int]  # rows of execution tables left
    ended_at: dict[int, float] = field(default_factory=dict)  # ended workflow -> ended_at
    # job -> (attempt, class, message, failed_at), for the evidence of a figure over
    messages: dict[int, list[tuple[int, str, str, float]]] = field(default_factory=dict)


def snapshot() -> Snapshot:
    from django_jobs.models import (
        AwaitingExecution,
        BlockedExecution,
        ClaimedExecution,
        FailedExecution,
        Job,
        JobDependency,
        ReadyExecution,
        ScheduledExecution,
        Workflow,
    )

    jobs = {
        pk: JobRow(
            status=status,
            attempts=attempts,
            max_attempts=max_attempts,
            workflow_id=workflow_id,
            policy=policy,
            return_value=value,
            finished_at=finished.timestamp() if finished else None,
            cancel_requested=cancel is not None,
        )
        for pk, status, attempts, max_attempts, workflow_id, policy, value, finished, cancel in (
            Job.objects.values_list(
                "pk",
                "status",
                "attempts",
                "max_attempts",
                "workflow_id",
                "on_dependency_failure",
                "return_value",
                "finished_at",
                "cancel_requested_at",
            )
        )
    }
    failures: dict[int, list[tuple[int, str]]] = defaultdict(list)
    messages: dict[int, list[tuple[int, str, str, float]]] = defaultdict(list)
    for job_id, attempt, path, message, at in FailedExecution.objects.order_by(
        "attempt", "pk"
    ).values_list("job_id", "attempt", "exception_class_path", "message", "failed_at"):
        failures[job_id].append((attempt, path))
        messages[job_id].append((attempt, path.rsplit(".", 1)[-1], message[:80], at.timestamp()))
    return Snapshot(
        messages=messages,
        jobs=jobs,
        edges=list(JobDependency.objects.values_list("job_id", "depends_on_id", "settled")),
        failures=failures,
        workflows=dict(Workflow.objects.values_list("pk", "ended_as")),
        ended_at={
            pk: at.timestamp()
            for pk, at in Workflow.objects.filter(ended_at__isnull=False).values_list(
                "pk", "ended_at"
            )
        },
        leftovers={
            "awaiting": AwaitingExecution.objects.count(),
            "ready": ReadyExecution.objects.count(),
            "scheduled": ScheduledExecution.objects.count(),
            "blocked": BlockedExecution.objects.count(),
            "claimed": ClaimedExecution.objects.count(),
        },
    )


# --- the audit ---------------------------------------------------------------------------


@dataclass
class Figure:
    name: str
    value: int
    bound: int = 0
    examples: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.value <= self.bound


@dataclass
class Report:
    figures: list[Figure]
    info: dict[str, Any]
    evidence: list[str] = field(default_factory=list)  # rows of the jobs of a figure over

    def over(self) -> list[Figure]:
        return [f for f in self.figures if not f.ok]

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)

    def table(self) -> str:
        info = self.info
        lines = [f"{key}: {value}" for key, value in info.items()]
        width = max(len(f.name) for f in self.figures)
        lines.append(f"{'audit figure':<{width}}  {'value':>6}  {'bound':>6}")
        for f in self.figures:
            mark = "ok" if f.ok else "OVER"
            example = f"  e.g. {f.examples[:5]}" if f.value and f.examples else ""
            lines.append(f"{f.name:<{width}}  {f.value:>6}  {f.bound:>6}  {mark}{example}")
        lines.append(
            "every figure within its bound"
            if not self.over()
            else f"{len(self.over())} figure(s) over their bound"
        )
        if self.evidence:
            lines.append("evidence (times are time.time(), the records' clock):")
            lines += self.evidence
        return "\n".join(lines)


FINISHED = ("succeeded", "failed", "discarded")
FAILED_FOR_GOOD = ("failed", "discarded")


class Counted:
    """Figures by name: a count and the first examples."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.examples: dict[str, list[Any]] = defaultdict(list)

    def add(self, name: str, example: Any) -> None:
        self.counts[name] += 1
        if len(self.examples[name]) < 10:
            self.examples[name].append(example)

    def figure(self, name: str, bound: int = 0) -> Figure:
        return Figure(name, self.counts[name], bound, self.examples[name])


def audit(
    graphs: list[GraphPlan],
    job_ids: dict[tuple[int, int], int],
    snap: Snapshot,
    records: Records,
    killed: dict[int, float],
    kills_wanted: int,
    threads: int,
    pruned: set[int] | None = None,
) -> Report:
    """Every figure of the run, from the bodies' records joined with the rows.

    ``job_ids``: (graph, index) -> job id. ``killed``: pid -> time.time() just before
    its SIGKILL. A body's run is its start record to its end record; without an end,
    to its process's kill (a body that neither ended nor was killed is a figure).
    ``pruned``: worker pids the dispatcher pruned as dead while they lived (a heartbeat
    later than the alive threshold): their claims failed as a kill's would.
    """
    pruned = pruned or set()
    bad = Counted()
    plan_of = {job_ids[n.graph, n.index]: n for g in graphs for n in g.nodes}
    jobs = snap.jobs
    starts, ends = records.starts, records.ends

    # --- the graphs as enqueued: every job, edge and policy as planned
    for pk in set(plan_of) ^ set(jobs):
        bad.add("jobs missing or unplanned", pk)
    planned = {(pk, job_ids[n.graph, i]) for pk, n in plan_of.items() for i in n.after} | {
        (pk, job_ids[pair]) for pk, n in plan_of.items() for pair in n.external
    }
    written = {(job, parent) for job, parent, _ in snap.edges}
    for edge in sorted(planned ^ written):
        bad.add("edges not as planned", edge)
    parents: dict[int, list[int]] = defaultdict(list)
    for job, parent, _ in snap.edges:
        parents[job].append(parent)
    for pk, n in plan_of.items():
        row = jobs.get(pk)
        if row is not None and parents[pk] and (row.policy or "cancel") != n.effective_policy:
            bad.add("policies not as planned", (pk, row.policy, n.policy))

    def body_end(job: int, attempt: int) -> float | None:
        if ends.get((job, attempt)):
            return ends[job, attempt][0]["t"]
        start = starts[job, attempt][0]
        at = killed.get(start["pid"])
        # A body of a killed process ended with it. ``at`` is read just before the SIGKILL,
        # which lands a moment later: a body that started in between (0.2 ms, in one CI
        # run) is the victim's too, and ended at its own start. Later than the bound, the
        # pid was reused by another process.
        if at is None or start["t"] > at + KILL_LANDS_WITHIN:
            return None
        return max(at, start["t"])

    attempts_of: dict[int, list[int]] = defaultdict(list)
    for job, attempt in starts:
        attempts_of[job].append(attempt)

    # --- (b) at most once per attempt, never beyond the attempts counted
    for (job, attempt), found in starts.items():
        if len(found) > 1:
            bad.add("(job, attempt) started twice", (job, attempt, len(found)))
        row = jobs.get(job)
        if row is None or not 1 <= attempt <= row.attempts:
            bad.add("body starts beyond the attempts counted", (job, attempt))
        if body_end(job, attempt) is None:
            bad.add("bodies never ended (and not killed)", (job, attempt))
    for job, row in jobs.items():
        if row.attempts > row.max_attempts:
            bad.add("attempts beyond max_attempts", (job, row.attempts, row.max_attempts))
        runs = sorted(attempts_of[job])
        for earlier, later in itertools.pairwise(runs):
            end = body_end(job, earlier)
            if end is None or starts[job, later][0]["t"] < end:
                bad.add("attempts of one job overlapping", (job, earlier, later))

    # --- (a) a node starts only after each dependency succeeded (run: ended)
    for (job, attempt), found in starts.items():
        at = min(record["t"] for record in found)
        policy = (jobs[job].policy if job in jobs else None) or "cancel"
        for parent in parents[job]:
            p = jobs[parent]
            if p.finished_at is None or p.finished_at >= at:
                bad.add("started before a dependency had ended (its row)", (job, attempt, parent))
            if p.status == "succeeded":
                end = ends.get((parent, p.attempts))
                if not end or not end[0]["ok"] or end[0]["t"] >= at:
                    bad.add("started before a dependency succeeded", (job, attempt, parent))
            elif policy != "run":
                bad.add("started though a dependency did not succeed", (job, attempt, parent))
            elif p.status not in FINISHED:
                bad.add("run anyway before a dependency ended", (job, attempt, parent))
            else:
                for a in attempts_of[parent]:
                    end_at = body_end(parent, a)
                    if end_at is None or end_at >= at:
                        bad.add("run anyway before a dependency ended", (job, attempt, parent))

    # --- (c) nothing stranded
    for job, row in jobs.items():
        if row.status not in FINISHED:
            bad.add("jobs not ended", (job, row.status))
    for table, count in snap.leftovers.items():
        for _ in range(count):
            bad.add("execution rows left", table)
    for job, parent, settled in snap.edges:
        if not settled and jobs[parent].status in FINISHED:
            bad.add("unsettled edges of ended jobs", (job, parent))

    # --- (d) the policies: what a failure for good does to the jobs waiting for it
    fail_caused: set[int] = set()
    for job, row in jobs.items():
        failed_parents = [p for p in parents[job] if jobs[p].status in FAILED_FOR_GOOD]
        policy = row.policy or "cancel"
        ended_workflow = snap.workflows.get(row.workflow_id) if row.workflow_id else None
        paths = [path for _, path in snap.failures.get(job, [])]
        if failed_parents and policy in ("cancel", "fail"):
            allowed = [[DEPENDENCY_FAILED]] + ([[JOB_CANCELLED]] if ended_workflow else [])
            if attempts_of[job] or row.attempts or row.status != "failed" or paths not in allowed:
                bad.add(
                    "dependents of a failure not ended by DependencyFailed",
                    (job, policy, row.status, row.attempts, paths),
                )
            if policy == "fail":
                fail_caused.add(row.workflow_id or 0)
                if ended_workflow != "failed":
                    bad.add("fail policy did not fail its workflow", (job, row.workflow_id))
        if DEPENDENCY_FAILED in paths:
            justified = (failed_parents and policy != "run") or ended_workflow
            if not justified or attempts_of[job] or row.attempts:
                bad.add("ended by DependencyFailed without cause", (job, policy, paths))
        if policy == "run" and failed_parents and not ended_workflow and not row.attempts:
            bad.add("run policy never ran", (job, row.status, paths))
    for workflow_id, ended_as in snap.workflows.items():
        if ended_as is not None and workflow_id not in fail_caused:
            bad.add("workflows ended without a fail-policy cause", (workflow_id, ended_as))

    # --- outcomes: each attempt's end is the plan's, a kill's, or its workflow's cancel
    died_after_body: Counter = Counter()  # pid -> its bodies that returned, then ProcessDied
    for job, row in jobs.items():
        n = plan_of.get(job)
        if n is None:
            continue
        by_attempt: dict[int, list[str]] = defaultdict(list)
        for attempt, path in snap.failures.get(job, []):
            by_attempt[attempt].append(path)
        ended_workflow = snap.workflows.get(row.workflow_id) if row.workflow_id else None
        if row.attempts == 0:
            if row.status != "failed" or len(snap.failures.get(job, [])) != 1:
                bad.add("outcomes not as planned", (job, "never ran", row.status))
            continue
        for attempt in range(1, row.attempts + 1):
            paths = by_attempt.get(attempt, [])
            if attempt == row.attempts and row.status == "succeeded":
                if paths or attempt in n.fail_on or row.return_value != attempt:
                    bad.add("outcomes not as planned", (job, attempt, "succeeded", paths))
                continue
            if (
                attempt == row.attempts
                and ended_workflow
                and len(paths) == 2
                and paths[1] == JOB_CANCELLED
                and paths[0] != JOB_CANCELLED
            ):
                # Its attempt failed (retries left), then its workflow's end cancelled it
                # while it waited for the retry: "cancelled while waiting", same attempt.
                paths = paths[:1]
            if len(paths) != 1:
                bad.add("outcomes not as planned", (job, attempt, row.status, paths))
                continue
            path = paths[0]
            if path == PLANNED_FAILURE:
                if attempt not in n.fail_on:
                    bad.add("outcomes not as planned", (job, attempt, "unplanned failure"))
            elif path == PROCESS_DIED:
                start = starts.get((job, attempt))
                if start and start[0]["pid"] not in killed and start[0]["pid"] not in pruned:
                    bad.add("ProcessDied without a kill", (job, attempt, start[0]["pid"]))
                elif not start and not killed and not pruned:
                    bad.add("ProcessDied without a kill", (job, attempt, None))
                end = ends.get((job, attempt))
                if start and end and end[0]["ok"]:
                    died_after_body[start[0]["pid"]] += 1
            elif path == JOB_CANCELLED:
                if not ended_workflow or attempt != row.attempts:
                    bad.add("outcomes not as planned", (job, attempt, "cancelled"))
            else:
                bad.add("outcomes not as planned", (job, attempt, path))
        if row.status == "failed":
            last = by_attempt.get(row.attempts, [""])[-1]
            retries_left = row.attempts < row.max_attempts and not row.cancel_requested
            if last in (PLANNED_FAILURE, PROCESS_DIED) and retries_left:
                bad.add("outcomes not as planned", (job, "failed with retries left"))
        elif row.status != "succeeded":
            bad.add("outcomes not as planned", (job, row.status))
        if any(attempt > row.attempts for attempt in by_attempt):
            bad.add("outcomes not as planned", (job, "failure beyond its attempts"))

    # --- keys: never more bodies of a key at once than its limit
    audit_time = time.time()
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (job, attempt), found in starts.items():
        n = plan_of.get(job)
        if n is not None and n.key:
            by_key[n.key].append((found[0]["t"], body_end(job, attempt) or audit_time))
    for key, intervals in by_key.items():
        peak = max_overlap(intervals)
        if peak > KEYS[key]:
            bad.add("keys over their limit", (key, peak, KEYS[key]))

    kills = len(killed)
    figures = [
        bad.figure(name)
        for name in (
            "jobs missing or unplanned",
            "edges not as planned",
            "policies not as planned",
            "started before a dependency succeeded",
            "started though a dependency did not succeed",
            "run anyway before a dependency ended",
            "started before a dependency had ended (its row)",
            "(job, attempt) started twice",
            "body starts beyond the attempts counted",
            "attempts beyond max_attempts",
            "attempts of one job overlapping",
            "bodies never ended (and not killed)",
            "jobs not ended",
            "execution rows left",
            "unsettled edges of ended jobs",
            "dependents of a failure not ended by DependencyFailed",
            "ended by DependencyFailed without cause",
            "run policy never ran",
            "fail policy did not fail its workflow",
            "workflows ended without a fail-policy cause",
            "outcomes not as planned",
            "ProcessDied without a kill",
            "keys over their limit",
        )
    ]
    figures.append(Figure("worker kills missing", max(0, kills_wanted - kills)))
    figures.append(Figure("record lines cut", records.cut, kills))
    # docs/design.md invariant 8: what a SIGKILL costs is at most 2 x threads bodies.
    figures.append(
        Figure(
            "completed but failed (ProcessDied)",
            sum(died_after_body.values()),
            (kills + len(pruned)) * 2 * threads,
        )
    )
    figures.append(
        Figure(
            "the most of them by one kill",
            max(died_after_body.values(), default=0),
            2 * threads,
            sorted(died_after_body.items()),
        )
    )

    # --- how long a node waited once its last dependency had ended (a lost follow-up
    # shows here: its level waits for the maintenance sweep)
    waits = []
    for job, row in jobs.items():
        if job in plan_of and plan_of[job].priority < 0:
            continue  # behind the backlog of every higher priority: a wait of its own
        ends_of = [jobs[p].finished_at for p in parents[job] if jobs[p].finished_at]
        if not ends_of or len(ends_of) < len(parents[job]):
            continue
        first = min((starts[job, a][0]["t"] for a in attempts_of[job]), default=None)
        then = first if first is not None else row.finished_at
        if then is not None:
            waits.append((then - max(ends_of), job))
    waits.sort(reverse=True)

    # --- the totals
    statuses = Counter(row.status for row in jobs.values())
    paths_of = {job: [p for _, p in snap.failures.get(job, [])] for job in jobs}
    shapes = Counter(g.shape for g in graphs)
    policies = Counter(n.effective_policy for pk, n in plan_of.items() if parents[pk])
    info = {
        "graphs": len(graphs),
        "shapes": ", ".join(f"{k} {v}" for k, v in sorted(shapes.items()))
        + f" ({sum(g.use_chain for g in graphs)} through chain())",
        "nodes": len(plan_of),
        "edges": f"{len(written)} ({sum(len(n.external) for n in plan_of.values())} "
        "to jobs of an earlier graph)",
        "policies of nodes with dependencies": ", ".join(
            f"{k} {v}" for k, v in sorted(policies.items())
        ),
        "keyed nodes": sum(1 for n in plan_of.values() if n.key),
        "body starts": sum(len(found) for found in starts.values()),
        "retries": sum(1 for _, attempt in starts if attempt > 1),
        "succeeded": statuses.get("succeeded", 0),
        "succeeded after a retry": sum(
            1 for row in jobs.values() if row.status == "succeeded" and row.attempts > 1
        ),
        "failed for good (ran)": sum(
            1 for row in jobs.values() if row.status == "failed" and row.attempts
        ),
        "ended by dependency (DependencyFailed)": sum(
            1 for paths in paths_of.values() if paths == [DEPENDENCY_FAILED]
        ),
        "cancelled by a failed workflow (JobCancelled)": sum(
            1 for paths in paths_of.values() if JOB_CANCELLED in paths
        ),
        "workflows failed by a fail policy": sum(
            1 for ended in snap.workflows.values() if ended == "failed"
        ),
        # Not a figure: a job claimed as its workflow is marked ended may finish before
        # the cancel of the rest reaches it (docs/workflows.md); more than a few is news.
        "started after their workflow ended, never asked to stop": late_note(jobs, snap, starts),
        "longest wait from the last dependency's end to the start (or end by policy; "
        "priority >= 0)": (
            f"{waits[0][0]:.1f}s (job {waits[0][1]}); over 5 s: {sum(w > 5 for w, _ in waits)}"
            if waits
            else "-"
        ),
        "worker kills": kills,
        "workers pruned as dead while alive (heartbeat late)": len(pruned),
        "ProcessDied failures": sum(paths.count(PROCESS_DIED) for paths in paths_of.values()),
        "completed but failed (ProcessDied)": sum(died_after_body.values()),
    }
    report = Report(figures, info)
    report.evidence = evidence(report, plan_of, snap, records, parents)
    return report


def evidence_jobs(line: str) -> list[int]:
    match = re.match(r"  job (\d+) \(", line)
    return [int(match.group(1))] if match else []


def job_ids_in(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (tuple, list)):
        return [pk for item in value for pk in job_ids_in(item)]
    return []


def evidence(
    report: Report,
    plan_of: dict[int, NodePlan],
    snap: Snapshot,
    records: Records,
    parents: dict[int, list[int]],
) -> list[str]:
    """What the rows and records say of the first jobs a figure over its bound names,
    and of what they wait for: enough to write the reproduction down."""
    wanted: list[int] = []
    for f in report.over():
        for example in f.examples[:3]:
            for pk in job_ids_in(example):
                if pk in snap.jobs and pk not in wanted:
                    wanted.append(pk)
    for pk in list(wanted):
        wanted += [p for p in parents.get(pk, []) if p not in wanted]
    children: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    for job, parent, settled in snap.edges:
        children[parent].append((job, settled))
    settled_of = {(job, parent): settled for job, parent, settled in snap.edges}
    lines = []
    for pk in wanted[:12]:
        row, n = snap.jobs[pk], plan_of.get(pk)
        where = f"graph {n.graph} node {n.index}" if n else "unplanned"
        wf = row.workflow_id
        lines.append(
            f"  job {pk} ({where}): {row.status}, attempts {row.attempts}/{row.max_attempts}, "
            f"policy {row.policy}, finished {row.finished_at}, cancel requested "
            f"{row.cancel_requested}, workflow {wf} ended {snap.workflows.get(wf)} at "
            f"{snap.ended_at.get(wf)}"
        )
        waits = [(p, settled_of[pk, p], snap.jobs[p].status) for p in parents.get(pk, [])]
        lines.append(f"    waits for (job, settled, status): {waits}")
        lines.append(f"    waited for by (job, settled): {children.get(pk, [])}")
        lines.append(f"    errors: {snap.messages.get(pk, [])}")
        bodies = [
            (
                attempt,
                found[0]["pid"],
                found[0]["t"],
                [(e["t"], e["ok"]) for e in records.ends.get((job, attempt), [])],
            )
            for (job, attempt), found in records.starts.items()
            if job == pk
        ]
        lines.append(f"    bodies (attempt, pid, start, ends): {sorted(bodies)}")
    return lines


def late_note(jobs: dict[int, JobRow], snap: Snapshot, starts: dict) -> str:
    late = sorted(
        {
            job
            for (job, _), found in starts.items()
            if (row := jobs.get(job)) is not None
            and row.workflow_id in snap.ended_at
            and found[0]["t"] > snap.ended_at[row.workflow_id]
            and not row.cancel_requested
        }
    )
    return f"{len(late)}" + (f" (jobs {late[:10]})" if late else "")


# --- the run -------------------------------------------------------------------------------


@dataclass
class Config:
    graphs: int = 100
    nodes: int = 2000
    processes: int = 2
    threads: int = 8
    kills: int = 2
    seed: int = 0
    work_dir: Path = Path("/tmp")
    # Most jobs not ended before the driver enqueues another graph: the enqueue goes on
    # while the workers run (and roots wait for jobs that may be ending right then).
    backlog: int = 400
    timeout: float = 600.0  # the whole run, enqueue and drain
    progress: Callable[[str], None] | None = None


# (arguments, extra environment) -> a started run_jobs
Start = Callable[[list[str], dict[str, str]], Any]


class WorkflowStress:
    """One run: start ``run_jobs``, enqueue the graphs while it runs, kill busy
    workers, wait for every job to end, stop it, audit."""

    def __init__(self, config: Config, start: Start) -> None:
        self.config = config
        self.start = start
        self.records_dir = config.work_dir / "records"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.graphs = generate(config.seed, config.graphs, config.nodes)
        self.total = sum(len(g.nodes) for g in self.graphs)
        self.results: dict[tuple[int, int], Any] = {}
        self.killed: dict[int, float] = {}
        self.victims: list[int] = []  # Process rows of the killed workers
        self.kill_notes: list[str] = []
        self.supervisor: Any = None
        self.due_since: float | None = None  # when the next kill became due
        self.enqueue_deadlocks: list[str] = []

    def say(self, message: str) -> None:
        if self.config.progress:
            self.config.progress(message)

    def ended(self) -> int:
        from django_jobs.models import FINISHED_STATUSES, Job

        return Job.objects.filter(status__in=FINISHED_STATUSES).count()

    def unended(self) -> int:
        from django_jobs.models import FINISHED_STATUSES, Job

        return Job.objects.exclude(status__in=FINISHED_STATUSES).count()

    def maybe_kill(self) -> None:
        """SIGKILL the busiest worker process (the most claims) once the run has got
        far enough: the k-th kill after k/(kills+1) of the nodes have ended."""
        from django.db.models import Count

        from django_jobs.models import ClaimedExecution, Process

        done = len(self.victims)
        if done >= self.config.kills:
            return
        if self.ended() < self.total * (done + 1) / (self.config.kills + 1):
            return
        # Busy: holding half its threads' worth of claims, or any after 10 s of waiting.
        self.due_since = self.due_since or time.monotonic()
        least = 1 if time.monotonic() - self.due_since > 10 else max(1, self.config.threads // 2)
        ours = set(descendant_pids(self.supervisor.pid))  # forks of its warm parent
        busy = (
            ClaimedExecution.objects.filter(process__kind=Process.Kind.WORKER)
            .values_list("process_id", "process__pid")
            .annotate(n=Count("pk"))
            .order_by("-n")
        )
        for process_id, pid, claims in busy:
            if pid in ours and pid not in self.killed and claims >= least:
                self.due_since = None
                self.killed[pid] = time.time()
                os.kill(pid, signal.SIGKILL)
                self.victims.append(process_id)
                note = (
                    f"SIGKILL worker pid {pid} holding {claims} claims at {self.ended()} "
                    f"ended (t={self.killed[pid]:.3f})"
                )
                self.kill_notes.append(note)
                self.say(note)
                return

    def enqueue(self, plan: GraphPlan) -> None:
        """Enqueue a graph; one the database chose as a deadlock victim is enqueued again,
        as the error says to (nothing of it was written), and counted: a figure."""
        from django.db import OperationalError

        for _ in range(5):
            try:
                enqueue_graph(plan, self.results)
                return
            except OperationalError as exc:
                if "deadlock" not in str(exc).lower():
                    raise
                self.enqueue_deadlocks.append(f"graph {plan.number}: {str(exc).splitlines()[0]}")
                self.say(f"the enqueue of graph {plan.number} was a deadlock's victim: again")
        enqueue_graph(plan, self.results)

    def run(self) -> Report:
        from django_jobs.models import FINISHED_STATUSES, ClaimedExecution, JobDependency, Process
        from django_jobs.runtime.worker import unrecorded_bound

        config = self.config
        assert unrecorded_bound(config.threads) == 2 * config.threads  # the audit's bound
        self.say(
            f"seed {config.seed}: {len(self.graphs)} graphs, {self.total} nodes, "
            f"{config.processes} processes x {config.threads} threads, {config.kills} kills"
        )
        deadlocks_before = server_deadlocks()
        watch = InnoDBDeadlocks() if connection.vendor == "mysql" else None
        began = time.monotonic()
        deadline = began + config.timeout
        self.supervisor = self.start(
            ["--processes", str(config.processes), "--threads", str(config.threads)],
            {**WORKER_ENV, AUDIT_DIR_ENV: str(self.records_dir)},
        )
        wait_until(
            lambda: Process.objects.filter(kind="worker").count() >= config.processes,
            60,
            what="the workers to register",
        )
        for number, plan in enumerate(self.graphs):
            while self.unended() > config.backlog:
                self.maybe_kill()
                time.sleep(0.05)
                if time.monotonic() > deadline:
                    raise AssertionError(f"the backlog never came down ({self.unended()})")
            self.enqueue(plan)
            if number % 5 == 0:
                self.maybe_kill()
        enqueued = time.monotonic() - began
        self.say(f"enqueued in {enqueued:.1f}s; waiting for every job to end")

        all_ended: list[float] = []

        def settled() -> bool:
            self.maybe_kill()
            if (
                self.unended()
                or ClaimedExecution.objects.exists()
                or Process.objects.filter(pk__in=self.victims).exists()
            ):
                return False
            all_ended[:] = all_ended or [time.monotonic()]
            # A kill between a commit and its follow-up leaves the edges of what that
            # commit ended by policy unsettled until the dispatcher's maintenance sweep
            # (maintenance_interval, 60 s; docs/workflows.md "After a crash"): wait for it.
            return not JobDependency.objects.filter(
                settled=False, depends_on__status__in=FINISHED_STATUSES
            ).exists()

        try:
            wait_until(settled, max(1.0, deadline - time.monotonic()), 0.2, "every job to end")
        except AssertionError as exc:
            self.say(f"not settled: {exc}")
        elapsed = time.monotonic() - began
        swept_after = time.monotonic() - all_ended[0] if all_ended else None
        self.supervisor.send(signal.SIGTERM)
        code = self.supervisor.wait(60)
        output = self.supervisor.output()
        job_ids = {pair: int(result.id) for pair, result in self.results.items()}
        # A worker the dispatcher pruned while it lived (its heartbeat later than the
        # alive threshold: SQLite's one writer on a loaded machine) stops, its claims
        # failed as a kill's: said, and counted like one (bench/soak.py does the same).
        pruned = {
            int(pid)
            for pid in re.findall(r"pruned dead process \S+-(\d+)-\w+;", output)
            if int(pid) not in self.killed
        }
        report = audit(
            self.graphs,
            job_ids,
            snapshot(),
            read_records(self.records_dir),
            self.killed,
            config.kills,
            config.threads,
            pruned,
        )
        deadlocks = server_deadlocks()
        if deadlocks is not None and deadlocks_before is not None:
            deadlocks -= deadlocks_before
        seen = watch.stop() if watch is not None else []
        expected = ["job failed", "(code -9)"]
        for pid in pruned:
            expected += [f"[{pid}] ERROR django_jobs.runner: process row", f"{pid} exited unexpect"]
        errors = [
            line[-300:]
            for line in output.splitlines()
            if " ERROR " in line and not any(text in line for text in expected)
        ]
        if report.evidence:
            for pk in sorted({pk for line in report.evidence for pk in evidence_jobs(line)}):
                said = [
                    line[:260]
                    for line in output.splitlines()
                    if f"job={pk} " in line or f" {pk}: '" in line or f"#{pk} " in line
                ]
                report.evidence += [f"  log of job {pk}: {line}" for line in said[:6]]
        report.figures += [
            Figure("run_jobs exit code", abs(code)),
            Figure("deadlocks in the logs", output.lower().count("deadlock")),
            # docs/design.md invariant 6: no deadlock (InnoDB's unique inserts apart).
            Figure(
                "workflow() enqueues a deadlock rolled back",
                len(self.enqueue_deadlocks),
                0,
                self.enqueue_deadlocks,
            ),
            Figure("tracebacks in the logs", output.count("Traceback (most recent call last)")),
            Figure("errors in the logs (not a job's, not a kill's)", len(errors), 0, errors),
        ]
        if connection.vendor == "postgresql":  # counted per database: this run's
            report.figures.append(Figure("deadlocks PostgreSQL counted", deadlocks or 0))
        # A kill between a commit and its follow-up (the next level of DependencyFailed,
        # core/dependencies.py) leaves that level to the dispatcher's maintenance sweep.
        swept = sum(int(n) for n in re.findall(r"settled (\d+) workflow step", output))
        report.info = {
            "seed": config.seed,
            "workers": f"{config.processes} processes x {config.threads} threads",
            "elapsed": f"{elapsed:.1f}s (enqueue {enqueued:.1f}s, then the drain "
            f"{elapsed - enqueued:.1f}s), "
            f"{report.info['body starts'] / max(elapsed, 0.001):.0f} body starts/s",
            **report.info,
            "kills": "; ".join(self.kill_notes),
            "workflow steps the maintenance sweep settled (follow-ups lost with a kill)": swept,
            "waited for the sweep, once every job had ended": "never ended"
            if swept_after is None
            else f"{swept_after:.1f}s",
        }
        if watch is not None:
            # InnoDB counts deadlocks for the whole server (other databases' tests too):
            # the figure is those its status reported on this database, polled (at least
            # that many). One whose victim was a follow-up (after a commit) is logged
            # nowhere with DEBUG off: Django logs it on a logger nothing shows.
            report.figures.append(
                Figure("deadlocks InnoDB reported on this database (polled)", len(seen), 0, seen)
            )
            report.info["InnoDB deadlocks during the run (the whole server)"] = deadlocks
        return report


def server_deadlocks() -> int | None:
    """Deadlocks the server has counted: PostgreSQL's of this database, InnoDB's of the
    whole server; None on SQLite (one writer at a time)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            )
            return int(cursor.fetchone()[0])
        if connection.vendor == "mysql":
            cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
            row = cursor.fetchone()
            return int(row[1]) if row else None
    return None


class InnoDBDeadlocks:
    """Polls ``SHOW ENGINE INNODB STATUS`` in a thread of its own and keeps each new
    "latest detected deadlock" that names a table of this database, condensed to its
    statements and its victim (InnoDB shows only the last one: polled, it sees at least
    one of two that come within a poll)."""

    def __init__(self, interval: float = 0.1) -> None:
        import threading

        self.interval = interval
        self.found: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="innodb-deadlocks", daemon=True)
        self.thread.start()

    def run(self) -> None:
        from django.db import connections

        name = connection.settings_dict["NAME"]
        last = None  # the deadlock shown when the watch began, older than the run
        try:
            while True:
                with connections["default"].cursor() as cursor:
                    cursor.execute("SHOW ENGINE INNODB STATUS")
                    status = cursor.fetchone()[2]
                section = ""
                if "LATEST DETECTED DEADLOCK" in status:
                    section = status.split("LATEST DETECTED DEADLOCK", 1)[1]
                    section = section.split("\nTRANSACTIONS")[0]
                if last is not None and section != last and f"`{name}`." in section:
                    self.found.append(condensed(section))
                last = section
                if self.stopping.wait(self.interval):
                    break
        except Exception as exc:  # no PROCESS privilege, say: said, not hidden
            self.found.append(f"could not read InnoDB's status: {exc}")
        finally:
            connections["default"].close()

    def stop(self) -> list[str]:
        self.stopping.set()
        self.thread.join(30)
        return self.found


def condensed(section: str) -> str:
    """A deadlock of InnoDB's status: when, each transaction's statement, the victim."""
    keep = []
    for line in section.splitlines():
        if line.startswith(("20", "UPDATE", "DELETE", "INSERT", "SELECT", "*** WE ROLL")):
            keep.append(line.strip()[:300])
    return " | ".join(keep)
