"""Until the operator's module moves to the seam: ``delete_executions`` is
``ops(db).delete_executions`` (django_jobs/db/base.py, mysql.py)."""

from __future__ import annotations

from collections.abc import Collection

from django.db import models

from django_jobs.db import ops


def delete_executions(db: str, model: type[models.Model], job_ids: Collection[int]) -> int:
    return ops(db).delete_executions(db, model, job_ids)
