"""Every transition of a claimed job: claim, start, finish, fail, hand back, recover.

Each transition that ends a claim runs in one transaction that first locks the
claimed row *of this process* and returns at once if it is gone: a job is
finalised exactly once, whoever races for it (a worker finishing late after a
false prune, two dispatchers recovering the same dead process). The slot of the
job's concurrency key is freed in that same transaction, so a crash anywhere
rolls everything back and leaves the claim for recovery (docs/design.md section 4).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import InterfaceError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone

from django_jobs.conf import size_limit
from django_jobs.core.admission import (
    admit_jobs,
    hand_back_to_key,
    make_ready,
    release_slot,
    release_slots,
)
from django_jobs.core.batches import count_failed, count_outcome, count_outcomes
from django_jobs.core.cancellation import record_cancelled
from django_jobs.core.queues import QueueSelector
from django_jobs.core.rate_limits import ensure_rate_rows, lock_rate_limits, save_windows
from django_jobs.db.postgresql import claims as pg_claims
from django_jobs.db.deletion import delete_executions
from django_jobs.db.transactions import hot_transaction
from django_jobs.limits import later
from django_jobs.models import (
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    QueueLock,
    ReadyExecution,
    ScheduledExecution,
    UniqueUntil,
)
from django_jobs.tasks.backoff import retry_delay
from django_jobs.tasks.rates import Rate
from django_jobs.text import jobs_logger, safe_str, storable_text

logger = jobs_logger("django_jobs.recovery")

# Characters kept of an error's message (its traceback keeps max_error_size).
MAX_ERROR_MESSAGE = 2000


@dataclass(frozen=True)
class ErrorInfo:
    exception_class_path: str
    message: str
    traceback: str


@dataclass(frozen=True)
class FailOutcome:
    retry_at: object | None  # datetime of the next attempt, or None if failed for good

    @property
    def will_retry(self) -> bool:
        return self.retry_at is not None


def claim_jobs(
    db: str,
    process_id: int,
    selector: QueueSelector,
    limit: int,
    caps: dict[str, int] | None = None,
    worker_id: str | None = None,
) -> list[Job]:
    """Take up to ``limit`` ready jobs, skipping rows other claimers hold locked.

    ``caps`` are queue-wide limits (``max_concurrency``): the queue's lock row
    is taken and its claims counted in this same transaction, so two workers
    can never both see room for the last slot (taskito #104), and a cap of N
    lets exactly N run.

    ``worker_id``: the caller runs the jobs at once, so the claim also starts
    those it can (:func:`starts_at_claim`; on PostgreSQL without caps in the
    claim's one statement, ``pg_claims.claim_matching``): they come back
    ``RUNNING``, their attempt counted; the rest ``CLAIMED``, for
    :func:`start_jobs`. A worker that then does not run one takes the start back
    (:func:`undo_start`).
    """
    if limit <= 0:
        return []
    if connections[db].vendor == "postgresql" and not caps:
        return claim_in_one_statement(db, process_id, selector, limit, worker_id)
    with hot_transaction(db):
        # Read in the claim query itself, unless queue caps need the list first.
        paused: set[str] | QuerySet = Pause.objects.using(db).values("queue_name")
        if caps:
            paused = {row["queue_name"] for row in paused}
        room = lock_queue_caps(db, selector, caps, paused) if caps else {}
        picked: list[tuple[int, str]] = []
        for condition in selector.conditions():
            names = prefix_queues(db, condition, paused)
            rounds, refreshed = 0, False
            while len(picked) < limit:
                want = limit - len(picked)
                full = [queue for queue, left in room.items() if left <= 0]
                where, more, order = condition, False, ("-priority", "job_id")
                if names is not None:
                    open_names = [name for name in names if name not in full]
                    found = candidates(db, open_names, picked, want, rounds)
                    where = Q(job_id__in=[job_id for _, job_id in found])
                    more = len(found) == CANDIDATES * want
                    if len({priority for priority, _ in found}) <= 1:
                        # One priority: claim order is id order, which the primary key
                        # reads without sorting, so the read stops (and stops locking) at
                        # the first free ``want`` of them and a competing claim gets the
                        # rest. A sort would read, and lock, every candidate.
                        order = ("job_id",)
                rows = ReadyExecution.objects.using(db).select_for_update(skip_locked=True)
                rows = rows.filter(where).exclude(queue_name__in=paused)
                if full:
                    rows = rows.exclude(queue_name__in=full)
                if picked:
                    # Rows this transaction already locked are not skipped: exclude them.
                    rows = rows.exclude(job_id__in=[job_id for job_id, _ in picked])
                batch = list(rows.order_by(*order).values_list("job_id", "queue_name")[:want])
                over_cap = False
                for job_id, queue in batch:
                    if queue in room:
                        if room[queue] <= 0:
                            over_cap = True
                            continue
                        room[queue] -= 1
                    picked.append((job_id, queue))
                rounds += 1
                # Candidates other claimers held: the next ones, a few rounds at most.
                more = more and len(batch) < want and rounds < CANDIDATE_ROUNDS
                if names is not None and not found and not refreshed:
                    # Nothing in the queues last seen: look again for new ones, once.
                    forget_prefix_queues(db, condition)
                    names = prefix_queues(db, condition, paused)
                    rounds, refreshed, more = 0, True, names is not None
                if not over_cap and not more:
                    break
        if not picked:
            return []
        ids = [job_id for job_id, _ in picked]
        jobs = read_jobs(db, ids)
        now = timezone.now()
        insert_claims(db, process_id, [(jobs[job_id], queue) for job_id, queue in picked], now)
        delete_executions(db, ReadyExecution, ids)
        starting = (
            [] if worker_id is None else [jobs[pk] for pk in ids if starts_at_claim(jobs[pk])]
        )
        rows = [
            (job.pk, job.attempts, job.worker_ids, job.started_at, job.unique_until, job.rate_key)
            for job in starting
        ]
        written = write_starts(db, rows, worker_id or "", now, {})
        claimed_only = [pk for pk in ids if pk not in written]
        if claimed_only:
            Job.objects.using(db).filter(pk__in=claimed_only).update(status=JobStatus.CLAIMED)
    for pk, job in jobs.items():
        job.status = JobStatus.CLAIMED
        if pk in written:
            job.attempts, job.worker_ids, job.started_at, job.last_attempted_at = written[pk]
            job.status = JobStatus.RUNNING
    return [jobs[job_id] for job_id in ids]


def starts_at_claim(job: Job) -> bool:
    """Whether a worker's claim also counts ``job``'s attempt (``claim_jobs``): not
    when its start is decided under another lock (a rate limit), nor when it lets
    go of a unique key as it starts, which a hand-back could not take back."""
    return job.rate_key is None and job.unique_until != UniqueUntil.START


# A prefix claim on MariaDB/MySQL reads this many candidates per job it wants, in up to
# this many rounds, and gives up (the next claim tries again) past this many queues.
CANDIDATES = 4
CANDIDATE_ROUNDS = 3
MAX_PREFIX_QUEUES = 50


def prefix_queues(db: str, condition: Q, paused: set[str] | QuerySet) -> list[str] | None:
    """On MariaDB/MySQL, the queues with ready jobs that a ``prefix*`` pattern covers,
    to claim from by :func:`candidates`; None to claim with ``condition`` itself.

    InnoDB locks every row a locking read reads. Read with ``LIKE 'reports%'``,
    the planner walks the claim-order index (``jobs_ready_order``) through every
    other queue's backlog before its first match: with 10,000 older jobs in
    another queue one claim locked 20,032 rows and claims ran at 0.29 of ``*``
    (bench/throughput.py --phases prefix). Through the queue-name index it must
    sort all the matching rows first, and locks all of those. So a prefix claim
    picks its candidates by plain reads, one ordered index read per queue, and
    locks only them, by primary key.
    """
    if connections[db].vendor != "mysql" or len(condition.children) != 1:
        return None
    lookup, prefix = condition.children[0]
    if lookup != "queue_name__startswith" or condition.negated:
        return None
    key = (db, prefix)
    cached = PREFIX_NAMES.get(key)
    now = time.monotonic()
    if cached is None or now - cached[0] > PREFIX_NAMES_TTL:
        found = list(
            ReadyExecution.objects.using(db)
            .filter(queue_name__startswith=prefix)
            .order_by("queue_name")
            .values_list("queue_name", flat=True)
            .distinct()[: MAX_PREFIX_QUEUES + 1]
        )
        cached = PREFIX_NAMES[key] = (now, found)
    if len(cached[1]) > MAX_PREFIX_QUEUES:
        return None
    # Paused queues as a set (with caps) are left out here; otherwise the locking read
    # leaves them out.
    return [name for name in cached[1] if not isinstance(paused, set) or name not in paused]


def forget_prefix_queues(db: str, condition: Q) -> None:
    PREFIX_NAMES.pop((db, condition.children[0][1]), None)


# (db, prefix) -> (when read, the queue names with ready jobs then): a queue that gets
# its first ready job is served by the claims of this process within PREFIX_NAMES_TTL,
# at once if the queues known have nothing ready.
PREFIX_NAMES: dict[tuple[str, str], tuple[float, list[str]]] = {}
PREFIX_NAMES_TTL = 1.0


def candidates(
    db: str, names: list[str], picked: list[tuple[int, str]], want: int, round_: int
) -> list[tuple[int, int]]:
    """The next ``CANDIDATES * want`` ready jobs of ``names`` in claim order (priority,
    then age), skipping the rounds before; read without locks, so a claimer
    competing for the same ones makes the locking read skip them, not wait.
    ``(priority, job id)`` pairs."""
    count = CANDIDATES * want
    taken = [job_id for job_id, _ in picked]
    parts = []
    for name in names:
        rows = ReadyExecution.objects.using(db).filter(queue_name=name)
        if taken:
            rows = rows.exclude(job_id__in=taken)
        parts.append(
            rows.order_by("-priority", "job_id").values_list("priority", "job_id")[
                : count * (round_ + 1)
            ]
        )
    if not parts:
        return []
    # One round trip: each queue's part an ordered read of its own index.
    found = list(parts[0].union(*parts[1:], all=True)) if len(parts) > 1 else list(parts[0])
    found.sort(key=lambda row: (-row[0], row[1]))
    return found[count * round_ : count * (round_ + 1)]


def claim_in_one_statement(
    db: str, process_id: int, selector: QueueSelector, limit: int, worker_id: str | None = None
) -> list[Job]:
    """PostgreSQL without queue caps: one statement per queue pattern (see pg_claims)."""
    now = timezone.now()
    patterns = list(selector.conditions())
    # One pattern (the usual "*") is one atomic statement; several share a transaction.
    with transaction.atomic(using=db) if len(patterns) > 1 else nullcontext():
        jobs: list[Job] = []
        for condition in patterns:
            if len(jobs) >= limit:
                break
            jobs += pg_claims.claim_matching(
                db, process_id, condition, limit - len(jobs), now, worker_id
            )
    return jobs


def lease_end(job: Job, now: datetime) -> datetime | None:
    if job.concurrency_key and job.concurrency_duration:
        return later(now, job.concurrency_duration)
    return None


def lock_queue_caps(
    db: str, selector: QueueSelector, caps: dict[str, int], paused: set[str]
) -> dict[str, int]:
    """Lock the cap rows of the capped queues we serve; return the room left in each."""
    queues = sorted(q for q in caps if selector.matches(q) and q not in paused)
    if not queues:
        return {}
    QueueLock.objects.using(db).bulk_create(
        [QueueLock(queue_name=queue) for queue in queues], ignore_conflicts=True
    )
    list(
        QueueLock.objects.using(db)
        .select_for_update()
        .filter(queue_name__in=queues)
        .order_by("queue_name")
        .values_list("pk", flat=True)
    )
    running = dict(
        ClaimedExecution.objects.using(db)
        .filter(queue_name__in=queues)
        .values_list("queue_name")
        .annotate(n=Count("pk"))
        .values_list("queue_name", "n")
    )
    return {queue: caps[queue] - running.get(queue, 0) for queue in queues}


def delete_claim(db: str, claim: ClaimedExecution) -> None:
    # A queryset delete, not claim.delete(): that one resets claim.job_id (the
    # primary key) to None, and callers still need it.
    ClaimedExecution.objects.using(db).filter(pk=claim.job_id).delete()


def lock_own_claim(db: str, job_id: int, process_id: int) -> ClaimedExecution | None:
    return (
        ClaimedExecution.objects.using(db)
        .select_for_update()
        .filter(job_id=job_id, process_id=process_id)
        .first()
    )


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
    if any(job.rate_key for job in jobs):
        ensure_rate_rows(db, {job.rate_key for job in jobs if job.rate_key})
        start_held = start_locked
    elif connections[db].vendor == "postgresql":
        start_held = pg_claims.start_held
    else:
        start_held = start_locked
    written = start_held(db, [job.pk for job in jobs], process_id, worker_id, now)
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


@dataclass(frozen=True)
class Waiting:
    """A job the start sent back to wait for its rate window, until ``until``."""

    until: datetime


def start_locked(
    db: str, job_ids: list[int], process_id: int, worker_id: str, now: datetime
) -> dict[int, tuple | Waiting]:
    """The ORM's :func:`start_jobs`: lock this process's claims, then update their jobs.

    Returns ``{job id: (attempts, worker_ids, started_at, last_attempted_at)}`` as
    written, or ``Waiting`` for a job over its rate limit. Rate-limited keys are
    locked after the claims (docs/design.md section 4's order, extended in
    django_jobs/core/rate_limits.py), and a job sent back frees its concurrency slot
    after that.
    """
    with hot_transaction(db):
        held = list(
            ClaimedExecution.objects.using(db)
            .select_for_update()
            .filter(job_id__in=job_ids, process_id=process_id)
            .order_by("job_id")
            .values_list("job_id", flat=True)
        )
        if not held:
            return {}
        # Read under the claims' locks, not taken from the callers' copies, which
        # may be older than an earlier attempt.
        rows = list(
            Job.objects.using(db)
            .filter(pk__in=held)
            .order_by("-priority", "pk")
            .values_list(
                "pk",
                "attempts",
                "worker_ids",
                "started_at",
                "unique_until",
                "rate_key",
                "rate_limit",
                "rate_period",
                "rate_reserved_at",
            )
        )
        waiting, starts = decide_rates(db, rows, now)
        starting = [
            (pk, attempts, worker_ids, started_at, unique_until, rate_key)
            for pk, attempts, worker_ids, started_at, unique_until, rate_key, *_ in rows
            if pk not in waiting
        ]
        written: dict[int, tuple | Waiting] = dict(waiting)
        written.update(write_starts(db, starting, worker_id, now, starts))
    return written


def write_starts(
    db: str,
    rows: list[tuple],
    worker_id: str,
    now: datetime,
    starts: dict[int, datetime],
) -> dict[int, tuple]:
    """Count the attempt of each job of ``rows`` (``(pk, attempts, worker_ids,
    started_at, unique_until, rate_key)`` as read under a lock the caller holds);
    returns each one's ``(attempts, worker_ids, started_at, last_attempted_at)`` as
    written. ``starts``: the recorded start of each rate-limited one."""
    written: dict[int, tuple] = {}
    # Jobs whose new column values coincide share one UPDATE (usually all of them).
    groups: dict[tuple, list[int]] = defaultdict(list)
    for pk, attempts, worker_ids, started_at, unique_until, rate_key in rows:
        stamp = now if rate_key is None else starts[pk]
        worker_ids = [*(worker_ids or []), worker_id]
        written[pk] = (attempts + 1, worker_ids, started_at or stamp, stamp)
        shape = (
            attempts + 1,
            json.dumps(worker_ids),
            started_at is None,
            unique_until == UniqueUntil.START,
            stamp,
            rate_key is not None,
        )
        groups[shape].append(pk)
    connection = connections[db]
    quote = connection.ops.quote_name
    moment = Job._meta.get_field("last_attempted_at")
    ids_field = Job._meta.get_field("worker_ids")
    with connection.cursor() as cursor:
        for shape, pks in groups.items():
            attempts, worker_ids, first_start, releases_key, stamp, rated = shape
            at = moment.get_db_prep_save(stamp, connection)
            ids_value = ids_field.get_db_prep_save(json.loads(worker_ids), connection)
            # A job unique only while waiting lets go of its key as it starts.
            extra = (
                (", started_at = %s" if first_start else "")
                + (", unique_lock = NULL" if releases_key else "")
                + (", rate_reserved_at = NULL" if rated else "")
            )
            marks = ", ".join(["%s"] * len(pks))
            cursor.execute(
                f"UPDATE {quote(Job._meta.db_table)} SET status = %s, attempts = %s, "
                f"worker_ids = %s, last_attempted_at = %s{extra} WHERE id IN ({marks})",
                [JobStatus.RUNNING, attempts, ids_value, at, *([at] if first_start else []), *pks],
            )
    return written


def read_jobs(db: str, ids: list[int]) -> dict[int, Job]:
    """The jobs ``ids``, by id, read by SQL written once: a claim's every batch, where
    the ORM's query building cost more CPU than the read (``finish_locked``'s note)."""
    connection = connections[db]
    marks = ", ".join(["%s"] * len(ids))
    table = connection.ops.quote_name(Job._meta.db_table)
    rows = Job.objects.using(db).raw(f"SELECT * FROM {table} WHERE id IN ({marks})", ids)
    return {job.pk: job for job in rows}


def insert_claims(db: str, process_id: int, picked: list[tuple[Job, str]], now: datetime) -> None:
    """One INSERT of the claimed rows of ``picked`` (each job with the queue it was
    claimed from), as ``bulk_create`` would write them, built without the ORM."""
    connection = connections[db]
    fields = ClaimedExecution._meta
    created = fields.get_field("created_at").get_db_prep_save(now, connection)
    lease_field = fields.get_field("lease_expires_at")
    params: list[object] = []
    for job, queue in picked:
        lease = lease_field.get_db_prep_save(lease_end(job, now), connection)
        params += [job.pk, process_id, queue, job.concurrency_key, lease, job.batch_id, created]
    values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s)"] * len(picked))
    table = connection.ops.quote_name(ClaimedExecution._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (job_id, process_id, queue_name, concurrency_key, "
            f"lease_expires_at, batch_id, created_at) VALUES {values}",
            params,
        )


def decide_rates(
    db: str, rows: list[tuple], now: datetime
) -> tuple[dict[int, Waiting], dict[int, datetime]]:
    """Admit or send back each rate-limited job of ``rows`` (in claim order), under
    its key's lock; the ones sent back wait as scheduled jobs, their slots freed.

    Returns the jobs sent back, and the recorded start time of each one admitted.
    """
    waiting: dict[int, Waiting] = {}
    starts: dict[int, datetime] = {}
    rated = [row for row in rows if row[5] is not None]
    if not rated:
        return waiting, starts
    windows = lock_rate_limits(db, {row[5] for row in rated})
    clock = now.timestamp()
    for pk, *_, rate_key, limit, period, reserved_at in rated:
        window = windows.get(rate_key)
        if window is None:
            # Its row was pruned after ensure_rate_rows: no start to count it
            # against, so the job waits a moment and the next start recreates it.
            waiting[pk] = Waiting(now + timedelta(seconds=1))
            continue
        reserved = None if reserved_at is None else reserved_at.timestamp()
        decision = window.decide(clock, Rate(limit, period), reserved)
        at = datetime.fromtimestamp(decision.at, tz=UTC)
        if decision.admitted:
            starts[pk] = at
        else:
            waiting[pk] = Waiting(at)
    save_windows(db, windows.values(), now)
    if waiting:
        wait_for_rate(db, {pk: sent_back.until for pk, sent_back in waiting.items()})
    return waiting, starts


def wait_for_rate(db: str, until: dict[int, datetime]) -> None:
    """Claimed jobs over their rate limit: scheduled for their planned time, slots freed.

    Never started, so like a hand-back they cost no attempt; unlike one, they
    wait in ``ScheduledExecution`` (promoted when due, through admission). One
    cancelled meanwhile ends here instead, as a hand-back would end it.
    """
    claims = list(ClaimedExecution.objects.using(db).filter(job_id__in=list(until)))
    delete_executions(db, ClaimedExecution, list(until))
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


def finish_job(db: str, job_id: int, process_id: int, return_value: object) -> bool:
    """Record one success; False (and nothing written) if this process no longer holds it."""
    return job_id in finish_jobs(db, process_id, {job_id: return_value})


def finish_jobs(
    db: str,
    process_id: int,
    return_values: dict[int, object],
    plain: Collection[int] = (),
    keyed: Mapping[int, str] | None = None,
) -> set[int]:
    """Record the success of many jobs in one transaction; return the ids finished.

    Only jobs whose claim this process still holds are finalised (under the
    claims' locks), so each is finalised exactly once however many paths race
    for it. Every key's semaphore is locked before any key's blocked jobs are
    promoted (:func:`~django_jobs.core.admission.release_slots`), and the batches are
    counted after every key (docs/design.md section 4's lock order).

    ``plain`` and ``keyed``: what the caller knows of jobs that have no batch:
    the ids of those with no concurrency key (``plain``), and the key of each
    that has one (``keyed``, id -> key). On PostgreSQL those are finished
    without the ORM (``pg_claims``, which checks the hints: a wrong one costs a
    statement, nothing else): the plain ones in one statement, the keyed ones
    with their slots' release in one message. Only the rest take the general
    transaction.
    """
    if not return_values:
        return set()
    done: set[int] = set()
    if connections[db].vendor == "postgresql":
        keyed = keyed or {}
        plain_values = {pk: return_values[pk] for pk in plain if pk in return_values}
        keyed_values = {pk: return_values[pk] for pk in keyed if pk in return_values}
        if plain_values:
            done |= set(pg_claims.finish_unbatched(db, process_id, plain_values, timezone.now()))
        if keyed_values:
            keys = {keyed[pk] for pk in keyed_values}
            done |= finish_keyed_unbatched(db, process_id, keyed_values, keys)
        if len(done) == len(return_values):
            return done
        return_values = {pk: value for pk, value in return_values.items() if pk not in done}
    return done | finish_locked(db, process_id, return_values)


def finish_keyed_unbatched(
    db: str, process_id: int, return_values: dict[int, object], keys: Collection[str]
) -> set[int]:
    """PostgreSQL, jobs without a batch: their claims, then their keys' slots, in one
    round trip (``pg_claims.finish_keyed``); where the connection cannot send several
    statements at once, in one transaction of five (BEGIN, the finish, the
    semaphores' lock, the recount and promotion, COMMIT)."""
    now = timezone.now()
    finished = pg_claims.finish_keyed(db, process_id, return_values, keys, now)
    if finished is not None:
        return set(finished)
    with transaction.atomic(using=db):
        found = pg_claims.finish_unbatched(db, process_id, return_values, now, keyed=True)
        release_slots(db, {key for key in found.values() if key})
    return set(found)


def finish_locked(db: str, process_id: int, return_values: dict[int, object]) -> set[int]:
    """The portable :func:`finish_jobs`: any job, keys and batches included.

    Three statements in one transaction (the claims locked, deleted, the jobs
    updated), then the keys' slots and the batches' counts. The SQL is written
    here rather than built by the ORM: on MariaDB and SQLite this is the
    completer's every batch, and building the queries (a ``CASE`` per return
    value, in ``bulk_update``) cost more CPU than the database spent running
    them (docs/running.md, "What runs").
    """
    connection = connections[db]
    quote = connection.ops.quote_name
    ids = sorted(return_values)
    marks = ", ".join(["%s"] * len(ids))
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with hot_transaction(db):
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT job_id, concurrency_key, batch_id "
                f"FROM {quote(ClaimedExecution._meta.db_table)} "
                f"WHERE process_id = %s AND job_id IN ({marks}) ORDER BY job_id{lock}",
                [process_id, *ids],
            )
            claims = cursor.fetchall()
            if not claims:
                return set()
            done = [job_id for job_id, _, _ in claims]
            delete_executions(db, ClaimedExecution, done)
            cursor.execute(*finish_update(connection, done, return_values))
        release_slots(db, {key for _, key, _ in claims if key})
        per_batch: dict[int, int] = defaultdict(int)
        for _, _, batch_id in claims:
            if batch_id is not None:
                per_batch[batch_id] += 1
        count_outcomes(db, {batch_id: (n, 0) for batch_id, n in per_batch.items()})
    return set(done)


def finish_update(
    connection: BaseDatabaseWrapper, done: list[int], return_values: dict[int, object]
) -> tuple[str, list[object]]:
    """The UPDATE that marks ``done`` succeeded, with each one's return value."""
    quote = connection.ops.quote_name
    field = Job._meta.get_field("return_value")
    finished_at = Job._meta.get_field("finished_at").get_db_prep_save(timezone.now(), connection)
    params: list[object] = [JobStatus.SUCCEEDED, finished_at]
    valued = [pk for pk in done if return_values[pk] is not None]
    value_sql = ""
    if valued:
        # No ELSE: a job that returned None gets NULL, whatever an earlier run left.
        value_sql = ", return_value = CASE id" + " WHEN %s THEN %s" * len(valued) + " END"
        for pk in valued:
            params += [pk, field.get_db_prep_save(return_values[pk], connection)]
    marks = ", ".join(["%s"] * len(done))
    sql = (
        f"UPDATE {quote(Job._meta.db_table)} SET status = %s, finished_at = %s, "
        f"unique_lock = NULL{value_sql} WHERE id IN ({marks})"
    )
    return sql, [*params, *done]


def fail_job(
    db: str,
    job_id: int,
    process_id: int,
    error: ErrorInfo,
    *,
    worker_id: str = "",
    retry: bool = True,
    never_ran: bool = False,
) -> FailOutcome | None:
    """Record a failed attempt; retry after the backoff while attempts remain.

    ``never_ran``: the caller (the job's worker) knows its body never ran (its
    task could not be imported): a start counted by the claim is undone first.
    Returns None if this process no longer holds the job.
    """
    with hot_transaction(db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return None
        if never_ran:
            undo_start(db, job_id)
        return fail_claimed(db, claim, error, worker_id=worker_id, retry=retry)


def undo_start(db: str, job_id: int) -> None:
    """Uncount the start of a job whose body never ran; its caller holds its claim's lock.

    A worker's claim starts the jobs it claims (``claim_jobs``).
    When that worker then does not run one (a stop began, its task cannot be
    imported, its claim's commit seemed lost) the attempt was never made, so it
    is taken back: attempts are real starts (docs/design.md invariant 4). A job that
    is not ``RUNNING`` was never started and is left as it is. The previous
    attempt's ``last_attempted_at``, overwritten by the claim, is not restored.
    """
    job = (
        Job.objects.using(db)
        .filter(pk=job_id, status=JobStatus.RUNNING)
        .only("pk", "attempts", "worker_ids", "started_at", "last_attempted_at")
        .first()
    )
    if job is None:
        return
    attempts = max(0, job.attempts - 1)
    Job.objects.using(db).filter(pk=job_id).update(
        status=JobStatus.CLAIMED,
        attempts=attempts,
        worker_ids=list(job.worker_ids or [])[:-1],
        started_at=job.started_at if attempts else None,
        last_attempted_at=job.last_attempted_at if attempts else None,
    )


def fail_claimed(
    db: str, claim: ClaimedExecution, error: ErrorInfo, *, worker_id: str, retry: bool
) -> FailOutcome:
    """The body of :func:`fail_job`; the caller holds the lock on ``claim``."""
    job = Job.objects.using(db).get(pk=claim.job_id)
    now = timezone.now()
    # Whoever built the error, what is written fits every database: no NUL, cut to size.
    FailedExecution.objects.using(db).create(
        job_id=job.pk,
        attempt=job.attempts,
        worker_id=worker_id,
        exception_class_path=storable_text(error.exception_class_path, 255),
        message=storable_text(error.message, MAX_ERROR_MESSAGE),
        traceback=storable_text(error.traceback, size_limit("max_error_size")),
        failed_at=now,
    )
    delete_claim(db, claim)
    retry_at = None
    # A job whose cancel was requested is never retried, whatever ended this attempt (a
    # shutdown or a timeout can land before its worker has seen the request).
    if retry and job.attempts < job.max_attempts and job.cancel_requested_at is None:
        retry_at = later(now, retry_delay(job.backoff, job.attempts, job.task_path))
    if retry_at is None:
        Job.objects.using(db).filter(pk=job.pk).update(
            status=JobStatus.FAILED, finished_at=now, unique_lock=None
        )
    elif retry_at > now:
        ScheduledExecution.objects.using(db).create(
            job_id=job.pk, queue_name=job.queue_name, priority=job.priority, scheduled_at=retry_at
        )
        Job.objects.using(db).filter(pk=job.pk).update(status=JobStatus.SCHEDULED)
    if claim.concurrency_key:
        release_slot(db, claim.concurrency_key)
    if retry_at is None:
        count_outcome(db, job.batch_id, succeeded=False)
    if retry_at is not None and retry_at <= now:
        # Due at once: through admission, after the slot was given back.
        job.status = JobStatus.SCHEDULED
        admit_jobs(db, [job])
    return FailOutcome(retry_at=retry_at)


def snooze_job(db: str, job_id: int, process_id: int, seconds: float) -> datetime | None:
    """Put a running job back to wait ``seconds``: the task asked (``Snooze``).

    Its start stays counted (attempts are real starts) and ``max_attempts`` grows
    by one, so the snooze uses up no retry. Its slot is freed like a failure's;
    a job due at once goes back through admission after that. Returns when it
    will run, or None if this process no longer holds it.
    """
    with transaction.atomic(using=db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return None
        job = Job.objects.using(db).get(pk=job_id)
        now = timezone.now()
        run_at = later(now, seconds)
        delete_claim(db, claim)
        job.max_attempts += 1
        job.status = JobStatus.SCHEDULED
        Job.objects.using(db).filter(pk=job_id).update(
            status=JobStatus.SCHEDULED, max_attempts=F("max_attempts") + 1
        )
        if seconds > 0:
            ScheduledExecution.objects.using(db).create(
                job_id=job_id, queue_name=job.queue_name, priority=job.priority, scheduled_at=run_at
            )
        if claim.concurrency_key:
            release_slot(db, claim.concurrency_key)
        if seconds <= 0:
            admit_jobs(db, [job])
    return run_at


def release_job(db: str, job_id: int, process_id: int) -> bool:
    """Hand back a claimed job whose function never started; it costs no attempt.

    With a concurrency key the job goes back through the limit (its slot is
    freed and it competes for it again with the blocked jobs), never around it
    (Solid Queue PR #689 items 3 and 6).
    """
    with transaction.atomic(using=db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return False
        # Its worker hands it back unrun: a start its claim counted is taken back.
        undo_start(db, job_id)
        release_claimed(db, claim)
    return True


def release_claimed(db: str, claim: ClaimedExecution) -> None:
    delete_claim(db, claim)
    job = Job.objects.using(db).get(pk=claim.job_id)
    if job.cancel_requested_at is not None:
        # Cancelled before it ever started: it ends here, costing no attempt, rather
        # than waiting to be claimed again only to be stopped at its start.
        end_cancelled(db, [job], {claim.concurrency_key})
        return
    if claim.concurrency_key:
        hand_back_to_key(db, claim.concurrency_key, job)
    else:
        make_ready(db, [job])


def end_cancelled(db: str, jobs: list[Job], keys: Iterable[str | None]) -> None:
    """Cancelled jobs whose claims were just deleted, never started: FAILED,
    JobCancelled. Then the slots of ``keys`` (the deleted claims' concurrency keys)
    are freed and the jobs' batches counted, in docs/design.md section 4's order."""
    now = timezone.now()
    for job in jobs:
        record_cancelled(db, job.pk, job.attempts, now, "cancelled before it started")
    if jobs:
        Job.objects.using(db).filter(pk__in=[job.pk for job in jobs]).update(
            status=JobStatus.FAILED, finished_at=now, unique_lock=None
        )
    release_slots(db, {key for key in keys if key})
    count_failed(db, jobs)


def recover_claim(db: str, job_id: int, process_id: int, reason: str) -> str | None:
    """Settle one claim of a dead process: hand back if never started, else fail it.

    The job's status is read under the claim's lock, so a falsely pruned worker
    that starts the job at the same moment is seen either before (running: a
    failed attempt) or after (the claim is gone: nothing to do).
    """
    with transaction.atomic(using=db):
        claim = lock_own_claim(db, job_id, process_id)
        if claim is None:
            return None
        status, cancel_requested_at = (
            Job.objects.using(db)
            .filter(pk=job_id)
            .values_list("status", "cancel_requested_at")
            .get()
        )
        if status == JobStatus.RUNNING:
            error = ErrorInfo("django_jobs.exceptions.ProcessDied", reason, reason)
            if cancel_requested_at is not None:
                # Cancelled while it ran: never retried, even when its worker died first.
                message = f"cancelled; {reason}"
                error = ErrorInfo("django_jobs.exceptions.JobCancelled", message, message)
            retry = cancel_requested_at is None
            outcome = fail_claimed(db, claim, error, worker_id="", retry=retry)
            return "retried" if outcome.will_retry else "failed"
        release_claimed(db, claim)
        return "released"


def recover_process_claims(db: str, process_id: int, reason: str) -> dict[int, str]:
    """Recover every claim of ``process_id``; each exactly once, whoever else tries."""
    outcomes: dict[int, str] = {}
    job_ids = list(
        ClaimedExecution.objects.using(db)
        .filter(process_id=process_id)
        .values_list("job_id", flat=True)
    )
    for job_id in job_ids:
        try:
            outcome = recover_claim(db, job_id, process_id, reason)
        except (OperationalError, InterfaceError):
            raise  # the database, not the job: the caller rides out the outage
        except Exception as exc:
            # One job's row must not stop the recovery of the others, nor a process's
            # start-up (the supervisor recovers before it starts anything).
            logger.exception("job %s: its claim could not be recovered as usual", job_id)
            outcome = recover_without_retry(db, job_id, process_id, reason, exc)
        if outcome:
            outcomes[job_id] = outcome
    return outcomes


def recover_without_retry(
    db: str, job_id: int, process_id: int, reason: str, exc: Exception
) -> str | None:
    """The last resort of :func:`recover_process_claims`: fail the job for good, without
    reading anything of the row's (its backoff, its key's blocked jobs) that made the
    usual recovery raise. Left as it is (an orphan claim that the next prune tries
    again, logged each time) only if even this cannot be written."""
    message = f"{reason}; not retried: recovering it raised {type(exc).__name__}: {safe_str(exc)}"
    error = ErrorInfo("django_jobs.exceptions.ProcessDied", message, message)
    try:
        with transaction.atomic(using=db):
            claim = lock_own_claim(db, job_id, process_id)
            if claim is None:
                return None
            fail_claimed(db, claim, error, worker_id="", retry=False)
    except (OperationalError, InterfaceError):
        raise
    except Exception:
        logger.exception("job %s: its claim could not be recovered; left for the next try", job_id)
        return None
    return "failed"
