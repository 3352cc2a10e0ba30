"""``JobsBackend``: the ``django.tasks`` backend that stores jobs in the project's database."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import transaction
from django.tasks import Task, TaskResult
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from .admission import admit_jobs
from .backoff import backoff_to_json
from .conf import database_alias
from .job_task import JobTask, job_options
from .models import FailedExecution, Job, JobStatus, ScheduledExecution
from .results import build_result
from .serialization import json_arguments

Call = tuple[Task, Sequence[Any], Mapping[str, Any]]

BULK_BATCH_SIZE = 1000


class JobsBackend(BaseTaskBackend):
    task_class = JobTask

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    @property
    def database(self) -> str:
        return self.options.get("database") or database_alias()

    def enqueue(self, task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> TaskResult:
        return self.bulk_enqueue([(task, args, kwargs)])[0]

    def bulk_enqueue(self, calls: Iterable[Call]) -> list[TaskResult]:
        """Enqueue many calls in one transaction and a handful of queries.

        All or nothing: one invalid call raises before anything is written.
        """
        prepared = [self.prepare_job(task, args, kwargs) for task, args, kwargs in calls]
        if not prepared:
            return []
        db = self.database
        jobs = [job for job, _ in prepared]
        with transaction.atomic(using=db):
            Job.objects.using(db).bulk_create(jobs, batch_size=BULK_BATCH_SIZE)
            if any(job.pk is None for job in jobs):
                # MySQL (unlike MariaDB) cannot return ids from a bulk insert.
                for job in jobs:
                    job.save(using=db, force_insert=True)
            scheduled = [job for job in jobs if job.status == JobStatus.SCHEDULED]
            if scheduled:
                ScheduledExecution.objects.using(db).bulk_create(
                    [
                        ScheduledExecution(
                            job_id=job.pk,
                            queue_name=job.queue_name,
                            priority=job.priority,
                            scheduled_at=job.run_after,
                        )
                        for job in scheduled
                    ],
                    batch_size=BULK_BATCH_SIZE,
                )
            admit_jobs(db, [job for job in jobs if job.status != JobStatus.SCHEDULED])
        results = [build_result(job, task=task) for job, task in prepared]
        for result in results:
            task_enqueued.send(type(self), task_result=result)
        return results

    def prepare_job(
        self, task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[Job, Task]:
        self.validate_task(task)
        json_args, json_kwargs = json_arguments(args, kwargs)
        options = job_options(task)
        key = (
            task.resolve_concurrency_key(json_args, json_kwargs)
            if isinstance(task, JobTask)
            else None
        )
        now = timezone.now()
        future = task.run_after is not None and task.run_after > now
        job = Job(
            backend=self.alias,
            task_path=task.module_path,
            queue_name=task.queue_name,
            priority=task.priority,
            args=json_args,
            kwargs=json_kwargs,
            status=JobStatus.SCHEDULED if future else JobStatus.READY,
            run_after=task.run_after,
            enqueued_at=now,
            max_attempts=options["max_attempts"],
            backoff=backoff_to_json(options["backoff"]),
            concurrency_key=key,
            concurrency_limit=options["concurrency_limit"] if key else None,
            concurrency_duration=task.lease_seconds if key else None,
            on_conflict=options["on_conflict"],
        )
        return job, task

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

    def check(self, **kwargs: Any) -> list[Any]:
        from .checks import backend_checks

        return backend_checks(self)
