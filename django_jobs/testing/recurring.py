"""Recurring tasks' ticks on demand, for a test: what the scheduler would enqueue at a
given time, enqueued now, without a scheduler process."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from django_jobs.conf import database_alias, jobs_settings
from django_jobs.testing.readiness import require_jobs_tables
from django_jobs.testing.runner import aware_datetime
from django_jobs.testing.transactions import step


def enqueue_recurring(
    *keys: str, now: datetime | None = None, using: str | None = None
) -> dict[str, int | None]:
    """Enqueue the tick of each recurring task that is due at ``now``: its latest tick at
    or before ``now`` (default: the current time), as the scheduler would.

    :param keys: the keys of ``DJANGO_JOBS["recurring"]`` to tick, each a separate
        argument (``enqueue_recurring(*keys)``); default: every one.
    :param now: the time to tick at, an aware ``datetime``. A tick is enqueued once, as
        with the scheduler: a second call for the same tick enqueues nothing.
    :param using: the database alias of the jobs (default: the jobs database).
    :returns: ``{key: job id}``, None for a key whose tick was already enqueued, or
        whose task is disabled (``set_enabled``).
    :raises LookupError: a key that is not in ``DJANGO_JOBS["recurring"]``.

    Unlike the scheduler this enqueues a tick however recent the task's row is (the
    scheduler never catches up ticks from before it first saw a task). Run the jobs
    with ``run_enqueued_jobs()``.
    """
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(
                f"enqueue_recurring(): each key is a name of DJANGO_JOBS['recurring'] (a str), "
                f"not {type(key).__name__} {key!r}; pass several as separate arguments: "
                f"enqueue_recurring(*keys)"
            )
    now = timezone.now() if now is None else aware_datetime("enqueue_recurring", now)
    db = using or database_alias()
    require_jobs_tables(db)
    # The models, once the app is known to be installed.
    from django_jobs.core.recurring import (
        enqueue_tick,
        parse_entries,
        sync_recurring_tasks,
        task_rows,
    )
    from django_jobs.db.notify import silenced

    entries = parse_entries(jobs_settings().recurring)
    if keys:
        known = {entry.key: entry for entry in entries}
        unknown = [key for key in keys if key not in known]
        if unknown:
            raise LookupError(
                f"no recurring task {', '.join(map(repr, unknown))} in "
                f"DJANGO_JOBS['recurring'] (it has: {', '.join(map(repr, known)) or 'none'})"
            )
        entries = [known[key] for key in dict.fromkeys(keys)]
    enqueued: dict[str, int | None] = {}
    with silenced(), step(db):
        sync_recurring_tasks(db, entries)
        rows = task_rows(db, [entry.key for entry in entries])
        for entry in entries:
            if not rows[entry.key].enabled:
                enqueued[entry.key] = None
                continue
            enqueued[entry.key] = enqueue_tick(db, entry, entry.schedule.latest(now))
    return enqueued
