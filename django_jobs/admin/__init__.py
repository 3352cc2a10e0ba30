"""The jobs admin: dashboard, job list and pages, blocked keys, stuck jobs, processes,
rate-limited keys, recurring tasks, batches and workflows.

Every action goes through :mod:`django_jobs.core.operator`, which takes the
worker's own locks; see ``docs/admin.md``.
"""

from django_jobs.admin import (
    batches,
    blocked,
    dashboard,
    jobs,
    processes,
    rate_limited,
    recurring,
    stuck,
    workflows,
)

__all__ = [
    "batches",
    "blocked",
    "dashboard",
    "jobs",
    "processes",
    "rate_limited",
    "recurring",
    "stuck",
    "workflows",
]
