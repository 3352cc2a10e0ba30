"""Building Django's ``TaskResult`` from a job row and its failure rows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.tasks import Task, TaskResult
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask

from django_jobs.exceptions import TaskNotFound
from django_jobs.models import FailedExecution, Job
from django_jobs.tasks.loading import load_task


def missing_task(*args, **kwargs):
    """Stands in for a task whose path no longer imports, so its result can still be read."""
    raise TaskNotFound("the task of this job no longer imports")


def task_for_job(job: Job) -> Task:
    """The job's task as it was enqueued (queue, priority, run_after, backend).

    A worker builds one per job it runs, and ``dataclasses.replace`` validates the
    task anew each time (its backend looked up, its queue checked): a tenth of a
    no-op job's CPU. Tasks are frozen, so the one built for the same task object
    and values is shared, until ``TASKS`` or ``DJANGO_JOBS`` change.
    """
    try:
        task = load_task(job.task_path)
    except TaskNotFound:
        from django_jobs.tasks.job_task import JobTask

        return JobTask(
            func=missing_task,
            priority=0,
            queue_name=job.queue_name,
            backend=job.backend,
            run_after=None,
        )
    key = (id(task), job.priority, job.queue_name, job.run_after, job.backend)
    found = _as_enqueued.get(key)
    if found is not None and found[0] is task:
        return found[1]
    try:
        made = replace(
            task,
            priority=job.priority,
            queue_name=job.queue_name,
            run_after=job.run_after,
            backend=job.backend,
        )
    except InvalidTask:
        # The settings changed since (a queue was removed): report the task as declared.
        made = task
    if len(_as_enqueued) >= MAX_TASKS_KEPT:
        _as_enqueued.clear()
    _as_enqueued[key] = (task, made)
    return made


# Tasks as enqueued, by (id of the declared task, priority, queue, run_after, backend),
# with the declared task itself: an id is only reused once its object is gone, which
# the entry's reference forbids.
_as_enqueued: dict[tuple[Any, ...], tuple[Task, Task]] = {}
MAX_TASKS_KEPT = 1024


@receiver(setting_changed)
def forget_tasks(*, setting: str, **kwargs: Any) -> None:
    """A task's validation depends on the backends and their queues."""
    if setting in ("TASKS", "DJANGO_JOBS"):
        _as_enqueued.clear()


def build_result(
    job: Job, failures: Iterable[FailedExecution] = (), task: Task | None = None
) -> TaskResult:
    result: TaskResult = TaskResult(
        task=task or task_for_job(job),
        id=str(job.pk),
        status=job.task_result_status,
        enqueued_at=job.enqueued_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        last_attempted_at=job.last_attempted_at,
        args=job.args,
        kwargs=job.kwargs,
        backend=job.backend,
        errors=[
            TaskError(exception_class_path=f.exception_class_path, traceback=f.traceback)
            for f in sorted(failures, key=lambda f: (f.attempt, f.pk))
        ],
        worker_ids=list(job.worker_ids or []),  # an unreadable column reads as none
    )
    object.__setattr__(result, "_return_value", job.return_value)
    return result
