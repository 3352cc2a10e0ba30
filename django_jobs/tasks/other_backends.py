"""Our tasks under a backend that is not ours: Django's ``ImmediateBackend`` or
``DummyBackend``, which Django's docs suggest for a project's test settings.

A project's tasks are declared once, with our options, and imported whatever ``TASKS``
says; a test settings file that points ``TASKS`` at Django's backends must not turn
every ``@task(max_attempts=3)`` into an error at import. So under another backend:

- a task declared with our options is still a :class:`JobTask` (its options checked as
  ever, so a typo fails in the tests too), and the backend ignores them: one
  :class:`~django_jobs.exceptions.IgnoredJobOptions` warning per process says so;
- what only our backend can do refuses clearly (``workflow()``, ``chain()``,
  ``enqueue_batch()``, ``after=``): :func:`needs_jobs_backend`; ``bulk_enqueue()`` enqueues
  each call in turn under Django's two test backends, and refuses under any other;
- the functions a task body calls work as they do for a job that waited for nothing
  and cannot be cancelled: ``set_progress()`` keeps nothing, ``dependency_results()`` is
  empty, ``cancel_requested()`` is False. Django's backends announce each run with the
  ``task_started`` and ``task_finished`` signals; :func:`other_backend_running` counts them.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Sequence
from typing import Any

from django.tasks import task_backends
from django.tasks.backends.base import BaseTaskBackend

from django_jobs.exceptions import IgnoredJobOptions, NeedsJobsBackend
from django_jobs.tasks.backends import JobsBackendBase

# Runs of another backend's tasks under way in this context: an ImmediateBackend task
# that enqueues another runs it inside its own body.
RUNS_OF_OTHER_BACKENDS: contextvars.ContextVar[int] = contextvars.ContextVar(
    "django_jobs_runs_of_other_backends", default=0
)

# Whether this process has warned of ignored options yet (one warning per process).
warned = False


def is_ours(backend: BaseTaskBackend) -> bool:
    return isinstance(backend, JobsBackendBase)


def is_django_test_backend(backend: BaseTaskBackend) -> bool:
    """Django's ``ImmediateBackend`` or ``DummyBackend`` (ours that subclass them too)."""
    from django.tasks.backends.dummy import DummyBackend
    from django.tasks.backends.immediate import ImmediateBackend

    return isinstance(backend, ImmediateBackend | DummyBackend)


def describe(alias: str) -> str:
    """``'default' (django.tasks.backends.immediate.ImmediateBackend)``."""
    kind = type(task_backends[alias])
    return f"{alias!r} ({kind.__module__}.{kind.__qualname__})"


def needs_jobs_backend(alias: str, what: str) -> NeedsJobsBackend:
    """The refusal of ``what`` for a task of backend ``alias``, which is not ours."""
    return NeedsJobsBackend(
        f"{what} needs a django-jobs backend, and task backend {describe(alias)} is not one. "
        "In tests, keep TASKS on django_jobs.backend.JobsBackend and run what was enqueued "
        "with django_jobs.testing.run_enqueued_jobs() (docs/testing.md)."
    )


def warn_ignored_options(alias: str, task_path: str, options: Sequence[str]) -> None:
    """Say once per process that another backend ignores the options tasks declare."""
    global warned
    if warned:
        return
    warned = True
    warnings.warn(
        f"Task backend {describe(alias)} is not django-jobs': it ignores django-jobs options "
        f"({', '.join(options)} of {task_path}, and those of any other task). "
        "This warning is given once (docs/testing.md).",
        IgnoredJobOptions,
        stacklevel=3,  # the module declaring the task with @task(...)
    )


def other_backend_running() -> bool:
    """True inside the body of a task that another backend runs (Django's ImmediateBackend)."""
    return RUNS_OF_OTHER_BACKENDS.get() > 0


def sent_by_ours(sender: object) -> bool:
    """Whether a ``task_started``/``task_finished`` signal comes from our backend. Django
    sends the backend's class; others may send anything (django-tasks-db's worker sends
    its backend instance for ``task_started``): these receivers run inside every
    backend's worker, so they must never raise whatever the sender is."""
    kind = sender if isinstance(sender, type) else type(sender)
    return issubclass(kind, JobsBackendBase)


def note_start(sender: object, **kwargs: Any) -> None:
    """``task_started`` receiver: a task of another backend begins in this context."""
    if not sent_by_ours(sender):
        RUNS_OF_OTHER_BACKENDS.set(RUNS_OF_OTHER_BACKENDS.get() + 1)


def note_finish(sender: object, **kwargs: Any) -> None:
    """``task_finished`` receiver: that task has ended."""
    if not sent_by_ours(sender):
        RUNS_OF_OTHER_BACKENDS.set(max(0, RUNS_OF_OTHER_BACKENDS.get() - 1))


def connect() -> None:
    """Follow other backends' runs (called when the app is ready)."""
    from django.tasks.signals import task_finished, task_started

    task_started.connect(note_start, dispatch_uid="django_jobs.other_backends.start")
    task_finished.connect(note_finish, dispatch_uid="django_jobs.other_backends.finish")
