"""Testing code that enqueues jobs: run them in the test, assert what was enqueued.

``run_enqueued_jobs()`` runs the jobs that are due in the test's own process, on the
test's own database connection, through the same state machine as ``run_jobs`` (claim,
start, finish, fail and retry, snooze, concurrency keys, workflows, batches), inside a
``TestCase``'s transaction too. ``assert_enqueued()``, ``assert_not_enqueued()`` and
``enqueued_jobs()`` read what waits (``clear_dummy_backends()`` forgets what Django's
``DummyBackend`` kept from the tests before). pytest users get the same through the ``jobs``
fixture (``django_jobs.testing.pytest_plugin``). docs/testing.md has the examples.

Each name is imported from its module when first used, so that importing this package
(as the pytest plugin does in every pytest run) imports none of Django's models.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_jobs.testing.enqueued import (
        EnqueuedJob,
        assert_enqueued,
        assert_not_enqueued,
        clear_dummy_backends,
        enqueued_jobs,
    )
    from django_jobs.testing.errors import JobsNotReady, RunawayJobs
    from django_jobs.testing.recurring import enqueue_recurring
    from django_jobs.testing.report import ErrorRecord, JobRun, Outcome, RunReport
    from django_jobs.testing.runner import run_enqueued_jobs

__all__ = [
    "EnqueuedJob",
    "ErrorRecord",
    "JobRun",
    "JobsNotReady",
    "Outcome",
    "RunReport",
    "RunawayJobs",
    "assert_enqueued",
    "assert_not_enqueued",
    "clear_dummy_backends",
    "enqueue_recurring",
    "enqueued_jobs",
    "run_enqueued_jobs",
]

# Public name -> the module of this package that defines it.
_HOMES = {
    "EnqueuedJob": "enqueued",
    "assert_enqueued": "enqueued",
    "assert_not_enqueued": "enqueued",
    "clear_dummy_backends": "enqueued",
    "enqueued_jobs": "enqueued",
    "JobsNotReady": "errors",
    "RunawayJobs": "errors",
    "enqueue_recurring": "recurring",
    "ErrorRecord": "report",
    "JobRun": "report",
    "Outcome": "report",
    "RunReport": "report",
    "run_enqueued_jobs": "runner",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
