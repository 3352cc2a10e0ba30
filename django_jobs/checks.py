"""System checks: settings that would make the worker misbehave are errors at startup.

Django's ``check_tasks`` asks every backend in ``TASKS`` for its problems:
``JobsBackend.check()`` answers with :func:`backend_checks`. This module knows the backends
through ``tasks.backends`` only, so the backend can import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning
from django.db import connections
from django.tasks import Task
from django.tasks.base import TASK_MAX_PRIORITY, TASK_MIN_PRIORITY

from django_jobs.conf import SETTINGS_NAME, JobsSettings, did_you_mean, fair_queues_problem
from django_jobs.core.queues import QueueSelector
from django_jobs.core.recurring import ENTRY_KEYS, KEY_MAX_LENGTH, default_time_zone
from django_jobs.db import features
from django_jobs.exceptions import InvalidTaskArguments, TaskNotFound
from django_jobs.limits import MAX_ASYNC_JOBS, declared_seconds, is_number
from django_jobs.models import FINISHED_STATUSES
from django_jobs.tasks.backends import JobsBackendBase, jobs_backends
from django_jobs.tasks.job_task import MAX_CONCURRENCY_LIMIT, bound_arguments, is_int
from django_jobs.tasks.loading import load_task
from django_jobs.tasks.rates import named_rate
from django_jobs.tasks.schedules import ScheduleError, parse_schedule, parse_time_zone
from django_jobs.tasks.serialization import json_arguments
from django_jobs.text import safe_repr

# The largest size setting, in bytes or characters.
MAX_SIZE = 2**30


def backend_checks(backend: JobsBackendBase) -> list[Any]:
    """Every problem at once: one run of ``check`` lists them all, none hides another."""
    errors: list[Any] = []
    db = backend.database
    if db in connections.databases:
        errors.extend(sqlite_checks(db, connections.databases[db]))
    else:
        errors.append(
            Error(
                f"django-jobs database alias {db!r} is not in DATABASES.",
                id="django_jobs.E001",
            )
        )
    if owns_settings_checks(backend):
        errors.extend(settings_checks())
    return errors


def settings_checks() -> list[Any]:
    """The ``DJANGO_JOBS`` dict: unknown keys, then every value that can be read."""
    raw = getattr(settings, SETTINGS_NAME, None) or {}
    if not isinstance(raw, Mapping):
        message = f"{SETTINGS_NAME} must be a dict, not {type(raw).__name__}."
        return [Error(message, id="django_jobs.E004")]
    errors = unknown_setting_checks()
    try:
        conf = JobsSettings.from_dict(raw)
    except (TypeError, ValueError) as exc:
        errors.append(Error(f"Invalid DJANGO_JOBS settings: {exc}", id="django_jobs.E004"))
        # Check the rest as if 'queues' (the one value parsed on load) were left out.
        conf = JobsSettings.from_dict({k: v for k, v in raw.items() if k != "queues"})
    errors.extend(number_checks(conf))
    errors.extend(listen_notify_checks(conf))
    errors.extend(rate_limit_checks(conf))
    errors.extend(queue_checks(conf))
    errors.extend(fair_queue_checks(conf))
    errors.extend(recurring_checks(conf))
    return errors


def unknown_setting_checks() -> list[Any]:
    """One error per unknown key, with the known key it most likely meant."""
    known = JobsSettings.known_keys()
    return [
        Error(
            f"Unknown DJANGO_JOBS setting {name!r}.",
            hint=did_you_mean(name, known) or f"Known settings: {', '.join(sorted(known))}.",
            id="django_jobs.E003",
        )
        for name in JobsSettings.unknown_keys()
    ]


def queue_checks(conf: JobsSettings) -> list[Any]:
    """``queues`` and ``max_concurrency`` name queues the backends declare."""
    errors = [
        Error(message, hint=known_queues(conf.database), id="django_jobs.E005")
        for message in unknown_queue_patterns(conf.queues, conf.database, "DJANGO_JOBS['queues']")
    ]
    declared = declared_queues(conf.database)
    caps = conf.max_concurrency if isinstance(conf.max_concurrency, Mapping) else {}
    for queue in caps:
        if declared and queue not in declared:
            errors.append(
                Error(
                    f"DJANGO_JOBS['max_concurrency'] names unknown queue {queue!r}.",
                    hint=did_you_mean(queue, declared) or None,
                    id="django_jobs.E006",
                )
            )
    return errors


def fair_queue_checks(conf: JobsSettings) -> list[Any]:
    """``fair_queues``: a list of exact queue names, each one the backends declare.

    A value the enqueue cannot read makes no queue fair (``conf.fair_queue_names``), and
    a name no backend declares makes no queue fair either: every job given a ``fair_key``
    would be refused at enqueue, far from the typo. One error for a malformed value; one
    per unknown name, with the likely one.
    """
    problem = fair_queues_problem(conf.fair_queues)
    if problem is not None:
        return [
            Error(
                f"{problem}.",
                hint="e.g. ['tenant-reports']: the queues whose jobs take turns by fair_key.",
                id="django_jobs.E025",
            )
        ]
    declared = declared_queues(conf.database)
    return [
        Error(
            f"DJANGO_JOBS['fair_queues'] names {queue!r}, which is not in QUEUES.",
            hint=did_you_mean(queue, declared) or known_queues(conf.database),
            id="django_jobs.E025",
        )
        for queue in conf.fair_queues
        if declared and queue not in declared
    ]


def declared_queues(db: str) -> set[str] | None:
    """The queues a job in ``db`` can be in: the ``QUEUES`` of every django-jobs backend
    writing to ``db``. None when any queue can be (a backend with empty ``QUEUES``, or none
    writes there): nothing to check against."""
    names: set[str] = set()
    for backend in jobs_backends(db):
        if not backend.queues:
            return None
        names |= backend.queues
    return names or None


def unknown_queue_patterns(patterns: Iterable[str], db: str, source: str) -> list[str]:
    """A message for each pattern that matches no declared queue.

    A worker serving only such patterns would poll forever and never find a job,
    since an enqueue into an undeclared queue is refused. A name is checked as
    is; ``prefix*`` must match at least one declared queue; ``*`` matches all.
    Shared by check E005 (``source`` ``DJANGO_JOBS['queues']``) and ``run_jobs``
    (``--queues``), so the two refuse the same patterns.
    """
    declared = declared_queues(db)
    if not declared:
        return []
    messages = []
    for pattern in patterns:
        if any(QueueSelector((pattern,)).matches(queue) for queue in declared):
            continue
        if QueueSelector.is_wildcard(pattern):
            message = f"{source} pattern {pattern!r} matches no queue in QUEUES."
        else:
            message = f"{source} names {pattern!r}, which is not in QUEUES."
        messages.append(f"{message} {did_you_mean(pattern, declared)}".rstrip())
    return messages


def known_queues(db: str) -> str:
    """``Known queues: a, b.`` for the hint of a queue error."""
    return f"Known queues: {', '.join(sorted(declared_queues(db) or ()))}."


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


# The numeric settings and the range each must be in. Every one ends up in a loop, a
# sleep, a datetime or a size comparison of a long-running process: a NaN never
# compares, an inf overflows a datetime, "soon" raises in the dispatcher at its first
# pass. So each is refused at startup unless it is a real number in its range.
# Integers: name -> (minimum, maximum, check id, None allowed).
INTEGER_SETTINGS: dict[str, tuple[int, int, str, bool]] = {
    "processes": (1, 1024, "django_jobs.E007", False),
    "threads": (1, 1024, "django_jobs.E007", False),
    "async_jobs": (0, MAX_ASYNC_JOBS, "django_jobs.E007", False),
    "async_orm_threads": (1, 1024, "django_jobs.E007", False),
    # Due jobs promoted at once, their ids bound in one IN list (SQLite: 32,766 at most).
    "batch_size": (1, 10_000, "django_jobs.E007", False),
    "max_jobs_per_child": (1, 10**9, "django_jobs.E007", True),
    # Megabytes (10 TB at most).
    "max_memory_per_child": (1, 10**7, "django_jobs.E007", True),
    # Bytes of JSON (1 GiB at most: beyond, no row is worth it).
    "max_arguments_size": (1, MAX_SIZE, "django_jobs.E024", False),
    "max_result_size": (1, MAX_SIZE, "django_jobs.E024", False),
    # Characters of a traceback: under 1,000 the error itself would not be readable.
    "max_error_size": (1000, MAX_SIZE, "django_jobs.E024", False),
}
# Seconds: > 0 and at most a century (limits.MAX_SECONDS).
SECONDS_SETTINGS = (
    "polling_interval",
    "fallback_polling_interval",
    "dispatcher_interval",
    "heartbeat_interval",
    "alive_threshold",
    "shutdown_timeout",
    "interrupt_grace",
    "cancel_poll_interval",
    "maintenance_interval",
    "db_retry_max_delay",
)
# Seconds where None means something of its own: (name, > 0 required, the hint, check id).
OPTIONAL_SECONDS_SETTINGS = (
    (
        "ready_check_interval",
        True,
        "None turns the check off: idle workers then poll every 'polling_interval'.",
        "django_jobs.E008",
    ),
    (
        "event_loop_block_threshold",
        True,
        "None turns the watch of the async jobs' event loop off.",
        "django_jobs.E008",
    ),
    (
        "clear_finished_jobs_after",
        False,
        "None keeps finished jobs forever; 0 deletes each at the next maintenance pass.",
        "django_jobs.E023",
    ),
)


def number_checks(conf: JobsSettings) -> list[Any]:
    """Each numeric setting in its range: see ``INTEGER_SETTINGS``, ``SECONDS_SETTINGS``,
    ``clear_finished_jobs_after`` and ``max_concurrency``; one error per setting, naming
    its value."""
    errors: list[Any] = []
    for name, (low, high, check_id, optional) in INTEGER_SETTINGS.items():
        value = getattr(conf, name)
        if optional and value is None:
            continue
        if not is_int(value) or not low <= value <= high:
            none = "None or " if optional else ""
            errors.append(
                Error(
                    f"DJANGO_JOBS[{name!r}] must be {none}an integer from {low:,} to {high:,}, "
                    f"not {safe_repr(value, 60)}.",
                    id=check_id,
                )
            )
    for name in SECONDS_SETTINGS:
        problem = setting_seconds_problem(name, getattr(conf, name), strict=True)
        if problem:
            errors.append(Error(problem, id="django_jobs.E008"))
    for name, strict, hint, check_id in OPTIONAL_SECONDS_SETTINGS:
        value = getattr(conf, name)
        if name == "clear_finished_jobs_after" and isinstance(value, Mapping):
            errors.extend(Error(p, hint=hint, id=check_id) for p in retention_problems(value))
            continue
        problem = None if value is None else setting_seconds_problem(name, value, strict=strict)
        if problem:
            errors.append(Error(problem, hint=hint, id=check_id))
    if not errors and conf.alive_threshold <= conf.heartbeat_interval * 2:
        errors.append(
            Warning(
                "DJANGO_JOBS['alive_threshold'] should be well above twice "
                "'heartbeat_interval', or live workers will be pruned as dead.",
                id="django_jobs.W001",
            )
        )
    return errors + max_concurrency_checks(conf)


def max_concurrency_checks(conf: JobsSettings) -> list[Any]:
    """``max_concurrency``: a dict of queue -> a cap from 1 to ``MAX_CONCURRENCY_LIMIT``."""
    if not isinstance(conf.max_concurrency, Mapping):
        return [
            Error(
                "DJANGO_JOBS['max_concurrency'] must be a dict of queue -> integer "
                f"from 1 to {MAX_CONCURRENCY_LIMIT:,}.",
                id="django_jobs.E009",
            )
        ]
    return [
        Error(
            f"DJANGO_JOBS['max_concurrency'][{queue!r}] must be an integer from 1 to "
            f"{MAX_CONCURRENCY_LIMIT:,}, not {safe_repr(cap, 60)}.",
            id="django_jobs.E009",
        )
        for queue, cap in conf.max_concurrency.items()
        if not is_int(cap) or not 1 <= cap <= MAX_CONCURRENCY_LIMIT
    ]


def retention_problems(value: Mapping[Any, Any]) -> list[str]:
    """``clear_finished_jobs_after`` per status: finished statuses only, each seconds or None."""
    problems = []
    for status, seconds in value.items():
        where = f"DJANGO_JOBS['clear_finished_jobs_after'][{safe_repr(status, 40)}]"
        if status not in FINISHED_STATUSES:
            problems.append(
                f"DJANGO_JOBS['clear_finished_jobs_after'] names {safe_repr(status, 40)}, "
                f"which is not a finished status: use {', '.join(FINISHED_STATUSES)}."
            )
        elif seconds is not None and not is_number(seconds):
            problems.append(
                f"{where} must be a number of seconds or None, not {safe_repr(seconds, 60)}."
            )
        elif seconds is not None:
            try:
                declared_seconds(seconds, where, strict=False)
            except ValueError as exc:
                problems.append(f"{exc}.")
    return problems


def setting_seconds_problem(name: str, value: Any, *, strict: bool) -> str | None:
    """The message for a setting that is not a usable number of seconds, else None.

    A ``timedelta`` is refused, unlike for a task option: the runtime adds these
    settings to floats (``time.monotonic()``).
    """
    where = f"DJANGO_JOBS[{name!r}]"
    if not is_number(value):
        return f"{where} must be a number of seconds, not {safe_repr(value, 60)}."
    try:
        declared_seconds(value, where, strict=strict)
    except ValueError as exc:
        return f"{exc}."
    return None


def listen_notify_checks(conf: JobsSettings) -> list[Any]:
    value = conf.listen_notify
    if isinstance(value, bool):
        return []
    if isinstance(value, str) and value in connections.databases:
        if features(value).has_listen_notify:
            return []
    return [
        Error(
            f"DJANGO_JOBS['listen_notify'] must be True, False or the alias of a PostgreSQL "
            f"database in DATABASES, not {value!r}.",
            id="django_jobs.E021",
        )
    ]


def rate_limit_checks(conf: JobsSettings) -> list[Any]:
    """Every named rate, each error naming its entry (``"stripe": "100/parsec"``)."""
    raw = conf.rate_limits
    where = "DJANGO_JOBS['rate_limits']"
    if not isinstance(raw, Mapping):
        return [
            Error(
                f"{where} must be a dict of name -> rate, e.g. {{'stripe': '100/s'}}.",
                id="django_jobs.E022",
            )
        ]
    errors = []
    for name, rate in raw.items():
        try:
            named_rate(name, rate)
        except ValueError as exc:
            errors.append(Error(f"{where}: {exc}.", id="django_jobs.E022"))
    return errors


def owns_settings_checks(backend: JobsBackendBase) -> bool:
    """``DJANGO_JOBS`` is one dict: the first django-jobs backend in TASKS checks it, so
    two backends do not report each problem twice (a recurring entry is checked
    against its own task's backend)."""
    ours = jobs_backends()
    return bool(ours) and ours[0].alias == backend.alias


def recurring_checks(conf: JobsSettings) -> list[Any]:
    if not isinstance(conf.recurring, Mapping):
        return [
            Error(
                "DJANGO_JOBS['recurring'] must be a dict of key -> entry.",
                id="django_jobs.E010",
            )
        ]
    errors: list[Any] = []
    for key, entry in conf.recurring.items():
        errors.extend(recurring_entry_checks(key, entry, conf.database))
    return errors


def recurring_entry_checks(key: Any, entry: Any, db: str) -> list[Any]:
    """Every problem of one entry, so that one run of ``check`` lists them all."""
    where = f"DJANGO_JOBS['recurring'][{key!r}]"
    errors: list[Any] = []
    if not isinstance(key, str) or not key or len(key) > KEY_MAX_LENGTH:
        errors.append(
            Error(
                f"{where}: the key must be a non-empty string of at most "
                f"{KEY_MAX_LENGTH} characters.",
                id="django_jobs.E018",
            )
        )
    if not isinstance(entry, Mapping):
        return [
            *errors,
            Error(f"{where} must be a dict with 'task' and 'schedule'.", id="django_jobs.E010"),
        ]
    unknown = sorted(str(name) for name in set(entry) - ENTRY_KEYS)
    if unknown:
        guesses = " ".join(filter(None, (did_you_mean(name, ENTRY_KEYS) for name in unknown)))
        errors.append(
            Error(
                f"{where} has unknown key(s): {', '.join(unknown)}.",
                hint=f"{guesses} Known keys: {', '.join(sorted(ENTRY_KEYS))}.".lstrip(),
                id="django_jobs.E011",
            )
        )
    missing = [name for name in ("task", "schedule") if name not in entry]
    if missing:
        errors.append(
            Error(f"{where} is missing {' and '.join(missing)!s}.", id="django_jobs.E012")
        )
    time_zone = default_time_zone()
    if "timezone" in entry:
        try:
            parse_time_zone(entry["timezone"])
            time_zone = entry["timezone"]
        except ScheduleError as exc:
            errors.append(Error(f"{where}: {exc}.", id="django_jobs.E014"))
    if "schedule" in entry:
        try:
            parse_schedule(entry["schedule"], time_zone)
        except ScheduleError as exc:
            errors.append(Error(f"{where}: {exc}.", id="django_jobs.E013"))
    errors.extend(recurring_value_checks(where, entry))
    if "task" in entry:
        errors.extend(recurring_task_checks(where, entry, db))
    return errors


def recurring_value_checks(where: str, entry: Mapping[str, Any]) -> list[Any]:
    errors: list[Any] = []
    args, kwargs = entry.get("args", []), entry.get("kwargs", {})
    if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
        errors.append(
            Error(f"{where}: 'args' must be a list and 'kwargs' a dict.", id="django_jobs.E016")
        )
    else:
        try:
            json_arguments(args, kwargs)
        except InvalidTaskArguments as exc:
            errors.append(Error(f"{where}: {exc}", id="django_jobs.E016"))
    priority = entry.get("priority")
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not TASK_MIN_PRIORITY <= priority <= TASK_MAX_PRIORITY
    ):
        errors.append(
            Error(
                f"{where}: 'priority' must be an integer from {TASK_MIN_PRIORITY} "
                f"to {TASK_MAX_PRIORITY}.",
                id="django_jobs.E019",
            )
        )
    for name in ("queue_name", "description"):
        if entry.get(name) is not None and not isinstance(entry[name], str):
            errors.append(Error(f"{where}: {name!r} must be a string.", id="django_jobs.E019"))
    return errors


def recurring_task_checks(where: str, entry: Mapping[str, Any], db: str) -> list[Any]:
    """The task imports, is a Task, and enqueues through django-jobs into ``db``."""
    path = entry["task"]
    if not isinstance(path, str):
        return [Error(f"{where}: 'task' must be a dotted path.", id="django_jobs.E015")]
    try:
        task: Task = load_task(path)
    except TaskNotFound as exc:
        return [Error(f"{where}: {exc}.", id="django_jobs.E015")]
    try:
        backend = task.get_backend()
    except Exception as exc:  # an unknown backend alias on the task
        return [Error(f"{where}: {path}'s backend: {exc}.", id="django_jobs.E020")]
    if backend.alias not in [ours.alias for ours in jobs_backends(db)]:
        return [
            Error(
                f"{where}: {path} enqueues through backend {task.backend!r}, which does not "
                f"write to the django-jobs database {db!r}.",
                hint="The tick's row and its job must be one transaction in one database, "
                "or a tick could be enqueued twice or lost.",
                id="django_jobs.E020",
            )
        ]
    errors = recurring_binding_checks(where, task, entry)
    queue = entry.get("queue_name") or task.queue_name
    if isinstance(queue, str) and backend.queues and queue not in backend.queues:
        errors.append(
            Error(
                f"{where}: queue {queue!r} is not in the QUEUES of task backend {backend.alias!r}.",
                hint=f"Known queues: {', '.join(sorted(backend.queues))}.",
                id="django_jobs.E017",
            )
        )
    return errors


def recurring_binding_checks(where: str, task: Task, entry: Mapping[str, Any]) -> list[Any]:
    """The entry's arguments fit the task's function: every tick's enqueue binds them, and
    would otherwise fail at each tick, in the scheduler's log only."""
    args, kwargs = entry.get("args", []), entry.get("kwargs", {})
    if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
        return []  # recurring_value_checks reports these
    try:
        json_args, json_kwargs = json_arguments(args, kwargs)
    except InvalidTaskArguments:
        return []  # recurring_value_checks reports it: one E016 for the arguments
    try:
        bound_arguments(task, json_args, json_kwargs)
    except InvalidTaskArguments as exc:
        return [Error(f"{where}: {exc}", id="django_jobs.E016")]
    return []
