"""The enqueue of jobs that wait for others: one enqueue's calls and what each waits for
(its ``Graph``), written as nodes of one workflow, inside the enqueue's transaction.

It locks the rows of the existing jobs it waits for (ascending, before anything else) and
reads their status under that lock, and marks each with a workflow, the mark a finish
reads under the same lock: a parent ending as an edge to it is written is either seen
ended (counted at once) or sees the edge. It takes no semaphore after those rows (the
lock order of ``core/dependencies.py``): a job with a concurrency key goes in scheduled,
due now, and is admitted after the commit. What happens when a job it waits for ends is
``core/dependencies.py``.

In its own transaction it waits for none of those rows: a finish holds the rows of the jobs
it ends and then takes their dependents' (to make them ready), an order no order of parents
can follow (the job ended and the dependent are any two of the enqueue's parents), so an
enqueue that held a dependent while waiting for the ended job deadlocked with the finish
(InnoDB, the workflow stress test). It locks them all or none (``NOWAIT``); when one is
held, it rolls back, holding nothing, and runs again (``core.attempts``).
Inside the caller's ``atomic()`` it cannot roll back alone, and waits as before.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from django.db import OperationalError
from django.tasks import Task

from django_jobs.core.attempts import ParentsBusy
from django_jobs.core.batches import count_outcomes, current_job_id
from django_jobs.core.dependencies import (
    FAILED_PARENT_STATUSES,
    batch_failures,
    end_dependents,
    end_workflows,
    ended_workflows,
    release,
    unfinished_statuses,
)
from django_jobs.core.uniqueness import error_code
from django_jobs.db import ops
from django_jobs.exceptions import InvalidDependency
from django_jobs.models import (
    FINISHED_STATUSES,
    AwaitingExecution,
    DependencyFailure,
    Job,
    JobDependency,
    JobStatus,
    Workflow,
)
from django_jobs.tasks.job_task import Dependency


@dataclass
class Graph:
    """What an enqueue's calls wait for, by the index of each call.

    ``after[i]``: what call ``i`` waits for, in order: the index of another call of the
    same enqueue (always a smaller one: the calls come in an order where every call
    follows what it waits for) or a :class:`Dependency` on a job that exists already.
    ``policies[i]``: call ``i``'s ``on_dependency_failure`` where the builder set one
    (else its task's). ``name``: the workflow's, when a new one is made.
    """

    after: dict[int, list[int | Dependency]] = field(default_factory=dict)
    policies: dict[int, str] = field(default_factory=dict)
    # The batch a call is an item of (a workflow's batch node), by index.
    batches: dict[int, Any] = field(default_factory=dict)
    name: str = ""
    # True for ``workflow()``'s graph: a new workflow. False (``using(after=...)`` alone):
    # the jobs join the workflow of the first job they wait for that has one.
    new: bool = False
    # Filled by the enqueue: the workflow the calls became nodes of.
    workflow_id: int | None = None

    def external(self) -> set[int]:
        return {
            item.job_id
            for items in self.after.values()
            for item in items
            if isinstance(item, Dependency)
        }


def graph_of(prepared: Sequence[tuple[Job, Task]], graph: Graph | None) -> Graph | None:
    """The graph of an enqueue: the builder's, plus each call's ``using(after=...)``.
    None when no call waits for anything and no workflow was asked for."""
    found = graph
    for index, (_, task) in enumerate(prepared):
        after = getattr(task, "after", ())  # a JobTask's; a plain Task waits for nothing
        if not after:
            continue
        if found is None:
            found = Graph()
        found.after.setdefault(index, []).extend(after)
    return found


def check_databases(db: str, graph: Graph, backends: Mapping[str, str]) -> None:
    """Refuse a dependency on a job of another database: no transaction can hold both."""
    for items in graph.after.values():
        for item in items:
            if isinstance(item, Dependency) and item.backend is not None:
                other = backends.get(item.backend)
                if other is not None and other != db:
                    raise InvalidDependency(
                        f"after= names job {item.job_id} of backend {item.backend!r}, whose "
                        f"database ({other!r}) is not this job's ({db!r}): a job can only "
                        "wait for jobs in its own database"
                    )


@dataclass
class ParentRow:
    status: str
    workflow_id: int | None


# The errors of a locking read that would have waited (NOWAIT): PostgreSQL's
# lock_not_available; MariaDB's lock wait timeout, which is what its NOWAIT raises;
# MySQL 8's ER_LOCK_NOWAIT.
LOCK_NOT_AVAILABLE = "55P03"
MYSQL_NOWAIT_ERRORS = (1205, 3572)


def is_lock_busy(exc: OperationalError) -> bool:
    code = error_code(exc)
    return code in MYSQL_NOWAIT_ERRORS or code == LOCK_NOT_AVAILABLE


def lock_parents(db: str, ids: Collection[int], *, wait: bool = True) -> dict[int, ParentRow]:
    """Lock the rows of the existing jobs ``ids`` (ascending) and read their state under
    the lock; refuse an id of no job. ``wait=False``: all of them at once or none, raising
    :class:`ParentsBusy` if one is held (the module's docstring says why)."""
    if not ids:
        return {}
    rows = (
        Job.objects.using(db)
        .select_for_update(nowait=not wait)
        .filter(pk__in=sorted(ids))
        .order_by("pk")
        .values_list("pk", "status", "workflow_id")
    )
    try:
        found = {pk: ParentRow(status, workflow_id) for pk, status, workflow_id in rows}
    except OperationalError as exc:
        if wait or not is_lock_busy(exc):
            raise
        raise ParentsBusy(f"a job of {sorted(ids)} is locked by another transaction") from exc
    missing = sorted(set(ids) - set(found))
    if missing:
        raise InvalidDependency(
            f"after= names job {missing[0]}, which does not exist (pruned, or never enqueued)"
        )
    return found


def mark_parents(db: str, parents: Mapping[int, ParentRow], workflow_id: int) -> None:
    """Give a workflow to the locked parents that have none and have not ended: the mark
    a finish reads to know the job has dependents."""
    unmarked = [
        pk
        for pk, row in parents.items()
        if row.workflow_id is None and row.status not in FINISHED_STATUSES
    ]
    if unmarked:
        Job.objects.using(db).filter(pk__in=unmarked, workflow__isnull=True).update(
            workflow_id=workflow_id
        )
        for pk in unmarked:
            parents[pk].workflow_id = workflow_id


def new_workflow(db: str, graph: Graph, parents: Mapping[int, ParentRow]) -> int:
    """The workflow the calls join: the builder's new one, else the first parent's that
    has one, else a new one (``using(after=...)`` on jobs of no workflow)."""
    if not graph.new:
        for pk in sorted(parents):
            if parents[pk].workflow_id is not None:
                return cast(int, parents[pk].workflow_id)
    workflow = Workflow.objects.using(db).create(
        name=graph.name[:255], parent_job_id=current_job_id.get()
    )
    return workflow.pk


def write_graph(
    db: str,
    prepared: Sequence[tuple[Job, Task]],
    graph: Graph,
    insert_unique: Any,
    unique_order: Iterable[int],
    *,
    wait_for_parents: bool = True,
) -> dict[int, Job]:
    """Write the jobs of one enqueue that has dependencies, inside the caller's transaction.

    Every job becomes a node of one workflow. A job whose dependencies have all
    succeeded already (or has none) is made runnable as any enqueue would, except that
    one with a concurrency key goes in scheduled, due now (no semaphore after the
    parents' rows, see the module's lock order) and is admitted after the commit. A job
    whose dependency has failed for good meets its policy at once. The others wait,
    ``AWAITING``. Returns the holders of unique keys already taken, by call index: such
    a call's node is the holder, and what waits for it waits for the holder.
    ``wait_for_parents=False``: :class:`ParentsBusy` where a parent's row is held.
    """
    jobs = [job for job, _ in prepared]
    parents = lock_parents(db, graph.external(), wait=wait_for_parents)
    workflow_id = new_workflow(db, graph, parents)
    graph.workflow_id = workflow_id
    mark_parents(db, parents, workflow_id)
    waits = {index for index, items in graph.after.items() if items}
    for index, (job, task) in enumerate(prepared):
        job.workflow_id = workflow_id
        if index in waits:
            job.status = JobStatus.AWAITING
            job.on_dependency_failure = graph.policies.get(index) or getattr(
                task, "on_dependency_failure", DependencyFailure.CANCEL
            )
    seam = ops(db)
    seam.insert_jobs(db, [job for job in jobs if job.unique_lock is None])
    holders: dict[int, Job] = {}
    for index in unique_order:
        holder = insert_unique(db, jobs[index])
        if holder is not None:
            holders[index] = holder
    waited_for = {item for items in graph.after.values() for item in items if isinstance(item, int)}
    held = lock_parents(
        db, {holders[i].pk for i in waited_for if i in holders}, wait=wait_for_parents
    )
    mark_parents(db, held, workflow_id)
    node = {
        index: (holders[index].pk if index in holders else job.pk) for index, job in enumerate(jobs)
    }
    state: dict[int, str] = {}  # a node's state as its dependents see it
    for index in range(len(jobs)):
        if index in holders:
            state[index] = held[holders[index].pk].status if index in waited_for else "pending"
        else:
            state[index] = "pending"
    edges: list[JobDependency] = []
    awaiting: list[AwaitingExecution] = []
    ended: dict[int, str] = {}  # job id -> the dependency whose failure ended it
    runnable: list[Job] = []
    failing_workflow = False
    # Joining a workflow that has ended (using(after=...) on one of its jobs): the job
    # ends at once, as its jobs that were waiting did.
    closed = not graph.new and bool(ended_workflows(db, [workflow_id]))
    for index, job in enumerate(jobs):
        if index in holders:
            continue
        if index not in waits:
            if closed:
                ended[job.pk] = "its workflow has ended"
                state[index] = JobStatus.FAILED
            else:
                runnable.append(job)
            continue
        remaining = 0
        failed: list[int] = []
        linked: set[int] = set()
        for position, item in enumerate(graph.after[index]):
            if isinstance(item, Dependency):
                parent, status = item.job_id, parents[item.job_id].status
            else:
                parent, status = node[item], state[item]
            if parent in linked:
                continue  # two nodes that are one job (a unique key's holder): one edge
            linked.add(parent)
            settled = status != "pending" and status not in unfinished_statuses()
            if settled and status in FAILED_PARENT_STATUSES:
                failed.append(parent)
            elif not settled:
                remaining += 1
            edges.append(
                JobDependency(
                    job_id=job.pk, depends_on_id=parent, position=position, settled=settled
                )
            )
        policy = job.on_dependency_failure
        if closed:
            ended[job.pk] = "its workflow has ended"
            state[index] = JobStatus.FAILED
        elif failed and policy != DependencyFailure.RUN:
            ended[job.pk] = f"dependency #{failed[0]} failed"
            state[index] = JobStatus.FAILED
            # "fail" fails the workflow the job was enqueued with; a job joining another
            # one (using(after=...)) after the failure ends alone.
            failing_workflow |= policy == DependencyFailure.FAIL and graph.new
        elif remaining:
            awaiting.append(
                AwaitingExecution(
                    job_id=job.pk,
                    queue_name=job.queue_name,
                    priority=job.priority,
                    remaining=remaining,
                )
            )
        else:
            runnable.append(job)
    seam.insert_rows(db, JobDependency, edges)
    seam.insert_rows(db, AwaitingExecution, awaiting)
    release(db, runnable)
    if ended:
        by_id = {job.pk: job for job in jobs}
        end_dependents(db, [by_id[pk] for pk in ended], ended)
        if failing_workflow:
            end_workflows(db, [workflow_id], Workflow.Ending.FAILED)
        count_outcomes(db, batch_failures(by_id[pk] for pk in ended))
    return holders
