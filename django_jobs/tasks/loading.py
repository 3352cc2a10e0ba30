"""Importing a job's task by path, and refusing anything that is not a Task (invariant 7)."""

from __future__ import annotations

from django.tasks import Task
from django.utils.module_loading import import_string

from django_jobs.exceptions import TaskNotFound


def load_task(path: str) -> Task:
    try:
        target = import_string(path)
    except Exception as exc:  # any error importing user code means "cannot load"
        raise TaskNotFound(
            f"Task {path!r} cannot be imported: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(target, Task):
        raise TaskNotFound(
            f"{path!r} is a {type(target).__name__}, not a django.tasks.Task; "
            "only functions decorated with @task can run"
        )
    return target
