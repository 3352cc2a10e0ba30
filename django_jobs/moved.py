"""The module paths of django-jobs 0.x before the package was split into ``tasks``, ``core``,
``db``, ``runtime`` and ``observability``: each old path still imports, as the module it became.

Why: the docs named some of these paths (``django_jobs.recurring.run_now``,
``django_jobs.backoff.Exponential``, ``django_jobs.job_task.JobTask``…), so projects import them.
An import of an old path warns once (``DeprecationWarning``) and gets the very module object of
the new path, so monkeypatching and ``isinstance`` see one module, not a copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED: dict[str, str] = {
    "django_jobs.admission": "django_jobs.core.admission",
    "django_jobs.backoff": "django_jobs.tasks.backoff",
    "django_jobs.batches": "django_jobs.core.batches",
    "django_jobs.cancellation": "django_jobs.core.operator",
    "django_jobs.discard": "django_jobs.core.operator",
    "django_jobs.inspection": "django_jobs.observability.inspection",
    "django_jobs.job_progress": "django_jobs.core.progress",
    "django_jobs.job_task": "django_jobs.tasks.job_task",
    "django_jobs.loading": "django_jobs.tasks.loading",
    "django_jobs.maintenance": "django_jobs.core.maintenance",
    "django_jobs.notify": "django_jobs.db.notify",
    "django_jobs.operations": "django_jobs.core.operator",
    "django_jobs.processes": "django_jobs.core.processes",
    "django_jobs.queues": "django_jobs.core.queues",
    "django_jobs.rate_limits": "django_jobs.core.rate_limits",
    "django_jobs.rates": "django_jobs.tasks.rates",
    "django_jobs.readiness": "django_jobs.core.ready",
    "django_jobs.recurring": "django_jobs.core.recurring",
    "django_jobs.results": "django_jobs.tasks.results",
    "django_jobs.runner": "django_jobs.runtime",
    # The one module of runner/ that did not move to runtime/ (the prefix rule below).
    "django_jobs.runner.db_retry": "django_jobs.db.retry",
    "django_jobs.schedules": "django_jobs.tasks.schedules",
    "django_jobs.scheduling": "django_jobs.core.scheduling",
    "django_jobs.serialization": "django_jobs.tasks.serialization",
    "django_jobs.tracing": "django_jobs.observability.tracing",
    "django_jobs.transactions": "django_jobs.db.transactions",
    "django_jobs.uniqueness": "django_jobs.core.uniqueness",
}


def new_path(name: str) -> str | None:
    """The current path of an old module path (``django_jobs.runner.worker`` included)."""
    if name in MOVED:
        return MOVED[name]
    if name.startswith("django_jobs.runner."):
        return "django_jobs.runtime." + name.removeprefix("django_jobs.runner.")
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module of its new path."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> ModuleSpec | None:
        if new_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def exec_module(self, module: ModuleType) -> None:
        """Puts the new path's module where the import system takes the result from, so the
        old name and the new one are one module (a second execution would make a copy)."""
        new = new_path(module.__name__)
        assert new is not None
        warnings.warn(
            f"{module.__name__} moved to {new}; import it from there.",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """First on ``sys.meta_path``: for ``django_jobs.runner.worker`` the path finder would
    otherwise find ``runtime/worker.py`` through the parent's ``__path__`` and run a copy."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
