"""Whether a database can hold jobs, checked before the toolkit touches it, so that a
test pointed at the wrong database, or one without migrations, fails with the fix in
the message instead of a database error from deep inside a claim."""

from __future__ import annotations

from django.apps import apps
from django.db import connections

from django_jobs.testing.errors import JobsNotReady


def require_jobs_tables(db: str) -> None:
    """Raise :class:`JobsNotReady` unless ``django_jobs`` is installed and its tables
    exist in database ``db``."""
    if db not in connections:
        raise JobsNotReady(
            f"there is no database {db!r} in DATABASES (django_jobs.testing was asked to use it)"
        )
    if not apps.is_installed("django_jobs"):
        raise JobsNotReady(
            'django_jobs is not in INSTALLED_APPS: add "django_jobs" to the settings the '
            "tests run with, so that the test database gets its tables"
        )
    from django_jobs.models import Job

    table = Job._meta.db_table
    if table not in connections[db].introspection.table_names():
        raise JobsNotReady(
            f"the jobs tables are missing from database {db!r} ({table} not found): run "
            f"its migrations (`manage.py migrate django_jobs`). In tests, let the test "
            f"runner create the test database (pytest: --create-db once, if --reuse-db "
            f"kept one made before django_jobs was installed)"
        )


def require_jobs_backend(db: str) -> None:
    """Raise :class:`JobsNotReady` unless some backend of ``TASKS`` writes its jobs to
    ``db``: without one no enqueue reaches the tables the runner reads, and a test
    that ran nothing would pass for the wrong reason."""
    from django.tasks import task_backends

    from django_jobs.tasks.backends import jobs_backends

    if jobs_backends(db):
        return
    configured = ", ".join(
        f"{alias!r} ({type(task_backends[alias]).__name__})" for alias in task_backends.settings
    )
    raise JobsNotReady(
        f"no backend of TASKS is django_jobs.backend.JobsBackend writing to database "
        f"{db!r} (TASKS has {configured or 'no backend'}), so no job can be waiting there "
        f"to run. Point TASKS at django_jobs.backend.JobsBackend in the test settings, or "
        f"pass using= the database your backend writes to"
    )
