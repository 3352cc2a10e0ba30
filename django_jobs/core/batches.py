"""Batches: enqueue many jobs as one group and run callbacks once, when the last item ends.

The exactly-once guarantee comes from where the count moves: an item's terminal
transition (succeeded, failed for good, discarded; a retry is not terminal)
decrements its batch's ``pending`` under the batch row's lock, inside the very
transaction that finalises the item. Finalisation itself happens once per job
(the claimed row's lock, see ``claims``), so each item is counted once, and the
row lock serialises the items that end at the same instant: exactly one
transaction sees ``pending`` reach zero, and that one enqueues the callbacks.
Nothing is counted before the outcome is durable (the bug of a workflow engine
that marked items done before processing their completion messages, so every
late message saw "0 remaining" and fired the successor again).

Lock order: the batch row is always taken last (after a claimed row and a
semaphore), and several batches in ascending id order.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from django.tasks import Task, TaskResult, task_backends
from django.tasks.exceptions import InvalidTask
from django.utils import timezone

from django_jobs.core.ready import make_ready
from django_jobs.models import Batch, Job, JobStatus, ScheduledExecution
from django_jobs.tasks.other_backends import is_ours, needs_jobs_backend
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.batches")

CALLBACK_NAMES = ("on_finish", "on_success", "on_failure")

# The job whose task is running in this thread, so a batch enqueued from a task
# (a callback enqueueing the next stage, say) records its parent.
current_job_id: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "django_jobs_current_job_id", default=None
)


@dataclass(frozen=True)
class BatchResult:
    """What :func:`enqueue_batch` returns: the batch's id and its items' results."""

    id: int
    results: list[TaskResult]

    def refresh(self, using: str | None = None) -> Batch:
        """The batch row as it is now (counts, finished_at, callback job ids)."""
        from django_jobs.conf import database_alias

        return Batch.objects.using(using or database_alias()).get(pk=self.id)


def backend_of(
    calls: list[tuple[Task, Any, Any]],
    callbacks: Mapping[str, Task | None],
    what: str = "enqueue_batch()",
) -> Any:
    """The one django-jobs backend of ``calls`` and ``callbacks``; ``what`` (the caller's
    name) is refused clearly under another backend, such as Django's in test settings."""
    aliases = {call[0].backend for call in calls}
    aliases |= {cb.backend for cb in callbacks.values() if cb is not None}
    if len(aliases) > 1:
        raise ValueError("a batch's items and callbacks must use one task backend")
    alias = aliases.pop() if aliases else "default"
    backend = task_backends[alias]
    if not is_ours(backend):
        raise needs_jobs_backend(alias, what)
    return backend


def callback_spec(name: str, callback: Task) -> dict[str, Any]:
    """Check now that the callback takes the batch's counts; store how to enqueue it."""
    if not isinstance(callback, Task):
        raise InvalidTask(f"{name} must be a task (a function decorated with @task)")
    from django_jobs.tasks.job_task import bound_arguments

    bound_arguments(callback, [], {"batch_id": 0, "succeeded": 0, "failed": 0})
    return {
        "task_path": callback.module_path,
        "queue_name": callback.queue_name,
        "priority": callback.priority,
    }


def count_outcomes(db: str, outcomes: Mapping[int, tuple[int, int]]) -> None:
    """Count terminal items, ``{batch id: (succeeded, failed)}``; fire what completes.

    Runs inside the items' finalisation transaction.
    """
    for batch_id in sorted(outcomes):
        succeeded, failed = outcomes[batch_id]
        batch = Batch.objects.using(db).select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.finished_at is not None:
            # Pruned, or an item an operator retried after the batch completed: the
            # verdict stands and the retried job's outcome is its own.
            continue
        batch.pending = max(0, batch.pending - succeeded - failed)
        batch.succeeded += succeeded
        batch.failed += failed
        fields = ["pending", "succeeded", "failed"]
        if batch.pending == 0:
            complete(db, batch)
            fields += ["finished_at", "callback_jobs"]
        batch.save(using=db, update_fields=fields)


def count_failed(db: str, jobs: Iterable[Job]) -> None:
    """Count ``jobs`` (discarded, or cancelled before they ran) as failed items of their
    batches; jobs of no batch count nowhere."""
    per_batch: dict[int, int] = {}
    for job in jobs:
        if job.batch_id is not None:
            per_batch[job.batch_id] = per_batch.get(job.batch_id, 0) + 1
    count_outcomes(db, {batch_id: (0, n) for batch_id, n in per_batch.items()})


def count_outcome(db: str, batch_id: int | None, *, succeeded: bool) -> None:
    if batch_id is not None:
        count_outcomes(db, {batch_id: (1, 0) if succeeded else (0, 1)})


def reopen_item(db: str, batch_id: int | None) -> bool:
    """An operator retried a failed item: it is pending again, if its batch has not finished.

    Once the callbacks have run, the batch's verdict stands; the retried job's
    outcome is its own.
    """
    if batch_id is None:
        return False
    batch = Batch.objects.using(db).select_for_update().filter(pk=batch_id).first()
    if batch is None or batch.finished_at is not None or batch.failed == 0:
        return False
    Batch.objects.using(db).filter(pk=batch_id).update(
        pending=batch.pending + 1, failed=batch.failed - 1
    )
    return True


def complete(db: str, batch: Batch) -> None:
    """Mark the (locked) batch finished and enqueue its callbacks, in this transaction."""
    batch.finished_at = timezone.now()
    due = ["on_finish", "on_failure" if batch.failed else "on_success"]
    for name in CALLBACK_NAMES:
        spec = batch.callbacks.get(name)
        if spec and name in due:
            batch.callback_jobs[name] = enqueue_callback(db, batch, spec)


class PreparesJobs(Protocol):
    """What a callback's enqueue needs of its backend: ``JobsBackend.prepare_job`` (any
    other backend fails here, and the callback gets a row its worker fails clearly)."""

    def prepare_job(
        self, task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[Job, Task]: ...


def enqueue_callback(db: str, batch: Batch, spec: dict[str, Any]) -> int:
    """Insert the callback job; it never makes the item's finalisation fail.

    A callback without a concurrency key is ready at once. One with a key goes
    in as scheduled-due-now for the dispatcher to admit: this transaction may
    already hold another key's semaphore, and taking a second one here could
    break the lock order (docs/design.md section 4). A callback whose task no longer
    imports still gets its row, and the worker fails it with a clear error.
    """
    from django_jobs.tasks.loading import load_task

    kwargs = {"batch_id": batch.pk, "succeeded": batch.succeeded, "failed": batch.failed}
    try:
        task = load_task(spec["task_path"]).using(
            queue_name=spec["queue_name"], priority=spec["priority"]
        )
        backend = cast(PreparesJobs, task_backends[task.backend])
        job, _ = backend.prepare_job(task, [], kwargs)
    except Exception:
        logger.exception("batch %s: callback %s cannot be prepared", batch.pk, spec["task_path"])
        job = Job(
            task_path=spec["task_path"],
            queue_name=spec["queue_name"],
            priority=spec["priority"],
            kwargs=kwargs,
        )
    job.unique_lock = None  # a held key must not make the batch's completion wait or fail
    due_now = bool(job.concurrency_key)
    job.status = JobStatus.SCHEDULED if due_now else JobStatus.READY
    job.save(using=db, force_insert=True)
    if due_now:
        ScheduledExecution.objects.using(db).create(
            job_id=job.pk,
            queue_name=job.queue_name,
            priority=job.priority,
            scheduled_at=timezone.now(),
        )
    else:
        make_ready(db, [job])
    return job.pk
