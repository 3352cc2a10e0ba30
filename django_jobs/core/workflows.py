"""Workflows: jobs that wait for other jobs, enqueued together (docs/workflows.md).

``workflow()`` collects calls and what each waits for, then enqueues them all in one
transaction when its block ends; ``chain()`` is the straight line; ``using(after=...)``
waits for jobs enqueued before. The state machine of a waiting job is
``core/dependencies.py``; this module is what a user calls, and the state of a workflow
as its jobs say it is (:func:`workflow_states`, the one place it is computed: the API,
the admin and ``manage.py jobs`` all ask here).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Count, Exists, Max, OuterRef
from django.tasks import Task, TaskResult, task_backends
from django.tasks.exceptions import InvalidTask
from django.utils import timezone

from django_jobs.core import dependencies
from django_jobs.core.attempts import retried
from django_jobs.core.batches import CALLBACK_NAMES, backend_of, callback_spec, current_job_id
from django_jobs.core.dependencies import dependency_ids
from django_jobs.core.dependency_graph import Graph
from django_jobs.core.enqueue import announce, write_calls
from django_jobs.core.operator import cancel_job, request_cancel
from django_jobs.exceptions import InvalidDependency, JobAlreadyFinished, JobNotFound
from django_jobs.models import FINISHED_STATUSES, Batch, Job, JobStatus, Workflow
from django_jobs.tasks.job_task import (
    ON_DEPENDENCY_FAILURE_CHOICES,
    Dependency,
    as_dependencies,
    checked_calls,
)


class Node:
    """One call added to a workflow. Before the block ends it stands for the job in
    ``after=``; after, ``result`` is the job's ``TaskResult``."""

    def __init__(self, builder: WorkflowBuilder, index: int) -> None:
        self.builder = builder
        self.index = index

    @property
    def result(self) -> TaskResult:
        if self.builder.results is None:
            raise InvalidTask("this workflow is not enqueued yet: its block has not ended")
        return self.builder.results[self.index]

    @property
    def id(self) -> str:
        return self.result.id

    def as_dependencies(self) -> tuple[Dependency, ...]:
        result = self.result
        return (Dependency(result.backend, int(result.id)),)

    def after(self, *nodes: Any) -> Node:
        """Wait for ``nodes`` too (nodes of this workflow, or jobs enqueued before);
        a cycle is refused when the block ends."""
        self.builder.link(self.index, nodes)
        return self

    def __repr__(self) -> str:
        task = self.builder.calls[self.index][0]
        return f"<Node {self.index} {task.name}>"


class BatchNode:
    """A batch added to a workflow: what waits for it waits for every item."""

    def __init__(self, builder: WorkflowBuilder, items: list[Node], key: int) -> None:
        self.builder = builder
        self.items = items
        self.key = key

    @property
    def results(self) -> list[TaskResult]:
        return [item.result for item in self.items]

    @property
    def batch_id(self) -> int:
        if self.builder.batch_ids is None:
            raise InvalidTask("this workflow is not enqueued yet: its block has not ended")
        return self.builder.batch_ids[self.key]

    def as_dependencies(self) -> tuple[Dependency, ...]:
        return tuple(d for item in self.items for d in item.as_dependencies())


@dataclass
class BatchSpec:
    callbacks: dict[str, dict[str, Any]]
    concurrency_limit: int | None
    description: str
    items: list[int] = field(default_factory=list)


class WorkflowBuilder:
    """What ``workflow()`` yields: add calls with :meth:`add` (and batches with
    :meth:`add_batch`); they are enqueued when the block ends, in one transaction."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.calls: list[tuple[Task, tuple[Any, ...], dict[str, Any]]] = []
        self.after: dict[int, list[int | Dependency]] = defaultdict(list)
        self.policies: dict[int, str] = {}
        self.batch_specs: list[BatchSpec] = []
        self.results: list[TaskResult] | None = None
        self.batch_ids: list[int] | None = None
        self.result: WorkflowResult | None = None

    def add(
        self,
        task: Task,
        /,
        *args: Any,
        after: Iterable[Any] = (),
        on_dependency_failure: str | None = None,
        **kwargs: Any,
    ) -> Node:
        """Add ``task(*args, **kwargs)``, to run once everything in ``after`` (nodes of
        this workflow, batch nodes, results of jobs enqueued before) has succeeded.
        ``on_dependency_failure``: ``"cancel"`` (the task's, by default ``cancel``),
        ``"run"`` or ``"fail"`` (docs/workflows.md). ``after`` and
        ``on_dependency_failure`` are this method's: a task taking arguments of those
        names gets them through ``add_call``."""
        return self.add_call(
            task, args, kwargs, after=after, on_dependency_failure=on_dependency_failure
        )

    def add_call(
        self,
        task: Task,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        after: Iterable[Any] = (),
        on_dependency_failure: str | None = None,
    ) -> Node:
        """:meth:`add` with the call's arguments as a sequence and a mapping."""
        self.check_open()
        (checked,) = checked_calls([(task, tuple(args), dict(kwargs or {}))], "workflow.add()")
        if on_dependency_failure is not None:
            if on_dependency_failure not in ON_DEPENDENCY_FAILURE_CHOICES:
                raise InvalidTask(
                    "on_dependency_failure must be one of "
                    + ", ".join(ON_DEPENDENCY_FAILURE_CHOICES)
                )
        index = len(self.calls)
        self.calls.append((checked[0], tuple(checked[1]), dict(checked[2])))
        if on_dependency_failure is not None:
            self.policies[index] = on_dependency_failure
        self.link(index, after)
        return Node(self, index)

    def add_batch(
        self,
        calls: Iterable[Any],
        *,
        after: Iterable[Any] = (),
        on_finish: Task | None = None,
        on_success: Task | None = None,
        on_failure: Task | None = None,
        concurrency_limit: int | None = None,
        description: str = "",
        on_dependency_failure: str | None = None,
    ) -> BatchNode:
        """Add ``calls`` as the items of one batch (``enqueue_batch``'s options), each
        waiting for ``after``; what waits for the batch node waits for every item."""
        self.check_open()
        calls = checked_calls(calls, "workflow.add_batch()")
        if not calls:
            raise InvalidTask("a workflow's batch needs at least one item")
        callbacks = {"on_finish": on_finish, "on_success": on_success, "on_failure": on_failure}
        specs = {name: callback_spec(name, cb) for name, cb in callbacks.items() if cb}
        if concurrency_limit is not None and (
            isinstance(concurrency_limit, bool)
            or not isinstance(concurrency_limit, int)
            or concurrency_limit < 1
        ):
            raise InvalidTask("a batch's concurrency_limit must be an integer >= 1")
        spec = BatchSpec(specs, concurrency_limit, description[:255])
        after = list(after)
        items = []
        for task, args, kwargs in calls:
            node = self.add_call(
                task, args, kwargs, after=after, on_dependency_failure=on_dependency_failure
            )
            spec.items.append(node.index)
            items.append(node)
        self.batch_specs.append(spec)
        return BatchNode(self, items, len(self.batch_specs) - 1)

    def link(self, index: int, after: Iterable[Any]) -> None:
        if isinstance(after, (Node, BatchNode, TaskResult)) or not isinstance(after, Iterable):
            after = [after]
        for item in after:
            if isinstance(item, Node) and item.builder is self and self.results is None:
                self.after[index].append(item.index)
            elif isinstance(item, BatchNode) and item.builder is self and self.results is None:
                self.after[index].extend(node.index for node in item.items)
            else:
                self.after[index].extend(as_dependencies([item]))

    def check_open(self) -> None:
        if self.results is not None:
            raise InvalidTask("this workflow is enqueued already: add to it inside its block")

    def enqueue(self) -> WorkflowResult:
        """Enqueue every call, in one transaction; returns the workflow's result."""
        self.check_open()
        if not self.calls:
            raise InvalidTask("a workflow needs at least one task")
        order = topological_order(len(self.calls), self.after, self.calls)
        position = {index: place for place, index in enumerate(order)}
        aliases = {task.backend for task, _, _ in self.calls}
        if len(aliases) > 1:
            raise InvalidTask(
                f"a workflow's tasks must use one task backend, not {', '.join(sorted(aliases))}"
            )
        backend = backend_of(
            list(self.calls),
            {name: None for name in CALLBACK_NAMES},
            "a workflow (workflow(), chain())",
        )
        db = backend.database
        calls = [self.calls[index] for index in order]
        # The tries run here, around the batches' rows (core.attempts), each from a graph
        # of its own (a try adds the calls' own after= to it); the jobs are announced after.
        results, new, batches, graph = retried(
            db,
            lambda wait: self.write(db, backend, calls, self.graph(position), position, wait),
        )
        announce(backend, new)
        self.results = [results[position[index]] for index in range(len(self.calls))]
        self.batch_ids = [batch.pk for batch in batches]
        assert graph.workflow_id is not None
        self.result = WorkflowResult(
            id=graph.workflow_id, name=self.name, database=db, results=list(self.results)
        )
        return self.result

    def graph(self, position: dict[int, int]) -> Graph:
        """What the calls wait for, by their place in the enqueue."""
        graph = Graph(name=self.name, new=True)
        for index, items in self.after.items():
            if items:
                graph.after[position[index]] = [
                    position[item] if isinstance(item, int) else item for item in items
                ]
        for index, policy in self.policies.items():
            graph.policies[position[index]] = policy
        return graph

    def write(
        self,
        db: str,
        backend: Any,
        calls: list[tuple[Task, tuple[Any, ...], dict[str, Any]]],
        graph: Graph,
        position: dict[int, int],
        wait_for_parents: bool,
    ) -> tuple[list[TaskResult], list[TaskResult], list[Batch], Graph]:
        """One try: the batch rows, then every call, in one transaction. Every call's
        result, those of the jobs added, the batches, the graph."""
        with transaction.atomic(using=db):
            batches = []
            graph.batches.clear()
            for spec in self.batch_specs:
                batch = Batch.objects.using(db).create(
                    description=spec.description,
                    total=len(spec.items),
                    pending=len(spec.items),
                    callbacks=spec.callbacks,
                    concurrency_limit=spec.concurrency_limit,
                    parent_job_id=current_job_id.get(),
                )
                batches.append(batch)
                for index in spec.items:
                    graph.batches[position[index]] = batch
            results, new = write_calls(backend, calls, None, graph, wait_for_parents)
            return results, new, batches, graph


def topological_order(
    count: int, after: Mapping[int, list[int | Dependency]], calls: Sequence[Any]
) -> list[int]:
    """The calls in an order where each follows what it waits for (ties in the order
    they were added): new rows' ids then ascend along every edge, which the lock order
    of ``core/dependencies.py`` relies on. A cycle is refused, naming its tasks."""
    waits_for = {
        i: {item for item in after.get(i, []) if isinstance(item, int)} for i in range(count)
    }
    dependents: dict[int, list[int]] = defaultdict(list)
    for index, parents in waits_for.items():
        for parent in parents:
            dependents[parent].append(index)
    left = {index: len(parents) for index, parents in waits_for.items()}
    ready = [index for index, n in left.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for child in dependents[index]:
            left[child] -= 1
            if left[child] == 0:
                heapq.heappush(ready, child)
    if len(order) < count:
        stuck = sorted(index for index, n in left.items() if n)
        names = ", ".join(f"{calls[i][0].name} (node {i})" for i in stuck[:5])
        raise InvalidDependency(f"the workflow has a cycle: {names} wait for one another")
    return order


@contextmanager
def workflow(name: str = "") -> Iterator[WorkflowBuilder]:
    """Collect calls and what each waits for; enqueue them all when the block ends
    (nothing if it raises). ``wf.result`` is then the :class:`WorkflowResult`."""
    builder = WorkflowBuilder(name)
    yield builder
    builder.enqueue()


def chain(*steps: Any, name: str = "") -> WorkflowResult:
    """Enqueue ``steps`` as a workflow where each waits for the one before: each a task
    (called with no arguments) or a ``(task, args, kwargs)`` tuple."""
    if not steps:
        raise InvalidTask("chain() needs at least one task")
    builder = WorkflowBuilder(name)
    previous: Node | None = None
    for step in steps:
        task, args, kwargs = (step, (), {}) if isinstance(step, Task) else step
        previous = builder.add_call(task, args, kwargs, after=[previous] if previous else [])
    return builder.enqueue()


@dataclass(frozen=True)
class WorkflowResult:
    """A workflow as enqueued: its id, its nodes' results (in the order they were
    added), and :meth:`state` to read how it stands now."""

    id: int
    name: str
    database: str
    results: list[TaskResult]

    def state(self) -> WorkflowState:
        found = workflow_state(self.database, self.id)
        if found is None:
            raise LookupError(f"workflow {self.id} no longer exists (pruned)")
        return found

    @property
    def status(self) -> str:
        """``running``, ``succeeded``, ``failed`` or ``cancelled``, read now."""
        return self.state().status

    def as_dependencies(self) -> tuple[Dependency, ...]:
        """``after=[workflow_result]``: wait for every job of the workflow, as enqueued."""
        return tuple(Dependency(result.backend, int(result.id)) for result in self.results)

    def refresh(self) -> WorkflowResult:
        """The same workflow with every node's result read again."""
        refreshed = []
        for result in self.results:
            refreshed.append(task_backends[result.backend].get_result(result.id))
        return WorkflowResult(id=self.id, name=self.name, database=self.database, results=refreshed)


def get_workflow(workflow_id: int, *, using: str | None = None) -> WorkflowResult:
    """A workflow by id, its nodes in the order they were enqueued."""
    from django_jobs.conf import database_alias

    db = using or database_alias()
    workflow = Workflow.objects.using(db).filter(pk=workflow_id).first()
    if workflow is None:
        raise LookupError(f"no workflow with id {workflow_id}")
    jobs = Job.objects.using(db).filter(workflow_id=workflow_id).order_by("pk")
    results = [task_backends[job.backend].get_result(str(job.pk)) for job in jobs]
    return WorkflowResult(id=workflow.pk, name=workflow.name, database=db, results=results)


def cancel_workflow(workflow: int | WorkflowResult, *, using: str | None = None) -> int:
    """Cancel a workflow: it is ``cancelled`` at once, its waiting jobs end now and its
    running ones are asked to stop (``cancel()``); nothing of it starts after this.
    Returns how many of its jobs had not ended (0: it had ended)."""
    from django_jobs.conf import database_alias

    if isinstance(workflow, WorkflowResult):
        db, workflow_id = using or workflow.database, workflow.id
    else:
        db, workflow_id = using or database_alias(), int(workflow)
    return end_workflow(db, workflow_id, Workflow.Ending.CANCELLED)


def end_workflow(db: str, workflow_id: int, ending: str) -> int:
    """Mark the workflow ended (in a statement of its own, first: a job that ends while
    the rest is cancelled sees the mark and releases nothing), then cancel the rest.

    Only a workflow with a job not ended yet is marked: one whose last job has just
    ended keeps the state its jobs give it (0 is returned). The check is part of the
    marking statement, so only a job ending in the same instant can still slip by.
    """
    unfinished = (
        Job.objects.using(db)
        .filter(workflow_id=OuterRef("pk"))
        .exclude(status__in=FINISHED_STATUSES)
    )
    marked = (
        Workflow.objects.using(db)
        .filter(pk=workflow_id, ended_as__isnull=True)
        .filter(Exists(unfinished))
        .update(ended_as=ending, ended_at=timezone.now())
    )
    if (
        not marked
        and not Workflow.objects.using(db).filter(pk=workflow_id, ended_as__isnull=False).exists()
    ):
        return 0
    return cancel_rest(db, workflow_id)


def cancel_rest(db: str, workflow_id: int) -> int:
    """Cancel every job of a workflow that has not ended. Returns how many had not
    ended: each is now ended, or asked to stop, by this or by the end of a job it
    waited for (which ends what waits for it, the workflow having ended).

    First every job's cancel request (one short statement each, ascending, as
    ``cancel_job`` writes it): from then on a worker that claims one of them ends it
    before its body begins. Then each is cancelled in its own transaction
    (``cancel_job``: a waiting job ends now, a running one is asked to stop). One
    statement for all the requests would lock the rows in its scan's order against
    claims locking them in theirs.
    """
    ids = list(
        Job.objects.using(db)
        .filter(workflow_id=workflow_id)
        .exclude(status__in=FINISHED_STATUSES)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    for job_id in ids:
        request_cancel(db, job_id)
    for job_id in ids:
        try:
            cancel_job(db, job_id)
        except (JobAlreadyFinished, JobNotFound):
            continue
    return len(ids)


def sweep_workflows(db: str, limit: int = 100) -> int:
    """The dispatcher's repair: settle what a lost follow-up left (ended jobs whose
    dependents were not told), and cancel what is left of ended workflows."""
    settled = dependencies.settle_stranded(db, limit * 10)
    ended = list(
        Workflow.objects.using(db)
        .filter(ended_as__isnull=False, jobs__status__in=dependencies.unfinished_statuses())
        .values_list("pk", flat=True)
        .distinct()[:limit]
    )
    for workflow_id in ended:
        cancel_rest(db, workflow_id)
    return settled + len(ended)


def dependency_results() -> list[TaskResult]:
    """Inside a task: the results of the jobs it waited for, in its ``after`` order
    (each one's ``return_value`` is what that task returned). Empty for a job that
    waited for nothing, as is every task another backend runs (it refuses ``after=``);
    raises outside a task."""
    from django_jobs.conf import database_alias

    job_id = current_job_id.get()
    if job_id is None:
        from django_jobs.tasks.other_backends import other_backend_running

        if other_backend_running():
            return []  # another backend refuses after=: its job waited for nothing
        raise RuntimeError("dependency_results() can only be called from inside a running task")
    db = database_alias()
    backend = Job.objects.using(db).filter(pk=job_id).values_list("backend", flat=True).first()
    target = task_backends[backend or "default"]
    return [target.get_result(str(pk)) for pk in dependency_ids(db, job_id)]


def install_follow_ups() -> None:
    """Give ``core/dependencies.py`` what it runs after a commit (it cannot import
    admission or the operator, which end jobs through it). Called when the app is ready."""
    from django_jobs.core.scheduling import promote_jobs

    dependencies.follow_ups.promote = promote_jobs
    dependencies.follow_ups.cancel_rest = cancel_rest


RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"
WORKFLOW_STATUSES = (RUNNING, SUCCEEDED, FAILED, CANCELLED)


@dataclass(frozen=True)
class WorkflowState:
    """A workflow as its jobs say it is now.

    ``status``: ``running`` while any job has not ended; then ``succeeded`` if every
    job did, else ``failed``. A workflow an operator cancelled is ``cancelled`` (and one
    failed by a node's ``on_dependency_failure="fail"`` is ``failed``) from that moment,
    while what was running ends. ``counts``: jobs per ``Job.status``.
    """

    id: int
    name: str
    status: str
    counts: dict[str, int] = field(default_factory=dict)
    created_at: datetime | None = None
    finished_at: datetime | None = None
    ended_as: str | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def unfinished(self) -> int:
        return sum(n for status, n in self.counts.items() if status not in FINISHED_STATUSES)


def status_of(ended_as: str | None, counts: dict[str, int]) -> str:
    if ended_as:
        return ended_as
    if any(n for status, n in counts.items() if status not in FINISHED_STATUSES):
        return RUNNING
    if any(n for status, n in counts.items() if status != JobStatus.SUCCEEDED):
        return FAILED
    return SUCCEEDED


def workflow_states(db: str, workflows: Iterable[Workflow]) -> dict[int, WorkflowState]:
    """The state of each of ``workflows`` (rows already read), in one grouped query."""
    rows = {workflow.pk: workflow for workflow in workflows}
    if not rows:
        return {}
    counts: dict[int, dict[str, int]] = defaultdict(dict)
    last: dict[int, datetime | None] = {}
    grouped = (
        Job.objects.using(db)
        .filter(workflow_id__in=list(rows))
        .values_list("workflow_id", "status")
        .annotate(n=Count("pk"), last=Max("finished_at"))
        .order_by()
    )
    for workflow_id, status, n, finished in grouped:
        counts[workflow_id][status] = n
        if finished is not None and (last.get(workflow_id) is None or finished > last[workflow_id]):
            last[workflow_id] = finished
    states = {}
    for pk, workflow in rows.items():
        status = status_of(workflow.ended_as, counts[pk])
        unfinished = status == RUNNING or any(
            n for s, n in counts[pk].items() if s not in FINISHED_STATUSES
        )
        states[pk] = WorkflowState(
            id=pk,
            name=workflow.name,
            status=status,
            counts=dict(counts[pk]),
            created_at=workflow.created_at,
            finished_at=None if unfinished else (last.get(pk) or workflow.ended_at),
            ended_as=workflow.ended_as,
        )
    return states


def workflow_state(db: str, workflow_id: int) -> WorkflowState | None:
    workflow = Workflow.objects.using(db).filter(pk=workflow_id).first()
    if workflow is None:
        return None
    return workflow_states(db, [workflow])[workflow_id]
