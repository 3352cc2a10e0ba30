"""django-jobs: background jobs in your own database, for Django's task framework."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django_jobs import moved

if TYPE_CHECKING:
    from django.tasks import Task, TaskResult

    from django_jobs.core.batches import BatchResult
    from django_jobs.core.progress import Progress
    from django_jobs.core.workflows import WorkflowResult
    from django_jobs.exceptions import Snooze
    from django_jobs.tasks.backoff import Exponential
    from django_jobs.tasks.job_task import Call, task

moved.install()

__all__ = [
    "Exponential",
    "Snooze",
    "acancel",
    "adependency_results",
    "bulk_enqueue",
    "cancel",
    "cancel_requested",
    "cancel_workflow",
    "chain",
    "dependency_results",
    "enqueue_batch",
    "enqueue_on_commit",
    "get_workflow",
    "progress",
    "set_progress",
    "task",
    "workflow",
]


def bulk_enqueue(calls: Iterable[Call], *, backend: str | None = None) -> list[TaskResult]:
    """Enqueue ``[(task, args, kwargs), ...]`` in one transaction and a few queries.

    Every task must use the same backend (``backend`` defaults to the first task's).
    Under Django's ``ImmediateBackend`` or ``DummyBackend`` (test settings), each call is
    enqueued in turn with ``task.enqueue``; any other backend raises ``NeedsJobsBackend``.
    """
    from django.tasks import task_backends

    from django_jobs.tasks.job_task import checked_calls

    calls = checked_calls(calls, "bulk_enqueue()")
    if not calls:
        return []
    alias = backend or calls[0][0].backend
    if any(call[0].backend != alias for call in calls):
        raise ValueError("bulk_enqueue() takes tasks of one backend at a time")
    target = task_backends[alias]
    if not hasattr(target, "bulk_enqueue"):
        from django_jobs.tasks.other_backends import is_django_test_backend, needs_jobs_backend

        if not is_django_test_backend(target):
            raise needs_jobs_backend(alias, "bulk_enqueue()")
        # Django's ImmediateBackend or DummyBackend (test settings): each call enqueued
        # in turn, as that backend enqueues one; nothing there to be all or nothing about.
        return [task.enqueue(*args, **kwargs) for task, args, kwargs in calls]
    return target.bulk_enqueue(calls)


def enqueue_batch(
    calls: Iterable[Call],
    *,
    on_finish: Task | None = None,
    on_success: Task | None = None,
    on_failure: Task | None = None,
    concurrency_limit: int | None = None,
    description: str = "",
) -> BatchResult:
    """Enqueue ``[(task, args, kwargs), ...]`` as one batch with callbacks.

    See :func:`django_jobs.core.batch_enqueue.enqueue_batch` for the options.
    """
    from django_jobs.core.batch_enqueue import enqueue_batch as _enqueue_batch

    return _enqueue_batch(
        calls,
        on_finish=on_finish,
        on_success=on_success,
        on_failure=on_failure,
        concurrency_limit=concurrency_limit,
        description=description,
    )


def enqueue_on_commit(task: Task, *args: Any, using: str | None = None, **kwargs: Any) -> None:
    """Enqueue once the transaction on database ``using`` commits; nothing if it rolls back.

    ``using`` is the alias whose transaction guards the data the job needs (by
    default the jobs database). When the jobs share that database, a plain
    ``enqueue()`` inside the ``atomic()`` block is already all-or-nothing.
    """
    from django.db import transaction

    from django_jobs.conf import database_alias

    transaction.on_commit(lambda: task.enqueue(*args, **kwargs), using=using or database_alias())


def cancel(result_id: str | int, *, using: str | None = None) -> str:
    """Cancel a job by its result id.

    A waiting job (ready, scheduled, blocked) ends at once: ``"cancelled"``. A
    claimed or running one is asked to stop, and its worker stops it (see
    docs/control.md): ``"requested"``. Either way it ends ``FAILED`` with a
    ``JobCancelled`` error and is never retried. Raises ``JobNotFound`` for an
    unknown id and ``JobAlreadyFinished`` for a job that has ended.
    """
    from django_jobs.conf import database_alias
    from django_jobs.core.operator import cancel_job

    return cancel_job(using or database_alias(), int(result_id))


async def acancel(result_id: str | int, *, using: str | None = None) -> str:
    """``cancel()`` for async code."""
    from asgiref.sync import sync_to_async

    return await sync_to_async(cancel)(result_id, using=using)


def cancel_requested() -> bool:
    """Inside a running job: True once it has been cancelled or has timed out.

    Check it between steps of a long task to stop cleanly before the worker
    interrupts the thread by force. Outside a job: False.
    """
    from django_jobs.core.current_job import cancel_requested as requested

    return requested()


def set_progress(done: float, total: float | None = None, message: str = "") -> None:
    """Inside a running job: report how far it has got, ``done`` of ``total`` (None:
    unknown), and what it is doing now (``message``, at most 255 characters kept).

    Returns at once, from sync and async tasks alike: the value is written to the
    job's row by a thread of the worker, at most once a second per job, and the last
    value reported is always written (see docs/control.md). Outside a running job it
    raises ``RuntimeError``; a negative or non-finite ``done``, or a ``total`` that is
    not > 0, raises ``ValueError``.
    """
    from django_jobs.core.progress import set_progress as _set_progress

    _set_progress(done, total, message)


def progress(result_id: str | int, *, using: str | None = None) -> Progress | None:
    """The last progress the job reported (``done``, ``total``, ``message``,
    ``updated_at``, ``fraction``), or None if it has reported none.

    Raises ``JobNotFound`` for an unknown id.
    """
    from django_jobs.core.progress import progress as _progress

    return _progress(result_id, using=using)


def chain(*steps: Any, name: str = "") -> WorkflowResult:
    """Enqueue ``steps`` as a workflow where each waits for the one before: each a task
    (called with no arguments) or a ``(task, args, kwargs)`` tuple (docs/workflows.md)."""
    from django_jobs.core.workflows import chain as _chain

    return _chain(*steps, name=name)


def cancel_workflow(workflow: int | WorkflowResult, *, using: str | None = None) -> int:
    """Cancel a workflow: nothing of it starts after this; waiting jobs end now, running
    ones are asked to stop. Returns how many jobs it cancelled or asked to stop."""
    from django_jobs.core.workflows import cancel_workflow as _cancel

    return _cancel(workflow, using=using)


def get_workflow(workflow_id: int, *, using: str | None = None) -> WorkflowResult:
    """A workflow by id: its nodes' results and, through ``status``, its state now."""
    from django_jobs.core.workflows import get_workflow as _get

    return _get(workflow_id, using=using)


def dependency_results() -> list[TaskResult]:
    """Inside a task: the results of the jobs it waited for, in its ``after`` order. In an
    ``async def`` task: ``await adependency_results()``."""
    from django_jobs.core.workflows import dependency_results as _results

    return _results()


async def adependency_results() -> list[TaskResult]:
    """``dependency_results()`` for an ``async def`` task (its queries run on the job's ORM
    thread, docs/tasks.md "Async jobs")."""
    from asgiref.sync import sync_to_async

    return await sync_to_async(dependency_results)()


def __getattr__(name: str) -> Any:
    """The public names whose modules load only when first used: ``import django_jobs``
    stays fast (no ``django.tasks``, no models)."""
    if name == "task":
        # The function itself, not a wrapper: its overloads type ``@task`` and
        # ``@task(...)``, and ``inspect.signature`` shows every option.
        from django_jobs.tasks.job_task import task

        return task
    if name == "Exponential":
        from django_jobs.tasks.backoff import Exponential

        return Exponential
    if name == "workflow":
        # The context manager itself: ``with django_jobs.workflow("name") as wf:``.
        from django_jobs.core.workflows import workflow

        return workflow
    if name == "Snooze":
        from django_jobs.exceptions import Snooze

        return Snooze
    raise AttributeError(name)
