"""Starting claimed jobs: the one place an attempt is counted, just before the job's
function runs (attempts are real starts, docs/design.md invariant 4).

A rate-limited job is decided here, under its key's ``RateLimit`` row locked after the
claims (docs/design.md section 4's order, extended in core/rate_limits.py): over its rate
it goes back to wait as a scheduled job, costing no attempt.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta

from django.utils import timezone

from django_jobs.core.claimed import end_cancelled
from django_jobs.core.rate_limits import (
    RateRowsMissing,
    ensure_rate_rows,
    ensure_unknown_rate_rows,
    forget_keys,
    lock_rate_limits,
    written_rows,
)
from django_jobs.core.rows import Waiting
from django_jobs.db import features, ops
from django_jobs.db.rows import Started, StartRow
from django_jobs.db.transactions import hot_transaction
from django_jobs.models import ClaimedExecution, Job, JobStatus, RateLimit, ScheduledExecution
from django_jobs.tasks.rates import Rate


def start_job(db: str, job: Job, process_id: int, worker_id: str) -> bool:
    """Count the attempt of one job, just before it runs; False if the claim was lost."""
    return bool(start_jobs(db, [job], process_id, worker_id))


def start_jobs(db: str, jobs: list[Job], process_id: int, worker_id: str) -> list[Job]:
    """Count the attempt of each job about to run, in one transaction; return those started.

    Counting here and nowhere else is what keeps ``attempts`` honest: a job
    claimed and handed back, blocked or recovered before this point has cost
    nothing (pg-boss #759). A job whose claim this process no longer holds is
    left alone and left out of the result.

    A job of a rate-limited key over its limit is not started either: it is sent
    back to wait for its window (status ``SCHEDULED``, ``rate_reserved_at`` set on
    the caller's copy too), costing no attempt (django_jobs/core/rate_limits.py).
    """
    if not jobs:
        return []
    now = timezone.now()
    ids = [job.pk for job in jobs]
    written: Mapping[int, Started | Waiting]
    if any(job.rate_key for job in jobs):
        decided = start_in_one_statement(db, jobs, process_id, worker_id, now)
        written = (
            decided if decided is not None else start_rated(db, jobs, process_id, worker_id, now)
        )
    elif features(db).can_start_in_one_statement:
        written = ops(db).start_held(db, ids, process_id, worker_id, now)
    else:
        written = start_locked(db, ids, process_id, worker_id, now)
    started = []
    for job in jobs:
        row = written.get(job.pk)
        if row is None:
            continue
        if isinstance(row, Waiting):
            job.status, job.rate_reserved_at = JobStatus.SCHEDULED, row.until
            continue
        job.attempts, job.worker_ids, job.started_at, job.last_attempted_at = row
        job.status = JobStatus.RUNNING
        job.rate_reserved_at = None
        started.append(job)
    return started


def start_rated(
    db: str, jobs: list[Job], process_id: int, worker_id: str, now: datetime
) -> dict[int, Started | Waiting]:
    """:func:`start_locked` for a start with rate-limited jobs, their keys' rows made sure
    of first (those this connection has not seen a row of, then, if a row it had seen is
    gone, all of them: ``core.rate_limits.ensure_unknown_rate_rows``)."""
    ids = [job.pk for job in jobs]
    skipped = ensure_unknown_rate_rows(db, {job.rate_key for job in jobs if job.rate_key}, now)
    try:
        return start_locked(db, ids, process_id, worker_id, now, skipped)
    except RateRowsMissing:
        forget_keys(db, skipped)
        ensure_rate_rows(db, skipped, now)
        return start_locked(db, ids, process_id, worker_id, now)


def start_in_one_statement(
    db: str, jobs: list[Job], process_id: int, worker_id: str, now: datetime
) -> dict[int, Started] | None:
    """Where the database can (``can_start_rated_in_one_statement``), the start of ``jobs``
    as one statement that locks, decides and writes what :func:`start_locked` would; None
    if it was not tried, or decided nothing (a job would wait, a window it does not read
    as ``Window`` does), for :func:`start_rated` to decide.

    Rows are not made sure of first: a key of the start without a row (new, or pruned)
    makes the statement decide nothing and name it; its rows are created and the
    statement tried once more. A key's row is created once, by the first start of it
    anywhere, not once per connection that starts it.

    Not tried when a job comes back from waiting for its planned time: its key's plan
    is most likely still ahead (a backlog), which the statement leaves to
    :func:`start_locked`, and trying would cost a round trip for nothing. A newcomer to
    a key whose plan is ahead pays that round trip (docs/rate_limits.md, "What it costs").
    """
    if not features(db).can_start_rated_in_one_statement:
        return None
    if any(job.rate_reserved_at is not None for job in jobs):
        return None
    seam = ops(db)
    ids = [job.pk for job in jobs]
    decided, missing = seam.start_rated(db, ids, process_id, worker_id, now)
    if missing:
        ensure_rate_rows(db, missing, now)
        decided, _ = seam.start_rated(db, ids, process_id, worker_id, now)
    return decided


def start_locked(
    db: str,
    job_ids: list[int],
    process_id: int,
    worker_id: str,
    now: datetime,
    skipped: Collection[str] = (),
) -> dict[int, Started | Waiting]:
    """The portable :func:`start_jobs`: lock this process's claims, then update their jobs.

    Returns each job's start as written, or ``Waiting`` for a job over its rate
    limit. Rate-limited keys are locked after the claims (docs/design.md section
    4's order, extended in django_jobs/core/rate_limits.py), and a job sent back
    frees its concurrency slot after that. The windows and the starts are written
    last, together (one statement on PostgreSQL): the rate rows are locked already.
    ``skipped``: keys whose rows were not made sure of (``RateRowsMissing``).
    """
    seam = ops(db)
    with hot_transaction(db):
        # Read under the claims' locks, not taken from the callers' copies, which
        # may be older than an earlier attempt.
        rows = seam.lock_start_rows(db, process_id, job_ids)
        if not rows:
            return {}
        waiting, starts, windows = decide_rates(db, rows, now, skipped)
        starting = [row for row in rows if row.pk not in waiting]
        written: dict[int, Started | Waiting] = dict(waiting)
        written.update(seam.write_rated_starts(db, windows, starting, worker_id, now, starts))
    return written


def decide_rates(
    db: str, rows: list[StartRow], now: datetime, skipped: Collection[str] = ()
) -> tuple[dict[int, Waiting], dict[int, datetime], list[RateLimit]]:
    """Admit or send back each rate-limited job of ``rows`` (in claim order), under
    its key's lock; the ones sent back wait as scheduled jobs, their slots freed.

    Returns the jobs sent back, the recorded start time of each one admitted, and
    the locked rate rows with their new windows, for the caller to write back.
    Raises ``RateRowsMissing``, having written nothing, if a key of ``skipped`` (not
    made sure of before the transaction) has no row.
    """
    waiting: dict[int, Waiting] = {}
    starts: dict[int, datetime] = {}
    rated = [row for row in rows if row.rate_key is not None]
    if not rated:
        return waiting, starts, []
    windows = lock_rate_limits(db, {row.rate_key for row in rated if row.rate_key})
    if any(row.rate_key in skipped and row.rate_key not in windows for row in rated):
        raise RateRowsMissing
    clock = now.timestamp()
    for row in rated:
        window = windows.get(row.rate_key or "")
        if window is None:
            # Its row was pruned after ensure_rate_rows: no start to count it
            # against, so the job waits a moment and the next start recreates it.
            waiting[row.pk] = Waiting(now + timedelta(seconds=1))
            continue
        reserved = None if row.rate_reserved_at is None else row.rate_reserved_at.timestamp()
        # As the row holds them: decide() brings a row's rate within bounds (usable_rate).
        rate = Rate(row.rate_limit, row.rate_period)  # type: ignore[arg-type]
        decision = window.decide(clock, rate, reserved)
        at = datetime.fromtimestamp(decision.at, tz=UTC)
        if decision.admitted:
            starts[row.pk] = at
        else:
            waiting[row.pk] = Waiting(at)
    if waiting:
        wait_for_rate(db, {pk: sent_back.until for pk, sent_back in waiting.items()})
    return waiting, starts, written_rows(windows.values())


def wait_for_rate(db: str, until: dict[int, datetime]) -> None:
    """Claimed jobs over their rate limit: scheduled for their planned time, slots freed.

    Never started, so like a hand-back they cost no attempt; unlike one, they
    wait in ``ScheduledExecution`` (promoted when due, through admission). One
    cancelled meanwhile ends here instead, as a hand-back would end it.
    """
    claims = list(ClaimedExecution.objects.using(db).filter(job_id__in=list(until)))
    ops(db).delete_executions(db, ClaimedExecution, list(until))
    jobs = list(Job.objects.using(db).filter(pk__in=list(until)))
    cancelled = [job for job in jobs if job.cancel_requested_at is not None]
    waiting = [job for job in jobs if job.cancel_requested_at is None]
    ScheduledExecution.objects.using(db).bulk_create(
        [
            ScheduledExecution(
                job_id=job.pk,
                queue_name=job.queue_name,
                priority=job.priority,
                scheduled_at=until[job.pk],
            )
            for job in waiting
        ]
    )
    for job in waiting:
        job.status, job.rate_reserved_at = JobStatus.SCHEDULED, until[job.pk]
    if waiting:
        Job.objects.using(db).bulk_update(waiting, ["status", "rate_reserved_at"])
    end_cancelled(db, cancelled, {claim.concurrency_key for claim in claims})
