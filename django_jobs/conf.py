"""The ``DJANGO_JOBS`` settings dict, merged over defaults and read at call time.

Read lazily (never cached at import) so ``override_settings`` in tests and
settings changed by a management command's flags both take effect.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from django.conf import settings

from django_jobs.text import safe_repr

SETTINGS_NAME = "DJANGO_JOBS"
# Characters of a queue's name: the size of the jobs' ``queue_name`` column.
QUEUE_NAME_MAX_LENGTH = 128


@dataclass(frozen=True)
class JobsSettings:
    """Every knob the worker and the backend read; see docs/configuration.md."""

    database: str = "default"
    queues: tuple[str, ...] = ("*",)
    processes: int = 1
    threads: int = 3
    # ``async def`` jobs each worker process runs at once on its event loop, beside its
    # threads' sync jobs; 0 runs them on the threads instead (docs/tasks.md, "Async
    # jobs"). 200: a job waiting on the loop costs about 20 KB (72 KB on a thread) and
    # no connection, and 2 x 200 in flight kept up with the claim (1,100-1,400 jobs/s of
    # 0.2 s waits for 2 processes, bench/throughput.py phase async).
    async_jobs: int = 200
    # Threads (each with its database connection) that run the async jobs' ORM calls and
    # their start and outcome: the lane's whole connection budget (docs/running.md).
    async_orm_threads: int = 4
    # Seconds an async job may hold the event loop without awaiting before the worker
    # logs it and counts a stall; None: no watch.
    event_loop_block_threshold: float | None = 0.5
    single_process: bool = False
    polling_interval: float = 0.2
    # MariaDB/MySQL and SQLite: seconds between the supervisor's checks for new ready
    # jobs (one query each), which wake its idle worker processes; None: no check, the
    # workers poll every ``polling_interval``. While the check runs, an idle worker polls
    # by itself every ``fallback_polling_interval`` (docs/running.md, "Waking idle
    # workers on MariaDB/MySQL and SQLite").
    ready_check_interval: float | None = 0.025
    fallback_polling_interval: float = 2.0
    dispatcher_interval: float = 1.0
    batch_size: int = 100
    heartbeat_interval: float = 60.0
    alive_threshold: float = 300.0
    shutdown_timeout: float = 5.0
    # Seconds a cancelled job gets to stop by itself before its thread is interrupted,
    # and an interrupted job to end before it counts as stuck (docs/control.md).
    interrupt_grace: float = 5.0
    # Seconds between a worker's checks for cancel requests of the jobs it runs, when no
    # notification comes first (always on MariaDB/SQLite; docs/control.md).
    cancel_poll_interval: float = 1.0
    maintenance_interval: float = 60.0
    # Seconds to keep finished jobs (results readable) before maintenance deletes them;
    # None keeps them forever. Or per status: {"succeeded": 86400, "failed": 30 * 86400},
    # where a status left out keeps 7 days and None keeps that status forever
    # (docs/housekeeping.md).
    clear_finished_jobs_after: float | dict[str, float | None] | None = 86400.0 * 7
    db_retry_max_delay: float = 10.0
    # PostgreSQL: LISTEN for ready jobs so idle workers wake at once (polling stays the
    # fallback). True, False, or the DATABASES alias to listen through (a direct
    # connection when the jobs database goes through PgBouncer in transaction mode).
    listen_notify: bool | str = True
    max_concurrency: dict[str, int] = field(default_factory=dict)
    # name -> rate ("100/s"): limits tasks share by naming them (``@task(rate_limit="stripe")``);
    # see docs/rate_limits.md.
    rate_limits: dict[str, str] = field(default_factory=dict)
    # Worker processes of the supervisor are replaced after running this many jobs, or
    # once their resident memory passes this many MB (None: never); see docs/running.md.
    max_jobs_per_child: int | None = None
    max_memory_per_child: int | None = None
    # Bytes of JSON a call's arguments may take (refused at enqueue, naming the argument)
    # and a task's return value (the job fails, ResultNotStored); characters of an
    # error's traceback, and of a progress message, kept (cut beyond, saying so). See
    # docs/tasks.md, "Limits".
    max_arguments_size: int = 1024 * 1024
    max_result_size: int = 1024 * 1024
    max_error_size: int = 64 * 1024
    # key -> {"task": dotted path, "schedule": cron or interval, ...}; see docs/recurring.md.
    recurring: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Queues whose ready jobs take turns by their ``fair_key`` (a tenant, say) instead of by
    # age: exact names, no patterns (docs/fairness.md). A job of any other queue that gives
    # a fair key is refused at enqueue.
    fair_queues: tuple[str, ...] = ()

    @classmethod
    def load(cls, **overrides: Any) -> JobsSettings:
        return cls.from_dict(getattr(settings, SETTINGS_NAME, {}) or {}, **overrides)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], **overrides: Any) -> JobsSettings:
        """Settings from ``raw`` (a ``DJANGO_JOBS`` dict) and ``overrides`` (flags).

        Unknown keys are ignored here (the system checks name them). Raises
        ``TypeError``/``ValueError`` for a value that cannot be read at all.
        """
        if not isinstance(raw, Mapping):
            raise TypeError(f"{SETTINGS_NAME} must be a dict, not {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        if "queues" in values:
            values["queues"] = parse_queue_list(values["queues"])
        if isinstance(values.get("fair_queues"), list):
            # As written, else: check E025 names a value that is no list of names.
            values["fair_queues"] = tuple(values["fair_queues"])
        base = cls(**values)
        clean = {k: v for k, v in overrides.items() if v is not None}
        if "queues" in clean:
            clean["queues"] = parse_queue_list(clean["queues"])
        return replace(base, **clean)

    @classmethod
    def known_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def unknown_keys(cls) -> list[str]:
        raw = getattr(settings, SETTINGS_NAME, {}) or {}
        if not isinstance(raw, Mapping):
            return []
        known = set(cls.known_keys())
        return sorted(str(k) for k in raw if k not in known)


def parse_queue_list(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A queue list from a comma-separated string or a list of names; ``("*",)`` if empty."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list | tuple) or not all(isinstance(q, str) for q in value):
        raise TypeError(
            "queues must be a comma-separated string or a list of strings, "
            f"not {safe_repr(value, 60)}"
        )
    queues = tuple(q.strip() for q in value if q and q.strip())
    return queues or ("*",)


def fair_queues_problem(value: Any) -> str | None:
    """Why ``value`` is no ``fair_queues`` setting, or None: a list or tuple of exact queue
    names, each a non-empty string of at most ``QUEUE_NAME_MAX_LENGTH`` characters.

    A comma-separated string is refused, unlike for ``queues``: ``"tenant-jobs"`` would
    not be read letter by letter, but one typo there (a space, a missing comma) would make
    a queue quietly unfair. A ``*`` is refused too: the queues a pattern matched would
    change with ``QUEUES``, and a queue's fairness with them.
    """
    where = f"{SETTINGS_NAME}['fair_queues']"
    if not isinstance(value, list | tuple):
        return f"{where} must be a list of queue names, not {safe_repr(value, 60)}"
    for name in value:
        if not isinstance(name, str) or not name.strip():
            return f"{where} must hold queue names (non-empty strings), not {safe_repr(name, 60)}"
        if "*" in name:
            return (
                f"{where} names queues exactly, without patterns: {safe_repr(name, 60)} has a '*'"
            )
        if len(name) > QUEUE_NAME_MAX_LENGTH:
            return (
                f"{where} names {safe_repr(name, 60)}, which is longer than "
                f"{QUEUE_NAME_MAX_LENGTH} characters (no queue's name is)"
            )
    return None


def fair_queue_names() -> frozenset[str]:
    """The queues of ``DJANGO_JOBS["fair_queues"]``, read without building the rest of the
    settings (every enqueue reads them). Empty where the value is no list of names: check
    E025 says so, and until it is fixed no queue is fair."""
    value = raw_setting("fair_queues")
    if not value or fair_queues_problem(value) is not None:
        return frozenset()
    return frozenset(value)


def jobs_settings(**overrides: Any) -> JobsSettings:
    return JobsSettings.load(**overrides)


def raw_setting(name: str) -> Any:
    """One key of ``DJANGO_JOBS`` as written (None if absent), without building the rest:
    the enqueue reads a few on every call. Not a dict: check E004 says so; until then,
    nothing is read from it."""
    raw = getattr(settings, SETTINGS_NAME, None)
    return raw.get(name) if isinstance(raw, Mapping) else None


def database_alias() -> str:
    """The jobs' database alone."""
    return raw_setting("database") or JobsSettings.database


def size_limit(name: str) -> int:
    """A size limit of ``DJANGO_JOBS`` (``max_arguments_size``...), or its default where
    it is not a positive integer (check E024 says so)."""
    value = raw_setting(name)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return getattr(JobsSettings, name)


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """``Did you mean 'threads'?`` for a near-miss name, else an empty string.

    A typo in a settings key or a task option is the commonest bad input; naming
    the likely intent saves a trip to the docs.
    """
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"Did you mean {close[0]!r}?" if close else ""
