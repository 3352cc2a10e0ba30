"""Errors this package raises, each a subclass of Django's task exceptions where one fits."""

from django.tasks.exceptions import InvalidTask


class InvalidTaskArguments(InvalidTask, TypeError):
    """Arguments the task's function would not accept, or that would not come back from
    JSON as they went in: raised at enqueue, so nothing is written and the caller still
    has the values (a ``TypeError`` too, as Python raises for a bad call)."""


class TaskNotFound(Exception):
    """A job's task path no longer imports, or names something that is not a Task."""


class ProcessDied(Exception):
    """Recorded as a job's error when the process running it stopped heartbeating or exited."""


class WorkerShutdown(Exception):
    """Recorded as a job's error when a shutdown timeout cut its attempt short."""
