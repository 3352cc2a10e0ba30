"""System checks: settings that would make the worker misbehave are errors at startup."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.checks import Error, Warning
from django.db import connections

from .conf import JobsSettings, jobs_settings
from .queues import QueueSelector

if TYPE_CHECKING:
    from .backend import JobsBackend


def backend_checks(backend: JobsBackend) -> list[Any]:
    errors: list[Any] = []
    db = backend.database
    if db not in connections.databases:
        return [
            Error(
                f"django-jobs database alias {db!r} is not in DATABASES.",
                id="django_jobs.E001",
            )
        ]
    errors.extend(sqlite_checks(db, connections.databases[db]))
    unknown = JobsSettings.unknown_keys()
    if unknown:
        errors.append(
            Error(
                f"Unknown DJANGO_JOBS setting(s): {', '.join(unknown)}.",
                id="django_jobs.E003",
            )
        )
        return errors
    try:
        conf = jobs_settings()
    except (TypeError, ValueError) as exc:
        return [*errors, Error(f"Invalid DJANGO_JOBS settings: {exc}", id="django_jobs.E004")]
    errors.extend(number_checks(conf))
    declared = backend.queues
    for pattern in conf.queues:
        if not QueueSelector.is_wildcard(pattern) and declared and pattern not in declared:
            errors.append(
                Error(
                    f"DJANGO_JOBS['queues'] names {pattern!r}, which is not in the "
                    f"QUEUES of task backend {backend.alias!r}.",
                    hint=f"Known queues: {', '.join(sorted(declared))}.",
                    id="django_jobs.E005",
                )
            )
    for queue in conf.max_concurrency:
        if declared and queue not in declared:
            errors.append(
                Error(
                    f"DJANGO_JOBS['max_concurrency'] names unknown queue {queue!r}.",
                    id="django_jobs.E006",
                )
            )
    return errors


def sqlite_checks(alias: str, settings_dict: dict[str, Any]) -> list[Any]:
    if settings_dict["ENGINE"] != "django.db.backends.sqlite3":
        return []
    if (settings_dict.get("OPTIONS") or {}).get("transaction_mode") == "IMMEDIATE":
        return []
    return [
        Error(
            f"SQLite database {alias!r} must use OPTIONS={{'transaction_mode': 'IMMEDIATE'}}.",
            hint="Without BEGIN IMMEDIATE, two workers can read the same ready job "
            "before either writes, and concurrency limits are not serialised.",
            id="django_jobs.E002",
        )
    ]


def number_checks(conf: JobsSettings) -> list[Any]:
    errors: list[Any] = []
    for name in ("processes", "threads", "batch_size"):
        value = getattr(conf, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            errors.append(
                Error(f"DJANGO_JOBS[{name!r}] must be an integer >= 1.", id="django_jobs.E007")
            )
    for name in (
        "polling_interval",
        "dispatcher_interval",
        "heartbeat_interval",
        "alive_threshold",
        "shutdown_timeout",
    ):
        value = getattr(conf, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            errors.append(
                Error(f"DJANGO_JOBS[{name!r}] must be a number > 0.", id="django_jobs.E008")
            )
    if not errors and conf.alive_threshold <= conf.heartbeat_interval * 2:
        errors.append(
            Warning(
                "DJANGO_JOBS['alive_threshold'] should be well above twice "
                "'heartbeat_interval', or live workers will be pruned as dead.",
                id="django_jobs.W001",
            )
        )
    for queue, cap in conf.max_concurrency.items():
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            errors.append(
                Error(
                    f"DJANGO_JOBS['max_concurrency'][{queue!r}] must be an integer >= 1.",
                    id="django_jobs.E009",
                )
            )
    return errors
