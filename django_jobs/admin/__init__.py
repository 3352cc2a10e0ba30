"""The jobs admin: dashboard, job list and pages, blocked keys, stuck jobs, processes.

Every action goes through :mod:`django_jobs.operations`, which takes the
worker's own locks; see ``docs/admin.md``.
"""

from . import blocked, dashboard, jobs, processes, stuck

__all__ = ["blocked", "dashboard", "jobs", "processes", "stuck"]
