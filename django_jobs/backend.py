"""``JobsBackend``: the ``django.tasks`` backend that stores jobs in the project's database."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from django.db import OperationalError, connections
from django.tasks import Task, TaskResult
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from django_jobs.conf import database_alias
from django_jobs.core.admission import admit_jobs
from django_jobs.core.uniqueness import insert_unique, retry_after, unique_in_key_order
from django_jobs.db.pg_insert import CHUNK_SIZE, can_insert_in_one_statement, insert_ready_jobs
from django_jobs.db.transactions import hot_transaction
from django_jobs.models import Batch, FailedExecution, Job, JobStatus, ScheduledExecution
from django_jobs.observability.tracing import record_enqueue
from django_jobs.tasks.backoff import backoff_to_json
from django_jobs.tasks.job_task import Call, JobTask, bound_arguments, checked_calls, job_options
from django_jobs.tasks.results import build_result
from django_jobs.tasks.serialization import json_arguments
from django_jobs.text import safe_repr

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
        instead of a new job (see ``django_jobs.core.uniqueness``). ``batch``: the
        (saved) batch the jobs are items of; ``django_jobs.batches`` passes it.

        A deadlock the database breaks by rolling this enqueue back is retried
        when the transaction was this call's own: nothing else was in it, so
        running it again is safe. Inside the caller's ``atomic()`` the whole
        transaction is already gone, and only the caller can run it again: the
        error is raised with a note saying so (docs/unique.md).
        """
        calls = checked_calls(calls, "bulk_enqueue()")
        if not calls:
            return []
        connection = connections[self.database]
        own_transaction = connection.get_autocommit() and not connection.in_atomic_block
        attempt = 1
        while True:
            try:
                results, new = self.write_calls(calls, batch)
                break
            except OperationalError as exc:
                if not retry_after(exc, attempt, own_transaction=own_transaction):
                    raise
            attempt += 1
        # Outside the retried part: a receiver's error must never enqueue the calls again.
        self.enqueued(new)
        return results

    def write_calls(
        self, calls: list[Call], batch: Batch | None
    ) -> tuple[list[TaskResult], list[TaskResult]]:
        """One attempt at :meth:`bulk_enqueue`: prepare every job, then write them all.

        Returns every call's result, and the results of the jobs it added (not a
        duplicate's holder), for the ``task_enqueued`` signal.
        """
        checked: dict[int, dict[str, Any]] = {}  # id(task) -> its options, validated once
        prepared = [
            self.prepare_job(task, args, kwargs, batch, checked) for task, args, kwargs in calls
        ]
        db = self.database
        quick = [job for job, _ in prepared if can_insert_in_one_statement(db, job)]
        if len(quick) == len(prepared) and len(quick) <= CHUNK_SIZE:
            # One statement, atomic on its own: no BEGIN/COMMIT round trips.
            insert_ready_jobs(db, quick)
            results = [build_result(job, task=task) for job, task in prepared]
            return results, results
        holders: dict[int, Job] = {}
        with hot_transaction(db):
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
            for index in unique_in_key_order(prepared):
                holder = insert_unique(db, prepared[index][0])
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
        return results, [result for index, result in enumerate(results) if index not in held]

    def enqueued(self, results: list[TaskResult]) -> None:
        """Send ``task_enqueued`` for each new job's result."""
        for result in results:
            task_enqueued.send(type(self), task_result=result)

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
        if not isinstance(task, Task):
            raise InvalidTask(
                f"{safe_repr(task, 80)} is not a task (a function decorated with @task)"
            )
        options = None if checked is None else checked.get(id(task))
        if options is None:
            self.validate_task(task)
            options = job_options(task)
            if checked is not None:
                checked[id(task)] = options
        json_args, json_kwargs = json_arguments(args, kwargs, self.database)
        # Every call is bound, keyed or not: one the function would refuse fails
        # here, naming the argument, not in a worker later.
        arguments = bound_arguments(task, json_args, json_kwargs)
        key = unique = rate = None
        if isinstance(task, JobTask):
            key = task.resolve_concurrency_key(json_args, json_kwargs, arguments)
            unique = task.resolve_unique_key(json_args, json_kwargs, arguments)
            rate = task.resolve_rate(json_args, json_kwargs, arguments)
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
            timeout=timeout_seconds(options["timeout"]),
            backoff=backoff_to_json(options["backoff"]),
            concurrency_key=key,
            concurrency_limit=limit if key else None,
            concurrency_duration=lease,
            on_conflict=options["on_conflict"],
            rate_key=rate[0] if rate else None,
            rate_limit=rate[1].limit if rate else None,
            rate_period=rate[1].period if rate else None,
            unique_key=unique,
            unique_lock=unique,
            unique_until=options["unique_until"] if unique else None,
            batch=batch,
        )
        check_lengths(job)
        record_enqueue(job)  # OpenTelemetry, when installed: span + trace context (tracing.py)
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
        from django_jobs.checks import backend_checks

        return backend_checks(self)


# The strings of a job made from its call (a key filled from the arguments can be any
# length), and their columns' sizes.
BOUNDED_STRINGS = ("queue_name", "concurrency_key", "unique_key", "rate_key")


def check_lengths(job: Job) -> None:
    """Refuse a string longer than its column, naming it: SQLite would store it whole,
    MariaDB and PostgreSQL refuse the statement, and PostgreSQL's bulk insert once cut
    it short silently."""
    for name in BOUNDED_STRINGS:
        value = getattr(job, name)
        limit = Job._meta.get_field(name).max_length
        if value is not None and limit is not None and len(value) > limit:
            raise InvalidTask(
                f"{job.task_path}: the {name.replace('_', ' ')} {value[:60]!r}... is "
                f"{len(value)} characters long; it may be at most {limit}"
            )


def timeout_seconds(timeout: float | timedelta | None) -> float | None:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
