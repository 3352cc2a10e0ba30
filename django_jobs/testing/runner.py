"""``run_enqueued_jobs()``: the jobs that are due, run in the test's own process and on
its own database connection, through the state machine a worker uses.

Each job goes the way ``run_jobs`` takes it, one at a time, in claim order: claimed
(``core.ready.claim_jobs``, which starts it where a worker's claim would), started
(``core.starting.start_jobs``, for a rate-limited or ``unique_until="start"`` job),
its body run by the executor's own functions (``runtime.executor.run_watched``), its
success finished (``core.claimed.finish_jobs``, which frees its key's slot, releases
its dependents and counts its batch) or its failure or snooze recorded
(``runtime.executor.settle_failure``). What that makes due (a retry due at once, the
next blocked job of a key, a dependent, a batch callback, a job enqueued by a job) is
run in the same call, until nothing due is left. Each step is committed as far as the
test allows (``testing.transactions``).

What a worker has and this has not: threads (one job at a time, so a concurrency
limit is never reached by two jobs running at once here), the watchdog (a job's
``timeout`` is not enforced and a cancel request does not reach a running body), and
the dispatcher (promotion of due jobs is done here, each round, and only for the
queues asked for). A database error is raised to the test, never ridden out: a test
waiting for its database to come back would hang.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from django_jobs.conf import database_alias
from django_jobs.testing.readiness import require_jobs_backend, require_jobs_tables
from django_jobs.testing.report import RunReport

# Jobs one call runs at most without a ``limit``: past it, jobs still due are taken for
# a job that enqueues another forever (RunawayJobs), not waited for.
DEFAULT_MAX_RUNS = 1000


def run_enqueued_jobs(
    *,
    queue: str | Iterable[str] | None = None,
    limit: int | None = None,
    now: datetime | None = None,
    run_scheduled: bool = False,
    max_runs: int = DEFAULT_MAX_RUNS,
    using: str | None = None,
) -> RunReport:
    """Run the jobs that are due, and those they make due, until none is left.

    :param queue: the queue to run jobs of, or several (a list, tried in its order, as
        ``run_jobs --queues``); ``"prefix*"`` patterns and ``"*"`` as there. Default:
        every queue. Jobs of other queues are left as they are, due or not.
    :param limit: run at most this many jobs, then return, leaving the rest waiting.
    :param now: time travel: also run the jobs scheduled at or before this (aware)
        datetime: ``run_after``, a retry's backoff, a snooze. The clock itself does not
        move: the jobs run now, and what they schedule is scheduled from now.
    :param run_scheduled: run every scheduled job, whenever it is due; a failing job is
        then retried at once, whatever its backoff, until its attempts are used up.
        Not with ``now``.
    :param max_runs: without ``limit``, the most jobs one call runs: if jobs are still
        due after that many, :class:`~django_jobs.testing.RunawayJobs` is raised,
        naming their tasks (most likely a job that enqueues another forever).
    :param using: the database alias the jobs are in. Default: the jobs database
        (``DJANGO_JOBS["database"]``, else ``"default"``).
    :returns: a :class:`~django_jobs.testing.RunReport` of what ran, in run order.
    :raises ~django_jobs.testing.JobsNotReady: the database has no jobs tables, or no
        backend of ``TASKS`` writes jobs to it.
    :raises KeyboardInterrupt: Ctrl-C during a job's body, once that job's attempt is
        recorded as failed (retried while attempts remain); the rest keep waiting.
    """
    patterns = queue_patterns(queue)
    check_count("limit", limit, minimum=0)
    check_count("max_runs", max_runs, minimum=1)
    due_by = travel_to(now, run_scheduled)
    db = using or database_alias()
    require_jobs_tables(db)
    require_jobs_backend(db)
    from django_jobs.testing.loop import run_due

    return run_due(db, patterns, due_by, limit, max_runs)


# ``due_by`` meaning "every scheduled job, whenever it is due".
EVERY_SCHEDULED = "every scheduled"


def travel_to(now: datetime | None, run_scheduled: bool) -> datetime | str | None:
    """The time jobs must be due by to run: None for the real clock (read each round),
    a datetime, or :data:`EVERY_SCHEDULED`."""
    if run_scheduled:
        if now is not None:
            raise ValueError("run_enqueued_jobs(): pass now= or run_scheduled=True, not both")
        return EVERY_SCHEDULED
    if now is None:
        return None
    return aware_datetime("run_enqueued_jobs", now)


def aware_datetime(caller: str, now: object) -> datetime:
    """``now``, checked: a ``datetime`` (not a date, not a string), aware when
    ``USE_TZ`` is on, as the toolkit's time travel compares it with stored times."""
    if not isinstance(now, datetime):
        raise TypeError(
            f"{caller}(): now must be a datetime (e.g. timezone.now() + timedelta(hours=1)), "
            f"not {type(now).__name__} {now!r}"
        )
    if settings.USE_TZ and timezone.is_naive(now):
        raise ValueError(
            f"{caller}(): now must be an aware datetime with USE_TZ = True "
            "(e.g. timezone.now() + timedelta(hours=1))"
        )
    return now


def queue_patterns(queue: str | Iterable[str] | None) -> tuple[str, ...]:
    if queue is None:
        return ("*",)
    patterns = (queue,) if isinstance(queue, str) else tuple(queue)
    if not patterns:
        raise ValueError("run_enqueued_jobs(): queue= names no queue")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"run_enqueued_jobs(): queue= takes queue names (str), got {pattern!r}")
        if not pattern:
            raise ValueError(
                "run_enqueued_jobs(): queue= has an empty queue name ''; pass None or '*' "
                "for every queue"
            )
    return patterns


def check_count(name: str, value: int | None, *, minimum: int) -> None:
    if value is None and name == "limit":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"run_enqueued_jobs(): {name} must be an int, not {value!r}")
    if value < minimum:
        raise ValueError(f"run_enqueued_jobs(): {name} must be at least {minimum}, not {value}")
