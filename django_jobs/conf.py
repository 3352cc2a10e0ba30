"""The ``DJANGO_JOBS`` settings dict, merged over defaults and read at call time.

Read lazily (never cached at import) so ``override_settings`` in tests and
settings changed by a management command's flags both take effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from django.conf import settings

SETTINGS_NAME = "DJANGO_JOBS"


@dataclass(frozen=True)
class JobsSettings:
    """Every knob the worker and the backend read; see docs/configuration.md."""

    database: str = "default"
    queues: tuple[str, ...] = ("*",)
    processes: int = 1
    threads: int = 3
    single_process: bool = False
    polling_interval: float = 0.2
    dispatcher_interval: float = 1.0
    batch_size: int = 100
    heartbeat_interval: float = 60.0
    alive_threshold: float = 300.0
    shutdown_timeout: float = 5.0
    maintenance_interval: float = 60.0
    # Seconds to keep finished jobs (results readable) before maintenance deletes them;
    # None keeps them forever.
    clear_finished_jobs_after: float | None = 86400.0 * 7
    db_retry_max_delay: float = 10.0
    # PostgreSQL: LISTEN for ready jobs so idle workers wake at once (polling stays the
    # fallback). True, False, or the DATABASES alias to listen through (a direct
    # connection when the jobs database goes through PgBouncer in transaction mode).
    listen_notify: bool | str = True
    max_concurrency: dict[str, int] = field(default_factory=dict)
    # key -> {"task": dotted path, "schedule": cron or interval, ...}; see docs/recurring.md.
    recurring: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, **overrides: Any) -> JobsSettings:
        raw = dict(getattr(settings, SETTINGS_NAME, {}) or {})
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        if "queues" in values:
            values["queues"] = parse_queue_list(values["queues"])
        base = cls(**values)
        clean = {k: v for k, v in overrides.items() if v is not None}
        if "queues" in clean:
            clean["queues"] = parse_queue_list(clean["queues"])
        return replace(base, **clean)

    @classmethod
    def unknown_keys(cls) -> list[str]:
        raw = getattr(settings, SETTINGS_NAME, {}) or {}
        known = {f.name for f in fields(cls)}
        return sorted(k for k in raw if k not in known)


def parse_queue_list(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    queues = tuple(q.strip() for q in value if q and q.strip())
    return queues or ("*",)


def jobs_settings(**overrides: Any) -> JobsSettings:
    return JobsSettings.load(**overrides)


def database_alias() -> str:
    """The jobs' database alone: read on every enqueue, so without building the rest."""
    raw = getattr(settings, SETTINGS_NAME, None) or {}
    return raw.get("database") or JobsSettings.database
