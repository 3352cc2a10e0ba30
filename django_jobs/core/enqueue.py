"""Enqueueing: each call checked and made into an unsaved ``Job``, then every job of one bulk
enqueue written in a handful of statements.

``django_jobs.backend.JobsBackend`` (the ``django.tasks`` backend) delegates its ``enqueue``
and ``bulk_enqueue`` here, and ``core.batches`` prepares its callbacks' jobs here. Values are
checked where they are made (docs/design.md, invariant 10): an invalid call raises before
anything is written, naming what is wrong.

A job goes in one of four ways: ready at once with nothing to lock (where the database can,
one statement inserts the job rows and their ready rows), scheduled (``run_after`` in the
future), unique (its key taken under the unique index, ``core.uniqueness``), or through its
concurrency key's semaphore (``core.admission``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import cache
from inspect import iscoroutinefunction
from typing import Any, Protocol, cast

from django.tasks import Task, TaskResult
from django.tasks.exceptions import InvalidTask
from django.tasks.signals import task_enqueued
from django.utils import timezone

from django_jobs.conf import fair_queue_names, fair_queues_problem, raw_setting
from django_jobs.core.admission import admit_jobs
from django_jobs.core.attempts import retried
from django_jobs.core.dependency_graph import Graph, check_databases, graph_of, write_graph
from django_jobs.core.uniqueness import insert_unique, unique_in_key_order
from django_jobs.db import features, ops
from django_jobs.db.transactions import hot_transaction
from django_jobs.exceptions import InvalidDependency
from django_jobs.models import Batch, Job, JobStatus, ScheduledExecution
from django_jobs.observability.tracing import record_enqueue
from django_jobs.tasks.backoff import backoff_to_json
from django_jobs.tasks.job_task import (
    Call,
    Dependency,
    JobTask,
    bound_arguments,
    checked_calls,
    job_options,
)
from django_jobs.tasks.results import build_result
from django_jobs.tasks.serialization import json_arguments
from django_jobs.text import safe_repr

# Rows per INSERT of Django's bulk_create.
BULK_BATCH_SIZE = 1000

# The strings of a job made from its call (a key filled from the arguments can be any
# length); each is checked against its column's size.
BOUNDED_STRINGS = ("queue_name", "concurrency_key", "unique_key", "rate_key", "fair_key")
# Whether a task's queue is one of ``DJANGO_JOBS["fair_queues"]``: kept beside its options,
# so read once per task of a bulk enqueue.
IN_FAIR_QUEUE = "in fair queue"


class EnqueuingBackend(Protocol):
    """What the enqueue needs of its backend: ``django_jobs.backend.JobsBackend``, known
    here by this much only, since that adapter is built on this module."""

    alias: str

    @property
    def database(self) -> str: ...

    def validate_task(self, task: Task) -> None: ...

    def get_result(self, result_id: str) -> TaskResult: ...

    def prepare_job(
        self,
        task: Task,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        batch: Batch | None = None,
        checked: dict[int, dict[str, Any]] | None = None,
    ) -> tuple[Job, Task]: ...


def bulk_enqueue(
    backend: EnqueuingBackend, calls: Iterable[Call], *, batch: Batch | None = None
) -> list[TaskResult]:
    """Enqueue many calls in one transaction and a handful of queries.

    All or nothing: one invalid call raises before anything is written. A
    call of a unique task whose key is held gives the holder's result
    instead of a new job (see ``django_jobs.core.uniqueness``). ``batch``: the
    (saved) batch the jobs are items of.

    A deadlock the database breaks by rolling this enqueue back is retried
    when the transaction was this call's own: nothing else was in it, so
    running it again is safe. Inside the caller's ``atomic()`` the whole
    transaction is already gone, and only the caller can run it again: the
    error is raised with a note saying so (docs/unique.md). In its own
    transaction it waits for no row of a job it waits for (``after=``):
    finding one held, it rolls back and runs again (``core.attempts``).
    """
    calls = checked_calls(calls, "bulk_enqueue()")
    if not calls:
        return []
    results, new = retried(
        backend.database, lambda wait: write_calls(backend, calls, batch, None, wait)
    )
    announce(backend, new)
    return results


def announce(backend: EnqueuingBackend, new: Iterable[TaskResult]) -> None:
    """``task_enqueued`` for each job added, once its enqueue has committed (or joined the
    caller's transaction): after the tries, so that a receiver's error never enqueues the
    calls again and no receiver hears of a try that was rolled back."""
    for result in new:
        task_enqueued.send(type(backend), task_result=result)


def write_calls(
    backend: EnqueuingBackend,
    calls: Sequence[Call],
    batch: Batch | None,
    graph: Graph | None = None,
    wait_for_parents: bool = True,
) -> tuple[list[TaskResult], list[TaskResult]]:
    """One try of an enqueue: prepare every job, then write them all. ``graph``: what the
    calls wait for, by index (``core.workflows`` builds it; a call's own ``using(after=...)``
    is added to it, so each try needs a graph of its own), see ``core.dependencies``.
    ``wait_for_parents``: see ``core.attempts`` (the caller runs the tries, and announces the
    jobs added after them: :func:`announce`).

    Returns every call's result, and the results of the jobs it added (not a
    duplicate's holder), for the ``task_enqueued`` signal.
    """
    checked: dict[int, dict[str, Any]] = {}  # id(task) -> its options, validated once
    # Through the backend, so that a subclass's prepare_job applies here as to callbacks.
    batches = graph.batches if graph is not None else {}
    prepared = [
        backend.prepare_job(task, args, kwargs, batches.get(index, batch), checked)
        for index, (task, args, kwargs) in enumerate(calls)
    ]
    db = backend.database
    graph = graph_of(prepared, graph)
    if graph is not None:
        check_databases(db, graph, backend_databases(graph))
        with hot_transaction(db):
            holders = write_graph(
                db,
                prepared,
                graph,
                insert_unique,
                unique_in_key_order(prepared),
                wait_for_parents=wait_for_parents,
            )
            held = {index: backend.get_result(str(holder.pk)) for index, holder in holders.items()}
        return results_of(prepared, held)
    plain = plain_ready_jobs(prepared)
    # One job ready at once, of a fair queue too: its one round trip stamps it as well
    # (MySQL/MariaDB's procedure, PostgreSQL's statement).
    alone = [job for job, _ in prepared if nothing_to_lock(job)] if len(prepared) == 1 else []
    if alone and ops(db).enqueue_ready(db, alone[0]):
        # One round trip, atomic on its own, where the database has a way (MySQL).
        results = [build_result(alone[0], task=prepared[0][1])]
        return results, results
    quick = (alone or plain) if features(db).can_insert_ready_in_one_statement else []
    if len(quick) == len(prepared) and len(quick) <= ops(db).insert_chunk_size:
        # One statement, atomic on its own: no BEGIN/COMMIT round trips.
        ops(db).insert_ready_jobs(db, quick)
        results = [build_result(job, task=task) for job, task in prepared]
        return results, results
    # Plain inserts fail only on a database error, which breaks a caller's transaction
    # anyway: no SAVEPOINT/RELEASE round trips around them inside the caller's atomic().
    # Any other write (a decision, a check against rows) may raise our own errors after
    # writing, and its savepoint takes those writes back.
    with hot_transaction(db, savepoint=len(plain) < len(prepared)):
        if quick:
            ops(db).insert_ready_jobs(db, quick)
        holders = insert_the_others(db, prepared, {id(job) for job in quick})
        held = {index: backend.get_result(str(holder.pk)) for index, holder in holders.items()}
    return results_of(prepared, held)


def results_of(
    prepared: list[tuple[Job, Task]], held: dict[int, TaskResult]
) -> tuple[list[TaskResult], list[TaskResult]]:
    """Every call's result (a unique key's holder's where ``held`` has one), and the
    results of the jobs added."""
    results = [
        held[index] if index in held else build_result(job, task=task)
        for index, (job, task) in enumerate(prepared)
    ]
    return results, [result for index, result in enumerate(results) if index not in held]


def backend_databases(graph: Graph) -> dict[str, str]:
    """The database of each backend alias ``graph``'s dependencies name (a backend that
    is not ours has none, and is refused)."""
    from django.tasks import task_backends

    databases: dict[str, str] = {}
    for items in graph.after.values():
        for item in items:
            if isinstance(item, Dependency) and item.backend is not None:
                target = task_backends[item.backend]
                database = getattr(target, "database", None)
                if database is None:
                    raise InvalidDependency(
                        f"after= names a job of backend {item.backend!r}, "
                        "which is not a django-jobs backend"
                    )
                databases[item.backend] = database
    return databases


def plain_ready_jobs(prepared: list[tuple[Job, Task]]) -> list[Job]:
    """The jobs ready at once with nothing to lock or check (no key, not unique, not
    deferred, of no fair queue): a database that can inserts them with their ready rows in
    one statement."""
    return [job for job, _ in prepared if nothing_to_lock(job) and job.fair_key is None]


def nothing_to_lock(job: Job) -> bool:
    """Ready at once, with no key's semaphore and no unique key to take."""
    return job.status == JobStatus.READY and not job.concurrency_key and job.unique_lock is None


def insert_the_others(
    db: str, prepared: list[tuple[Job, Task]], inserted: set[int]
) -> dict[int, Job]:
    """Write every prepared job not ``inserted`` yet (``id()`` of the jobs), inside the
    caller's transaction; returns the holders of the unique keys already taken, by the
    index of the call that wanted them."""
    plain = [job for job, _ in prepared if job.unique_lock is None and id(job) not in inserted]
    Job.objects.using(db).bulk_create(plain, batch_size=BULK_BATCH_SIZE)
    if any(job.pk is None for job in plain):
        # MySQL (unlike MariaDB) cannot return ids from a bulk insert.
        for job in plain:
            job.save(using=db, force_insert=True)
    holders: dict[int, Job] = {}
    for index in unique_in_key_order(prepared):
        holder = insert_unique(db, prepared[index][0])
        if holder is not None:
            holders[index] = holder
    jobs = [job for index, (job, _) in enumerate(prepared) if index not in holders]
    insert_scheduled(db, [job for job in jobs if job.status == JobStatus.SCHEDULED])
    admit_jobs(
        db,
        [job for job in jobs if job.status != JobStatus.SCHEDULED and id(job) not in inserted],
    )
    return holders


def insert_scheduled(db: str, jobs: list[Job]) -> None:
    """The scheduled rows of saved jobs due later (``prepare_job`` saw their ``run_after``
    in the future); the dispatcher admits each when due."""
    if not jobs:
        return
    ScheduledExecution.objects.using(db).bulk_create(
        [
            ScheduledExecution(
                job_id=job.pk,
                queue_name=job.queue_name,
                priority=job.priority,
                scheduled_at=cast(datetime, job.run_after),
            )
            for job in jobs
        ],
        batch_size=BULK_BATCH_SIZE,
    )


def prepare_job(
    backend: EnqueuingBackend,
    task: Task,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    batch: Batch | None = None,
    checked: dict[int, dict[str, Any]] | None = None,
) -> tuple[Job, Task]:
    """An unsaved job for one call, every value checked. ``checked`` caches each task's
    validation and options across the calls of one bulk enqueue (the calls hold the
    tasks alive, so ``id()`` is stable)."""
    if not isinstance(task, Task):
        raise InvalidTask(f"{safe_repr(task, 80)} is not a task (a function decorated with @task)")
    options = task_options(backend, task, checked)
    json_args, json_kwargs = json_arguments(args, kwargs, backend.database)
    # Every call is bound, keyed or not: one the function would refuse fails
    # here, naming the argument, not in a worker later.
    arguments = bound_arguments(task, json_args, json_kwargs)
    fair_queue = options.get(IN_FAIR_QUEUE)
    if fair_queue is None:
        # ``options`` is what ``checked`` keeps for the task: the setting is read once per
        # task of a bulk enqueue (once per call without ``checked``).
        fair_queue = options[IN_FAIR_QUEUE] = task.queue_name in fair_queue_names()
    key = unique = rate = lease = fair_key = fair_weight = None
    if isinstance(task, JobTask):
        key = task.resolve_concurrency_key(json_args, json_kwargs, arguments)
        unique = task.resolve_unique_key(json_args, json_kwargs, arguments)
        rate = task.resolve_rate(json_args, json_kwargs, arguments)
        lease = task.lease_seconds if key else None
        if fair_queue:
            fair_key = task.resolve_fair_key(json_args, json_kwargs, arguments)
            weight = options["fair_weight"]
            fair_weight = None if weight is None else float(weight)
        elif options["fair_key"] is not None or options["fair_weight"] is not None:
            # A group no claim would read: refused, not dropped (docs/fairness.md).
            given = [name for name in ("fair_key", "fair_weight") if options[name] is not None]
            unread = fair_queues_problem(raw_setting("fair_queues") or ())
            raise InvalidTask(
                f"{task.module_path} gives {' and '.join(given)} for queue "
                f"{task.queue_name!r}, which is not fair: add it to "
                "DJANGO_JOBS['fair_queues']"
                + (f" ({unread}: check django_jobs.E025)" if unread else "")
            )
    if fair_queue and fair_key is None:
        fair_key = ""  # the group of the queue's jobs of no key
    key, limit = batch_concurrency(task, batch, key, options["concurrency_limit"], unique)
    now = timezone.now()
    future = task.run_after is not None and task.run_after > now
    job = new_job(
        backend=backend.alias,
        task_path=task.module_path,
        queue_name=task.queue_name,
        priority=task.priority,
        is_async=iscoroutinefunction(task.func),
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
        fair_key=fair_key,
        fair_weight=fair_weight,
        batch_id=None if batch is None else batch.pk,
    )
    if batch is not None:
        job.batch = batch  # the saved batch itself: its callbacks read it from the job
    check_lengths(job)
    record_enqueue(job)  # OpenTelemetry, when installed: span + trace context (tracing.py)
    return job, task


def new_job(**values: Any) -> Job:
    """An unsaved ``Job`` of ``values`` (by attribute name), every other field its default.

    Given every field's value in order, ``Model.__init__`` takes its fast path (as
    ``from_db`` does): by keyword it looks each of 39 fields up and asks each missing
    one for its default, a fifth of the Python time of an enqueue (cProfile).
    """
    ordered = [values[name] if name in values else default() for name, default in defaults()]
    return Job(*ordered)  # type: ignore[misc]  # django-stubs types only the keyword form


@cache
def defaults() -> tuple[tuple[str, Callable[[], Any]], ...]:
    """Each concrete field of a job, in order: its attribute name and what makes its default."""
    return tuple((field.attname, field.get_default) for field in Job._meta.concrete_fields)


def task_options(
    backend: EnqueuingBackend, task: Task, checked: dict[int, dict[str, Any]] | None
) -> dict[str, Any]:
    """The task validated by its backend, and its django-jobs options; once per task of a
    bulk enqueue when ``checked`` is given."""
    options = None if checked is None else checked.get(id(task))
    if options is None:
        backend.validate_task(task)
        options = job_options(task)
        if checked is not None:
            checked[id(task)] = options
    return options


def batch_concurrency(
    task: Task, batch: Batch | None, key: str | None, limit: int | None, unique: str | None
) -> tuple[str | None, int | None]:
    """The concurrency key and limit of a call: its task's, or, for an item of a batch with
    a ``concurrency_limit``, the batch's. Refuses what a batch item cannot be."""
    if batch is None:
        return key, limit
    if unique:
        raise InvalidTask(
            f"{task.module_path} is a unique task: it cannot be a batch item, "
            "whose count would then depend on another job"
        )
    if not batch.concurrency_limit:
        return key, limit
    if key:
        raise InvalidTask(
            f"{task.module_path} has its own concurrency_key; a batch's "
            "concurrency_limit would replace it"
        )
    return batch.concurrency_key, batch.concurrency_limit


def check_lengths(job: Job) -> None:
    """Refuse a string longer than its column, naming it: SQLite would store it whole,
    MariaDB and PostgreSQL refuse the statement, and PostgreSQL's bulk insert once cut
    it short silently."""
    for name in BOUNDED_STRINGS:
        value = getattr(job, name)
        limit = getattr(Job._meta.get_field(name), "max_length", None)
        if value is not None and limit is not None and len(value) > limit:
            raise InvalidTask(
                f"{job.task_path}: the {name.replace('_', ' ')} {value[:60]!r}... is "
                f"{len(value)} characters long; it may be at most {limit}"
            )


def timeout_seconds(timeout: float | timedelta | None) -> float | None:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
