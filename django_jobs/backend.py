"""``JobsBackend``: the ``django.tasks`` backend that stores jobs in the project's database."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import transaction
from django.tasks import Task, TaskResult
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from .admission import admit_jobs
from .backoff import backoff_to_json
from .conf import database_alias
from .job_task import JobTask, job_options
from .models import Batch, FailedExecution, Job, JobStatus, ScheduledExecution
from .pg_insert import CHUNK_SIZE, can_insert_in_one_statement, insert_ready_jobs
from .results import build_result
from .serialization import json_arguments
from .uniqueness import insert_unique

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

    def bulk_enqueue(
        self, calls: Iterable[Call], *, batch: Batch | None = None
    ) -> list[TaskResult]:
        """Enqueue many calls in one transaction and a handful of queries.

        All or nothing: one invalid call raises before anything is written. A
        call of a unique task whose key is held gives the holder's result
        instead of a new job (see ``django_jobs.uniqueness``). ``batch``: the
        (saved) batch the jobs are items of; ``django_jobs.batches`` passes it.
        """
        checked: dict[int, dict[str, Any]] = {}  # id(task) -> its options, validated once
        prepared = [
            self.prepare_job(task, args, kwargs, batch, checked) for task, args, kwargs in calls
        ]
        if not prepared:
            return []
        db = self.database
        quick = [job for job, _ in prepared if can_insert_in_one_statement(db, job)]
        if len(quick) == len(prepared) and len(quick) <= CHUNK_SIZE:
            # One statement, atomic on its own: no BEGIN/COMMIT round trips.
            insert_ready_jobs(db, quick)
            return self.enqueued([build_result(job, task=task) for job, task in prepared])
        holders: dict[int, Job] = {}
        with transaction.atomic(using=db):
            insert_ready_jobs(db, quick)
            quick_ids = {id(job) for job in quick}
            plain = [
                job for job, _ in prepared if job.unique_lock is None and id(job) not in quick_ids
            ]
            Job.objects.using(db).bulk_create(plain, batch_size=BULK_BATCH_SIZE)
            if any(job.pk is None for job in plain):
                # MySQL (unlike MariaDB) cannot return ids from a bulk insert.
                for job in plain:
                    job.save(using=db, force_insert=True)
            for index, (job, _) in enumerate(prepared):
                if job.unique_lock is not None:
                    holder = insert_unique(db, job)
                    if holder is not None:
                        holders[index] = holder
            jobs = [job for index, (job, _) in enumerate(prepared) if index not in holders]
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
            admit_jobs(
                db,
                [
                    job
                    for job in jobs
                    if job.status != JobStatus.SCHEDULED and id(job) not in quick_ids
                ],
            )
            held = {index: self.get_result(str(holder.pk)) for index, holder in holders.items()}
        results = [
            held[index] if index in held else build_result(job, task=task)
            for index, (job, task) in enumerate(prepared)
        ]
        self.enqueued([result for index, result in enumerate(results) if index not in held])
        return results

    def enqueued(self, results: list[TaskResult]) -> list[TaskResult]:
        """Send ``task_enqueued`` for each new job's result."""
        for result in results:
            task_enqueued.send(type(self), task_result=result)
        return results

    def prepare_job(
        self,
        task: Task,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        batch: Batch | None = None,
        checked: dict[int, dict[str, Any]] | None = None,
    ) -> tuple[Job, Task]:
        """An unsaved job for one call. ``checked`` caches each task's validation and
        options across the calls of one bulk enqueue (the calls hold the tasks alive,
        so ``id()`` is stable)."""
        options = None if checked is None else checked.get(id(task))
        if options is None:
            self.validate_task(task)
            options = job_options(task)
            if checked is not None:
                checked[id(task)] = options
        json_args, json_kwargs = json_arguments(args, kwargs)
        is_job_task = isinstance(task, JobTask)
        key = task.resolve_concurrency_key(json_args, json_kwargs) if is_job_task else None
        unique = task.resolve_unique_key(json_args, json_kwargs) if is_job_task else None
        limit = options["concurrency_limit"]
        lease = task.lease_seconds if key else None
        if batch is not None:
            if unique:
                raise InvalidTask(
                    f"{task.module_path} is a unique task: it cannot be a batch item, "
                    "whose count would then depend on another job"
                )
            if batch.concurrency_limit:
                if key:
                    raise InvalidTask(
                        f"{task.module_path} has its own concurrency_key; a batch's "
                        "concurrency_limit would replace it"
                    )
                key, limit = batch.concurrency_key, batch.concurrency_limit
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
            concurrency_limit=limit if key else None,
            concurrency_duration=lease,
            on_conflict=options["on_conflict"],
            unique_key=unique,
            unique_lock=unique,
            unique_until=options["unique_until"] if unique else None,
            batch=batch,
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
