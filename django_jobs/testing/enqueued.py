"""What waits to run: the jobs enqueued and not yet run, read for a test's assertions.

Read from the jobs tables (ready, scheduled, blocked and awaiting jobs), and from
Django's ``DummyBackend``: a project whose test settings point ``TASKS`` at the dummy
backend gets the same assertions over what that backend kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db.models import F
from django.tasks import task_backends
from django.tasks.backends.dummy import DummyBackend

from django_jobs.conf import database_alias
from django_jobs.testing.readiness import require_jobs_tables
from django_jobs.testing.report import LISTED, call_arguments, listed, task_path

if TYPE_CHECKING:
    from django.tasks import Task, TaskResult


@dataclass(frozen=True)
class EnqueuedJob:
    """One job waiting to run: a row of the jobs tables or a ``DummyBackend`` result."""

    # The job's id (an int) in the jobs tables, the result's id (a str) in a dummy backend.
    id: int | str
    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]
    queue_name: str
    priority: int
    # ready, scheduled, blocked or awaiting (a dummy backend's results are all "ready").
    status: str
    # When it is due: for a scheduled job its planned run (a retry's backoff and a snooze
    # included), for the others the run_after it was enqueued with (None: none).
    run_after: datetime | None
    # The alias of the TASKS backend that holds it (None: the jobs tables).
    backend: str | None = None

    def __str__(self) -> str:
        where = f" backend={self.backend!r}" if self.backend else ""
        after = f" run_after={self.run_after.isoformat()}" if self.run_after else ""
        return (
            f"#{self.id} {self.task_path}({call_arguments(self.args, self.kwargs)}) "
            f"queue={self.queue_name!r} status={self.status}{after}{where}"
        )


def enqueued_jobs(
    task: Task | str | None = None,
    *,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    queue: str | Iterable[str] | None = None,
    using: str | None = None,
) -> list[EnqueuedJob]:
    """The jobs waiting to run (ready, scheduled, blocked, awaiting their dependencies),
    in the order they were enqueued, optionally only those that match.

    :param task: a task object or its dotted path (``"myapp.tasks.send_email"``).
    :param args: the positional arguments, compared as the job stores them (a tuple
        equals the list it became). ``unittest.mock.ANY`` matches any one value.
    :param kwargs: the keyword arguments, all of them (``ANY`` for a value you do not
        care about).
    :param queue: a queue name, or several.
    :param using: the database of the jobs tables (default: the jobs database).
    """
    path = None if task is None else task_path(task)
    check_arguments(args, kwargs)
    queues = None if queue is None else ({queue} if isinstance(queue, str) else set(queue))
    found = [*table_jobs(using or database_alias(), path, queues), *dummy_jobs(path, queues)]
    return [job for job in found if arguments_match(job, args, kwargs)]


def waiting_listing(using: str | None) -> str:
    """What is waiting, for a failure message: how many, and the first :data:`LISTED`."""
    db = using or database_alias()
    dummies = dummy_jobs(None, None)
    total = table_count(db) + len(dummies)
    if not total:
        return "Nothing is waiting to run."
    shown = [*table_jobs(db, None, None, LISTED), *dummies][:LISTED]
    return "\n".join([f"Waiting to run ({total}):", *listed([str(job) for job in shown], total)])


def assert_enqueued(
    task: Task | str | None = None,
    *,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    queue: str | Iterable[str] | None = None,
    count: int | None = None,
    using: str | None = None,
) -> list[EnqueuedJob]:
    """Assert that jobs matching are waiting to run: at least one, or exactly ``count``.

    Takes :func:`enqueued_jobs`' filters, and ``count``: a number of jobs (0 and up).
    Returns the matching jobs. The failure message lists what *is* waiting (the first 20).
    """
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"assert_enqueued(): count must be an int, not {count!r}")
        if count < 0:
            raise ValueError(f"assert_enqueued(): count must be 0 or more, not {count}")
    matching = enqueued_jobs(task, args=args, kwargs=kwargs, queue=queue, using=using)
    if (count is None and matching) or (count is not None and len(matching) == count):
        return matching
    wanted = "at least one job" if count is None else f"{count} job(s)"
    raise AssertionError(
        f"expected {wanted} {describe_filter(task, args, kwargs, queue)} waiting to run, "
        f"found {len(matching)}.{backend_note(task)}\n{waiting_listing(using)}"
    )


def assert_not_enqueued(
    task: Task | str | None = None,
    *,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    queue: str | Iterable[str] | None = None,
    using: str | None = None,
) -> None:
    """Assert that no job matching is waiting to run (:func:`enqueued_jobs`' filters)."""
    matching = enqueued_jobs(task, args=args, kwargs=kwargs, queue=queue, using=using)
    if not matching:
        return
    raise AssertionError(
        f"expected no job {describe_filter(task, args, kwargs, queue)} waiting to run, "
        f"found {len(matching)}:\n" + "\n".join(listed([str(job) for job in matching]))
    )


def check_arguments(args: object, kwargs: object) -> None:
    """Refuse what cannot be a job's arguments: a string as ``args`` (it would be
    compared as a list of its characters), a ``kwargs`` that is not a mapping."""
    if isinstance(args, str | bytes) or not (args is None or isinstance(args, Sequence)):
        raise TypeError(
            f"args= takes a list or tuple of the positional arguments "
            f"(args=[{args!r}] for a single one), not {type(args).__name__}"
        )
    if not (kwargs is None or isinstance(kwargs, Mapping)):
        raise TypeError(
            f"kwargs= takes a dict of the keyword arguments, not {type(kwargs).__name__}"
        )


def table_jobs(
    db: str, path: str | None, queues: set[str] | None, limit: int | None = None
) -> list[EnqueuedJob]:
    """The waiting jobs of the jobs tables, by id, the first ``limit`` of them."""
    from django_jobs.tasks.backends import jobs_backends

    if not jobs_backends():
        return []  # no backend of ours: nothing can be in the tables (or the tables at all)
    require_jobs_tables(db)
    from django_jobs.models import WAITING_STATUSES, Job

    rows = (
        Job.objects.using(db)
        .filter(status__in=WAITING_STATUSES)
        .annotate(scheduled_for=F("scheduled_execution__scheduled_at"))
    )
    if path is not None:
        rows = rows.filter(task_path=path)
    if queues is not None:
        rows = rows.filter(queue_name__in=queues)
    rows = rows.order_by("pk")
    if limit is not None:
        rows = rows[:limit]
    return [
        EnqueuedJob(
            id=job.pk,
            task_path=job.task_path,
            args=list(job.args or []),
            kwargs=dict(job.kwargs or {}),
            queue_name=job.queue_name,
            priority=job.priority,
            status=job.status,
            run_after=job.scheduled_for or job.run_after,
        )
        for job in rows
    ]


def table_count(db: str) -> int:
    from django_jobs.tasks.backends import jobs_backends

    if not jobs_backends():
        return 0
    from django_jobs.models import WAITING_STATUSES, Job

    return Job.objects.using(db).filter(status__in=WAITING_STATUSES).count()


def dummy_jobs(path: str | None, queues: set[str] | None) -> list[EnqueuedJob]:
    """The results Django's ``DummyBackend`` keeps, for each such backend of ``TASKS``."""
    found = []
    for alias in task_backends.settings:
        backend = task_backends[alias]
        if not isinstance(backend, DummyBackend):
            continue
        results: list[TaskResult] = backend.results
        for result in results:
            if path is not None and result.task.module_path != path:
                continue
            if queues is not None and result.task.queue_name not in queues:
                continue
            found.append(
                EnqueuedJob(
                    id=result.id,
                    task_path=result.task.module_path,
                    args=list(result.args),
                    kwargs=dict(result.kwargs),
                    queue_name=result.task.queue_name,
                    priority=result.task.priority,
                    status="ready",
                    run_after=result.task.run_after,
                    backend=alias,
                )
            )
    return found


def clear_dummy_backends() -> None:
    """Forget what every Django ``DummyBackend`` of ``TASKS`` kept.

    Such a backend keeps its results for the life of the process, so without this the
    assertions of one test see the jobs enqueued by the tests before it. The ``jobs``
    fixture calls it before each test; a ``TestCase`` calls it in ``setUp()``."""
    for alias in task_backends.settings:
        backend = task_backends[alias]
        if isinstance(backend, DummyBackend):
            backend.clear()


def as_stored(value: Any) -> Any:
    """``value`` as the JSON column gives it back: tuples become lists, recursively."""
    if isinstance(value, tuple | list):
        return [as_stored(item) for item in value]
    if isinstance(value, dict):
        return {key: as_stored(item) for key, item in value.items()}
    return value


def arguments_match(
    job: EnqueuedJob, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> bool:
    # The expected value on the left: unittest.mock.ANY's __eq__ is then the one asked.
    if args is not None and as_stored(list(args)) != job.args:
        return False
    return kwargs is None or as_stored(dict(kwargs)) == job.kwargs


def describe_filter(
    task: Task | str | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    queue: str | Iterable[str] | None,
) -> str:
    parts = ["of any task" if task is None else f"of {task_path(task)}"]
    if args is not None:
        parts.append(f"with args={as_stored(list(args))!r}")
    if kwargs is not None:
        parts.append(f"with kwargs={dict(kwargs)!r}")
    if queue is not None:
        parts.append(f"in queue {queue!r}" if isinstance(queue, str) else f"in {list(queue)!r}")
    return " ".join(parts)


def backend_note(task: Task | str | None) -> str:
    """Why nothing of ``task`` can be found, when its backend keeps nothing waiting
    (Django's ``ImmediateBackend`` runs it at once) or it cannot be imported."""
    if task is None:
        return ""
    from django_jobs.exceptions import TaskNotFound
    from django_jobs.tasks.backends import JobsBackendBase
    from django_jobs.tasks.loading import load_task

    try:
        loaded = load_task(task) if isinstance(task, str) else task
        backend = loaded.get_backend()
    except TaskNotFound as exc:
        return f"\nNote: {exc}"
    except Exception:
        return ""
    if isinstance(backend, JobsBackendBase | DummyBackend):
        return ""
    return (
        f"\nNote: {loaded.module_path} goes to backend {backend.alias!r} "
        f"({type(backend).__name__}), which keeps no job waiting to be found."
    )
