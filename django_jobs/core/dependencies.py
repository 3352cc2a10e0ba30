"""Dependencies between jobs: a job that waits for others, made runnable exactly once.

A job with dependencies is ``AWAITING``: it has an ``AwaitingExecution`` row whose
``remaining`` counts the dependency edges (``JobDependency``) not yet settled, and no row a
worker could claim. An edge is *settled* when its parent's end has been applied to the
dependent: the count moved, or the dependent ended by its policy. Each edge is settled once,
under its own row's lock (the ``settled`` flag is read and flipped by whoever holds it), and
the count only moves under the awaiting row's lock, in that same transaction. So of two
parents finishing at the same instant, exactly one takes the count to zero and releases the
child, and a parent's end is never applied twice, whoever races for it (the parent's own
transaction, the follow-up after a policy ended a dependent, the dispatcher's sweep after a
crash). That is the race of the workflow engine in docs/design.md section 1, whose
successors counted "siblings left" from rows outside any lock.

Where an end is applied: in the transaction that ends the parent (the finish, the failure
for good, the cancel, the discard: each calls :func:`settle_ended` after the parent's row is
written), one level deep. A dependent that this ends (its policy is to be cancelled) has
dependents of its own; those are settled by a follow-up transaction right after the commit
(:func:`propagate`), and, should the process die first, by the dispatcher's sweep
(:func:`settle_stranded`), which finds ended jobs with unsettled edges. One level per
transaction keeps the lock order simple.

Lock order (docs/design.md section 4): the ended jobs' rows (their transitions lock them),
then the semaphores the transition frees, then the ``JobDependency`` rows of the ended jobs
(by parent, then id), then the ``AwaitingExecution`` rows of their dependents (ascending job
id), then ``Workflow`` rows, then ``Batch`` rows. A released dependent with a concurrency
key therefore cannot take its semaphore here (that would be a semaphore after an awaiting
row): it goes in as scheduled, due now, and is admitted right after the commit
(:func:`promote_after_commit`) or by the dispatcher, like a batch callback with a key.

The enqueue side (``core/dependency_graph.py``, ``write_graph``) locks the rows of the
jobs it waits for that already exist, and reads their status under that lock: a parent's
end and the edge to it serialise on the parent's row, so a parent ending as the edge is
written is either seen ended (and counted at once) or sees the edge (and settles it). It
also marks each such parent with a workflow: a finish reads that mark under the same lock
(``Operations.lock_held_claims``; PostgreSQL's one-statement finish rechecks it as it
updates the row) to know it has dependents to look for, so jobs of no workflow never pay
for any of this.
"""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from django_jobs.core.batches import count_outcomes
from django_jobs.core.ready import make_ready
from django_jobs.db import features, ops
from django_jobs.models import (
    FINISHED_STATUSES,
    AwaitingExecution,
    DependencyFailure,
    FailedExecution,
    Job,
    JobDependency,
    JobStatus,
    ScheduledExecution,
    Workflow,
)
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.dependencies")

DEPENDENCY_FAILED_ERROR = "django_jobs.exceptions.DependencyFailed"


@dataclass
class FollowUps:
    """What runs once a transaction of this module's has committed, in code above it:
    the admission of released jobs with a concurrency key (``admission``), the cancel
    of what is left of an ended workflow (``operator``). Those modules end jobs through
    this one, so it cannot import them; ``core/workflows.py`` installs these when the
    app is ready. Unset, or lost with a crash, the dispatcher does the same: it promotes
    due scheduled jobs and sweeps ended workflows (:func:`settle_stranded`)."""

    promote: Callable[[str, list[int]], object] | None = None
    cancel_rest: Callable[[str, int], object] | None = None


follow_ups = FollowUps()


def after_commit(db: str, call: Callable[[], object]) -> None:
    # robust: a follow-up's error is logged and never undoes the commit before it.
    transaction.on_commit(call, using=db, robust=True)


FAILED_PARENT_STATUSES = (JobStatus.FAILED, JobStatus.DISCARDED)


def unfinished_statuses() -> tuple[str, ...]:
    return tuple(status for status in JobStatus.values if status not in FINISHED_STATUSES)


# --- making a job runnable -----------------------------------------------------------------


def release(db: str, jobs: list[Job]) -> None:
    """Make saved jobs with no execution row runnable, inside the caller's transaction,
    taking no semaphore: due later, scheduled; with a concurrency key, scheduled due
    now and admitted after the commit (:func:`promote_after_commit`); else ready."""
    if not jobs:
        return
    now = timezone.now()
    scheduled: list[tuple[Job, datetime]] = []
    keyed: list[Job] = []
    ready: list[Job] = []
    for job in jobs:
        if job.run_after is not None and job.run_after > now:
            scheduled.append((job, job.run_after))
        elif job.concurrency_key:
            scheduled.append((job, now))
            keyed.append(job)
        else:
            ready.append(job)
    if scheduled:
        ScheduledExecution.objects.using(db).bulk_create(
            [
                ScheduledExecution(
                    job_id=job.pk, queue_name=job.queue_name, priority=job.priority, scheduled_at=at
                )
                for job, at in scheduled
            ],
            batch_size=1000,
        )
        ids = [job.pk for job, _ in scheduled]
        Job.objects.using(db).filter(pk__in=ids).update(status=JobStatus.SCHEDULED)
        for job, _ in scheduled:
            job.status = JobStatus.SCHEDULED
    if keyed:
        promote_after_commit(db, [job.pk for job in keyed])
    if ready:
        make_ready(db, ready)


def promote_after_commit(db: str, job_ids: list[int]) -> None:
    """Admit these scheduled-due-now jobs through their keys once the caller commits, in
    a transaction of their own; the dispatcher does it if this process dies first."""
    promote = follow_ups.promote
    if promote is not None:
        after_commit(db, lambda: promote(db, job_ids))


# --- the end of a parent ------------------------------------------------------------------


def settle_ended(db: str, ended: Mapping[int, bool]) -> dict[int, tuple[int, int]]:
    """Apply the end of ``ended`` (``{job id: succeeded}``) to the jobs waiting for them,
    inside the transaction that ended them, after their rows were written and after
    every semaphore it takes.

    Returns the batch outcomes of the dependents it ended, for the caller to count
    with its own (batch rows come last). The dependents of those are settled after
    the commit (:func:`propagate`).
    """
    if not ended:
        return {}
    outcome = settle_level(db, ended)
    if outcome.ended:
        ids = sorted(outcome.ended)
        after_commit(db, lambda: propagate(db, ids))
    return outcome.batches


@dataclass
class Settled:
    batches: dict[int, tuple[int, int]] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)


def settle_level(db: str, ended: Mapping[int, bool]) -> Settled:
    """:func:`settle_ended` without the follow-up: one level, returning what it ended."""
    if all(ended.values()) and features(db).can_settle_in_one_statement:
        return settle_succeeded(db, list(ended))
    result = Settled()
    edges = list(
        JobDependency.objects.using(db)
        .select_for_update()
        .filter(depends_on_id__in=sorted(ended), settled=False)
        .order_by("depends_on_id", "id")
        .values_list("id", "job_id", "depends_on_id")
    )
    if not edges:
        return result
    JobDependency.objects.using(db).filter(pk__in=[edge[0] for edge in edges]).update(settled=True)
    parents_of: dict[int, list[int]] = defaultdict(list)
    for _, dependent, parent in edges:
        parents_of[dependent].append(parent)
    rows = lock_awaiting(db, parents_of)
    if not rows:
        return result  # every dependent had ended already (cancelled, say)
    jobs = {
        job.pk: job
        for job in Job.objects.using(db)
        .filter(pk__in=list(rows))
        .only(*RELEASE_FIELDS, "on_dependency_failure")
    }
    stopped = ended_workflows(db, {job.workflow_id for job in jobs.values() if job.workflow_id})
    why: dict[int, str] = {}
    runnable: list[Job] = []
    counts: dict[int, list[int]] = defaultdict(list)
    failing: set[int] = set()
    for pk in sorted(rows):
        job, row = jobs[pk], rows[pk]
        failed = [parent for parent in parents_of[pk] if not ended[parent]]
        row.remaining = max(0, row.remaining - len(parents_of[pk]))
        policy = job.on_dependency_failure or DependencyFailure.CANCEL
        if job.workflow_id in stopped:
            why[pk] = "its workflow has ended"
        elif failed and policy != DependencyFailure.RUN:
            why[pk] = f"dependency #{failed[0]} failed"
            if policy == DependencyFailure.FAIL and job.workflow_id is not None:
                failing.add(job.workflow_id)
        elif row.remaining == 0:
            runnable.append(job)
        else:
            counts[row.remaining].append(pk)
    for remaining, pks in counts.items():
        AwaitingExecution.objects.using(db).filter(job_id__in=pks).update(remaining=remaining)
    gone = [*why, *(job.pk for job in runnable)]
    if gone:
        ops(db).delete_executions(db, AwaitingExecution, gone)
    release(db, runnable)
    if why:
        end_dependents(db, [jobs[pk] for pk in why], why)
        result.ended = set(why)
        result.batches = batch_failures(jobs[pk] for pk in why)
    if failing:
        end_workflows(db, sorted(failing), Workflow.Ending.FAILED)
    return result


# What releasing or ending a dependent reads of it: every column its ready row copies
# (core.ready.make_ready), or each one left out is read again by a query per dependent.
RELEASE_FIELDS = (
    "pk",
    "status",
    "queue_name",
    "priority",
    "concurrency_key",
    "is_async",
    "fair_key",
    "fair_weight",
    "run_after",
    "workflow_id",
    "batch_id",
    "attempts",
)


def settle_succeeded(db: str, parent_ids: list[int]) -> Settled:
    """:func:`settle_level` when every parent succeeded, where the database settles the
    edges and moves the counts in one statement (``Operations.settle_succeeded``): only
    the dependents that reached zero are read, and released (or ended, if their
    workflow has ended), their awaiting rows still locked by that statement."""
    result = Settled()
    zero = [pk for pk, remaining in ops(db).settle_succeeded(db, parent_ids) if remaining == 0]
    if not zero:
        return result
    jobs = {job.pk: job for job in Job.objects.using(db).filter(pk__in=zero).only(*RELEASE_FIELDS)}
    stopped = ended_workflows(db, {job.workflow_id for job in jobs.values() if job.workflow_id})
    why = {pk: "its workflow has ended" for pk, job in jobs.items() if job.workflow_id in stopped}
    ops(db).delete_executions(db, AwaitingExecution, zero)
    release(db, [job for pk, job in sorted(jobs.items()) if pk not in why])
    if why:
        end_dependents(db, [jobs[pk] for pk in why], why)
        result.ended = set(why)
        result.batches = batch_failures(jobs[pk] for pk in why)
    return result


def lock_awaiting(db: str, job_ids: Iterable[int]) -> dict[int, AwaitingExecution]:
    """Lock the awaiting rows of ``job_ids`` (ascending): their counts move only under it."""
    return {
        row.job_id: row
        for row in AwaitingExecution.objects.using(db)
        .select_for_update()
        .filter(job_id__in=sorted(job_ids))
        .order_by("job_id")
    }


def ended_workflows(db: str, workflow_ids: Iterable[int]) -> set[int]:
    """Those of ``workflow_ids`` that have ended (cancelled, or failed by a policy).

    Read without a lock: a cancel marks the row first and then cancels every job of the
    workflow that has not ended, each through ``cancel_job``, whose first write to the
    job's row waits for a release of it still in flight here. So a release that read
    the row just before the mark is undone by the cancel, and one after it releases
    nothing; locking the row would serialise every finish of a workflow for no more.
    """
    ids = sorted(workflow_ids)
    if not ids:
        return set()
    return set(
        Workflow.objects.using(db)
        .filter(pk__in=ids, ended_as__isnull=False)
        .values_list("pk", flat=True)
    )


def end_dependents(db: str, jobs: list[Job], why: Mapping[int, str]) -> None:
    """End jobs that never ran because of their dependencies: ``FAILED``, one
    ``DependencyFailed`` error, no attempt, no cancel request (so a retry of the failed
    dependency can bring them back)."""
    now = timezone.now()
    # The jobs' rows first: on InnoDB the error rows' foreign key check takes a shared
    # lock on each, which an UPDATE after it would have to upgrade (a deadlock with
    # anyone asking for the row in between, a cancel say).
    Job.objects.using(db).filter(pk__in=[job.pk for job in jobs]).update(
        status=JobStatus.FAILED, finished_at=now, unique_lock=None
    )
    FailedExecution.objects.using(db).bulk_create(
        [
            FailedExecution(
                job_id=job.pk,
                attempt=job.attempts,
                exception_class_path=DEPENDENCY_FAILED_ERROR,
                message=why[job.pk],
                failed_at=now,
            )
            for job in jobs
        ]
    )
    for job in jobs:
        job.status, job.finished_at = JobStatus.FAILED, now


def batch_failures(jobs: Iterable[Job]) -> dict[int, tuple[int, int]]:
    per_batch: dict[int, int] = defaultdict(int)
    for job in jobs:
        if job.batch_id is not None:
            per_batch[job.batch_id] += 1
    return {batch_id: (0, n) for batch_id, n in per_batch.items()}


def merge_outcomes(*outcomes: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    merged: dict[int, tuple[int, int]] = {}
    for each in outcomes:
        for batch_id, (succeeded, failed) in each.items():
            before = merged.get(batch_id, (0, 0))
            merged[batch_id] = (before[0] + succeeded, before[1] + failed)
    return merged


def end_workflows(db: str, workflow_ids: Sequence[int], ending: str) -> None:
    """Mark workflows ended (their rows come after every awaiting row), and cancel what
    is left of them once this commits (:func:`cancel_rest`)."""
    changed = list(
        Workflow.objects.using(db)
        .select_for_update()
        .filter(pk__in=sorted(workflow_ids), ended_as__isnull=True)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    if not changed:
        return
    Workflow.objects.using(db).filter(pk__in=changed).update(
        ended_as=ending, ended_at=timezone.now()
    )
    cancel_rest = follow_ups.cancel_rest
    if cancel_rest is not None:
        for workflow_id in changed:
            after_commit(db, functools.partial(cancel_rest, db, workflow_id))


# --- follow-ups and the sweep --------------------------------------------------------------


def propagate(db: str, ended: Iterable[int]) -> None:
    """Settle the dependents of jobs that ended by their policy, a level per transaction,
    until nothing more ends."""
    pending = sorted(set(ended))
    while pending:
        with transaction.atomic(using=db):
            succeeded = set(
                Job.objects.using(db)
                .filter(pk__in=pending, status=JobStatus.SUCCEEDED)
                .values_list("pk", flat=True)
            )
            outcome = settle_level(db, {pk: pk in succeeded for pk in pending})
            count_outcomes(db, outcome.batches)
        pending = sorted(outcome.ended)


def settle_stranded(db: str, limit: int = 1000) -> int:
    """The dispatcher's repair: apply the end of ended jobs whose edges are not settled
    (their follow-up was lost with a process). Returns how many ended jobs it settled."""
    parents = list(
        JobDependency.objects.using(db)
        .filter(settled=False, depends_on__status__in=FINISHED_STATUSES)
        .order_by("depends_on_id")
        .values_list("depends_on_id", flat=True)
        .distinct()[:limit]
    )
    if parents:
        propagate(db, parents)
    return len(parents)


# --- an operator's retry ---------------------------------------------------------------------


def unmet_dependencies(db: str, job_id: int) -> tuple[list[int], list[int]]:
    """The dependencies of ``job_id`` that have not succeeded: (failed for good, not ended)."""
    rows = (
        JobDependency.objects.using(db)
        .filter(job_id=job_id)
        .exclude(depends_on__status=JobStatus.SUCCEEDED)
        .values_list("depends_on_id", "depends_on__status")
    )
    failed = [pk for pk, status in rows if status in FAILED_PARENT_STATUSES]
    waiting = [pk for pk, status in rows if status not in FAILED_PARENT_STATUSES]
    return failed, waiting


def wait_again(db: str, job: Job, parents: list[int]) -> None:
    """Put a retried job back to wait for ``parents`` (not ended yet): their edges become
    unsettled again and the count is theirs. The caller holds the job's lock."""
    JobDependency.objects.using(db).filter(job_id=job.pk, depends_on_id__in=parents).update(
        settled=False
    )
    AwaitingExecution.objects.using(db).create(
        job_id=job.pk, queue_name=job.queue_name, priority=job.priority, remaining=len(parents)
    )
    Job.objects.using(db).filter(pk=job.pk).update(status=JobStatus.AWAITING, finished_at=None)
    job.status = JobStatus.AWAITING


def revive_dependents(db: str, job_id: int) -> list[int]:
    """An operator retries failed job ``job_id`` (its row locked by the caller, before any
    semaphore): the jobs its failure ended (``DependencyFailed``) wait again, and in turn
    the ones theirs ended, unless another of their dependencies failed for good or
    their workflow has ended. Returns the ids brought back, for their batches."""
    revived: list[int] = []
    reopened = {job_id}
    frontier = [job_id]
    heapq.heapify(frontier)
    seen: set[int] = set()
    while frontier:
        parent = heapq.heappop(frontier)
        candidates = sorted(
            JobDependency.objects.using(db)
            .filter(depends_on_id=parent)
            .values_list("job_id", flat=True)
        )
        for pk in candidates:
            if pk in seen:
                continue
            seen.add(pk)
            job = (
                Job.objects.using(db)
                .select_for_update()
                .filter(pk=pk, status=JobStatus.FAILED)
                .first()
            )
            if job is None or not ended_by_dependency(db, pk):
                continue
            if (
                job.workflow_id is not None
                and Workflow.objects.using(db)
                .filter(pk=job.workflow_id, ended_as__isnull=False)
                .exists()
            ):
                continue
            failed, waiting = unmet_dependencies(db, pk)
            if any(other not in reopened for other in failed):
                continue
            wait_again(db, job, sorted({*waiting, *(f for f in failed if f in reopened)}))
            reopened.add(pk)
            revived.append(pk)
            heapq.heappush(frontier, pk)
    return revived


def ended_by_dependency(db: str, job_id: int) -> bool:
    """Whether a failed job's last error is a ``DependencyFailed``: it never ran."""
    last = (
        FailedExecution.objects.using(db)
        .filter(job_id=job_id)
        .order_by("-failed_at", "-pk")
        .values_list("exception_class_path", flat=True)
        .first()
    )
    return last == DEPENDENCY_FAILED_ERROR


# --- reading ---------------------------------------------------------------------------------


def dependency_ids(db: str, job_id: int) -> list[int]:
    """The jobs ``job_id`` waits (or waited) for, in its ``after`` order."""
    return list(
        JobDependency.objects.using(db)
        .filter(job_id=job_id)
        .order_by("position", "pk")
        .values_list("depends_on_id", flat=True)
    )
