"""``JobsBackend``: the ``django.tasks`` backend that stores jobs in the project's database.

The Django-facing adapter, and nothing more: what an enqueue does is ``core.enqueue``; the
system checks are ``django_jobs.checks``, registered by the app (``apps.py``), not called
from here, so that this module imports neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.tasks import Task, TaskResult, task_backends
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import TaskResultDoesNotExist

from django_jobs.conf import database_alias
from django_jobs.core import enqueue
from django_jobs.models import Batch, FailedExecution, Job
from django_jobs.tasks.job_task import Call, JobTask
from django_jobs.tasks.results import build_result


class JobsBackend(BaseTaskBackend):
    task_class = JobTask

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    @property
    def database(self) -> str:
        """The alias of the database this backend writes its jobs to."""
        return self.options.get("database") or database_alias()

    def enqueue(self, task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> TaskResult:
        return self.bulk_enqueue([(task, args, kwargs)])[0]

    def bulk_enqueue(
        self, calls: Iterable[Call], *, batch: Batch | None = None
    ) -> list[TaskResult]:
        """Enqueue many calls in one transaction and a handful of queries, all or nothing
        (:func:`django_jobs.core.enqueue.bulk_enqueue`). ``batch``: the saved batch the
        jobs are items of (``django_jobs.core.batches`` passes it)."""
        return enqueue.bulk_enqueue(self, calls, batch=batch)

    def prepare_job(
        self,
        task: Task,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        batch: Batch | None = None,
        checked: dict[int, dict[str, Any]] | None = None,
    ) -> tuple[Job, Task]:
        """An unsaved job for one call (:func:`django_jobs.core.enqueue.prepare_job`)."""
        return enqueue.prepare_job(self, task, args, kwargs, batch, checked)

    def get_result(self, result_id: str) -> TaskResult:
        try:
            pk = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        db = self.database
        try:
            job = Job.objects.using(db).get(pk=pk)
        except Job.DoesNotExist:
            raise TaskResultDoesNotExist(result_id) from None
        failures = FailedExecution.objects.using(db).filter(job_id=pk)
        return build_result(job, failures)


def jobs_backends(db: str | None = None) -> list[JobsBackend]:
    """The django-jobs backends of ``TASKS``, in its order, that write to database ``db``
    (to any database if None): the one answer to "is this backend ours, writing there?"
    for the system checks, the recurring ticks and the metrics."""
    backends = (task_backends[alias] for alias in task_backends.settings)
    return [
        backend
        for backend in backends
        if isinstance(backend, JobsBackend) and (db is None or backend.database == db)
    ]
