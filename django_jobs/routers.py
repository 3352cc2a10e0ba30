"""A database router for keeping the jobs tables in their own database.

Add ``"django_jobs.routers.JobsRouter"`` to ``DATABASE_ROUTERS`` and set
``DJANGO_JOBS["database"]`` to that alias (like Solid Queue's queue database).
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model

from django_jobs.conf import database_alias

APP_LABEL = "django_jobs"


class JobsRouter:
    def db_for_read(self, model: type[Model], **hints: Any) -> str | None:
        return database_alias() if model._meta.app_label == APP_LABEL else None

    def db_for_write(self, model: type[Model], **hints: Any) -> str | None:
        return database_alias() if model._meta.app_label == APP_LABEL else None

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        labels = {obj1._meta.app_label, obj2._meta.app_label}
        return True if labels == {APP_LABEL} else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label == APP_LABEL:
            return db == database_alias()
        return None
