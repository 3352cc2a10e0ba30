"""Which backends of ``TASKS`` are django-jobs', and the database each writes to.

Apart from ``django_jobs.backend`` (the adapter Django loads, built on the core) so that the
system checks, the recurring ticks and the metrics can ask without importing the adapter,
which imports them.
"""

from __future__ import annotations

from django.tasks import task_backends
from django.tasks.backends.base import BaseTaskBackend

from django_jobs.conf import database_alias


class JobsBackendBase(BaseTaskBackend):
    """What django-jobs knows of its own backend: the database it writes its jobs to.
    ``django_jobs.backend.JobsBackend`` is the backend; this base is what the rest reads."""

    @property
    def database(self) -> str:
        """The alias of the database this backend writes its jobs to."""
        return self.options.get("database") or database_alias()


def jobs_backends(db: str | None = None) -> list[JobsBackendBase]:
    """The django-jobs backends of ``TASKS``, in its order, that write to database ``db``
    (to any database if None): the one answer to "is this backend ours, writing there?"
    for the system checks, the recurring ticks and the metrics."""
    backends = (task_backends[alias] for alias in task_backends.settings)
    return [
        backend
        for backend in backends
        if isinstance(backend, JobsBackendBase) and (db is None or backend.database == db)
    ]
