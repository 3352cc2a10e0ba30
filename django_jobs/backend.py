"""``JobsBackend``: the ``django.tasks`` backend that stores jobs in the project's database.

The Django-facing adapter, and nothing more: what an enqueue does is ``core.enqueue``; the
system checks are ``django_jobs.checks``, which ``check()`` runs when Django asks; which
backends are ours is ``tasks.backends``, which those read without importing this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.tasks import Task, TaskResult
from django.tasks.backends import dummy, immediate
from django.tasks.exceptions import TaskResultDoesNotExist

from django_jobs.checks import backend_checks
from django_jobs.core import enqueue
from django_jobs.models import Batch, FailedExecution, Job
from django_jobs.tasks.backends import JobsBackendBase
from django_jobs.tasks.job_task import Call, JobTask
from django_jobs.tasks.results import build_result


class JobsBackend(JobsBackendBase):
    task_class = JobTask

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

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

    def check(self, **kwargs: Any) -> list[Any]:
        """Django's ``check_tasks`` asks each backend: this one's database and
        ``DJANGO_JOBS`` problems, all at once."""
        return backend_checks(self)

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


class ImmediateBackend(immediate.ImmediateBackend):
    """Django's ``ImmediateBackend`` whose tasks are :class:`JobTask`: on Django 6.1,
    ``django.tasks.task`` hands a backend's ``task_class`` the options it is given, and
    Django's own class takes none of ours. For test settings whose tasks declare our
    options with ``django.tasks.task`` (``django_jobs.task`` needs no such backend):
    each runs at its enqueue, the options ignored (docs/testing.md)."""

    task_class = JobTask


class DummyBackend(dummy.DummyBackend):
    """Django's ``DummyBackend`` (enqueued, never run) whose tasks are :class:`JobTask`,
    for the same reason as :class:`ImmediateBackend`."""

    task_class = JobTask
