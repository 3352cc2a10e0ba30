"""Ready rows: writing them (the one place a job becomes claimable) and claiming them.

A worker takes ready rows no other claimer holds, and (when it
runs them at once) starts them in the same transaction (claim = start, docs/design.md).

A claim skips rows other claimers hold locked (``SKIP LOCKED``), so workers never wait for
each other's ready rows. Queue caps (``max_concurrency``) lock one row per capped queue and
count its claims in the same transaction, so two workers never both see room for the last
slot (taskito #104).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from functools import lru_cache
from itertools import pairwise
from typing import cast

from django.db import connections, transaction
from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from django_jobs.core.fairness import ready_turns
from django_jobs.core.lanes import Lane
from django_jobs.core.queues import QueueSelector
from django_jobs.db import features, ops
from django_jobs.db.notify import jobs_ready
from django_jobs.db.rows import StartRow
from django_jobs.db.transactions import hot_transaction
from django_jobs.models import (
    ClaimedExecution,
    Job,
    JobStatus,
    Pause,
    QueueLock,
    ReadyExecution,
    UniqueUntil,
)


def make_ready(db: str, jobs: list[Job], at_head: bool = False) -> None:
    """Write the ready rows of ``jobs``: the one place a job becomes claimable (admission
    decides whether it may, under its key's semaphore; batch callbacks without a key are
    ready at once). Idle workers of their queues are woken after the commit. ``at_head``:
    see ``core.fairness.ready_turns``."""
    now = timezone.now()
    # Last of the transaction's locks, where a fair group's stamp is taken (core/fairness.py).
    turns = ready_turns(db, jobs, at_head)
    ReadyExecution.objects.using(db).bulk_create(
        [
            ReadyExecution(
                job_id=job.pk,
                queue_name=job.queue_name,
                priority=job.priority,
                concurrency_key=job.concurrency_key,
                created_at=now,
                is_async=job.is_async,
                turn=turns[job.pk],
            )
            for job in jobs
        ]
    )
    set_status(db, jobs, JobStatus.READY)
    jobs_ready(db, (job.queue_name for job in jobs))


def set_status(db: str, jobs: list[Job], status: JobStatus) -> None:
    changed = [job.pk for job in jobs if job.status != status]
    ops(db).set_job_status(db, changed, status)
    for job in jobs:
        job.status = status


def claim_jobs(
    db: str,
    process_id: int,
    selector: QueueSelector,
    limit: int,
    caps: dict[str, int] | None = None,
    worker_id: str | None = None,
    lane: Lane | None = None,
) -> list[Job]:
    """Take up to ``limit`` ready jobs, skipping rows other claimers hold locked.

    ``caps`` are queue-wide limits (``max_concurrency``): the queue's lock row
    is taken and its claims counted in this same transaction, so two workers
    can never both see room for the last slot (taskito #104), and a cap of N
    lets exactly N run.

    ``worker_id``: the caller runs the jobs at once, so the claim also starts
    those it can (:func:`starts_at_claim`; where the database claims in one
    statement, in that statement): they come back ``RUNNING``, their attempt
    counted; the rest ``CLAIMED``, for ``core.starting.start_jobs``. A worker
    that then does not run one takes the start back (``core.claimed.undo_start``).

    ``lane``: only jobs of that kind (``Job.is_async``), for a worker with room of one kind
    alone (``runtime/worker.py``, ``Worker.capacity``). The one-statement claim filters on
    it as on the queues; on MySQL/MariaDB such a claim takes the statements' path, as one
    with caps does (the claim procedure serves the usual claim, of either kind).
    """
    if limit <= 0:
        return []
    kind = Q() if lane is None else Q(is_async=lane.is_async)
    if features(db).can_claim_in_one_statement and not caps:
        return claim_in_one_statement(db, process_id, selector, limit, worker_id, kind)
    queues = named_queues(selector)
    if not caps and lane is None and queues is not PATTERNS:
        claimed = ops(db).claim_ready(db, process_id, queues, limit, worker_id, timezone.now())
        if claimed is not None:
            return claimed
    with hot_transaction(db):
        # Its process's row first, locked: a process pruned as dead claims nothing
        # (Operations.lock_own_process; MySQL/MariaDB's procedure does the same, and
        # PostgreSQL's one statement reads the row in its snapshot).
        if not ops(db).lock_own_process(db, process_id):
            return []
        # Read in the claim query itself, unless queue caps need the list first.
        paused_names = Pause.objects.using(db).values_list("queue_name", flat=True)
        paused: set[str] | QuerySet[Pause, str] = paused_names
        room: dict[str, int] = {}
        if caps:
            paused = set(paused_names)
            room = lock_queue_caps(db, selector, caps, paused)
        picked: list[tuple[int, str]] = []
        for condition in selector.conditions():
            pick_ready(db, condition, paused, room, picked, limit, kind)
        if not picked:
            return []
        return record_claims(db, process_id, picked, worker_id)


# named_queues' answer for a selector with a ``prefix*`` pattern, or ``*`` after a name.
PATTERNS: tuple[str, ...] = ("*",)


def named_queues(selector: QueueSelector) -> list[str] | tuple[str, ...] | None:
    """The selector as ``ops.claim_ready`` takes it: None for every queue (``*`` first),
    the exact names in their order (each once: rows this claim holds are not skipped by
    its next pick), or :data:`PATTERNS` where it has patterns of another kind, which
    the statements' claim serves."""
    names: list[str] = []
    for pattern in selector.patterns:
        if pattern == "*":
            # Nothing after it adds a queue; before it, the picks would need to leave
            # out the rows the names' picks hold.
            return PATTERNS if names else None
        if selector.is_wildcard(pattern):
            return PATTERNS
        if pattern not in names:
            names.append(pattern)
    return names


def pick_ready(
    db: str,
    condition: Q,
    paused: set[str] | QuerySet,
    room: dict[str, int],
    picked: list[tuple[int, str]],
    limit: int,
    kind: Q | None = None,
) -> None:
    """Lock ready rows of the queues ``condition`` (one queue pattern's) matches and of
    ``kind`` (a lane's condition), up to ``limit`` in ``picked`` (``(job id, queue)``, in
    claim order: priority, turn, id), skipping rows held by other claimers, paused queues
    and capped queues with no ``room`` left.

    The two conditions are apart so that a lane's prefix claim keeps the candidates' path
    (:func:`prefix_queues` reads the pattern alone): joined, the pattern was no longer the
    condition's one part, and a claim of ``reports*`` for one lane read through the ``LIKE``,
    locking every row of 7,000 (tests/test_lanes.py)."""
    kind = kind or Q()
    names = prefix_queues(db, condition, paused)
    matching = condition & kind
    rounds, refreshed = 0, False
    while len(picked) < limit:
        want = limit - len(picked)
        full = [queue for queue, left in room.items() if left <= 0]
        order: tuple[str, ...] = ("-priority", "turn", "job_id")
        where, more = matching, False
        found: list[tuple[int, int, int]] = []
        if names is not None:
            open_names = [name for name in names if name not in full]
            found = candidates(db, open_names, picked, want, rounds, kind)
            where = Q(job_id__in=[job_id for _, _, job_id in found]) & kind
            more = len(found) == CANDIDATES * want
            if len({priority for priority, _, _ in found}) <= 1 and in_id_order(found):
                # One priority, turns in id order (no fair queue among them): claim order
                # is id order, which the primary key reads without sorting, so the read
                # stops (and stops locking) at the first free ``want`` of them and a
                # competing claim gets the rest. A sort would read, and lock, every
                # candidate.
                order = ("job_id",)
        if names is None and not full and not picked and isinstance(paused, QuerySet):
            # The claim of every batch of a worker with no caps: its SQL, built once.
            sql, params = plain_pick(db, matching, order, want)
            with connections[db].cursor() as cursor:
                cursor.execute(sql, params)
                batch = cast(list[tuple[int, str]], cursor.fetchall())
        else:
            batch = list(ready_rows(db, where, paused, order, want, full, picked))
        over_cap = take_within_caps(batch, room, picked)
        rounds += 1
        # Candidates other claimers held: the next ones, a few rounds at most.
        more = more and len(batch) < want and rounds < CANDIDATE_ROUNDS
        if names is not None and not found and not refreshed:
            # Nothing in the queues last seen: look again for new ones, once.
            forget_prefix_queues(db, condition)
            names = prefix_queues(db, condition, paused)
            rounds, refreshed, more = 0, True, names is not None
        if not over_cap and not more:
            return


@lru_cache(maxsize=256)
def plain_pick(db: str, condition: Q, order: tuple[str, ...], want: int) -> tuple[str, tuple]:
    """The SQL of :func:`pick_ready`'s query with no caps, nothing picked yet and the paused
    queues read in it: the same each time for a worker's queues and batch size. Built
    by the ORM at every claim it cost a sixth of a no-op job's worker CPU on MariaDB
    (yappi). Compiled inside the caller's transaction, as a locking read must be."""
    paused = Pause.objects.using(db).values_list("queue_name", flat=True)
    query = ready_rows(db, condition, paused, order, want).query
    sql, params = query.get_compiler(using=db).as_sql()
    if features(db).locks_every_row_read and is_lane_alone(condition):
        # A lane's claim of every queue, read by its own index whatever the statistics
        # say: InnoDB, left to choose on a ready table of a few rows, read it whole and
        # sorted it, locking every row of both kinds until the commit, so that the other
        # lane's claim meanwhile found none free (tests/test_lanes.py, the two lanes at once).
        sql = ops(db).read_through_index(sql, ReadyExecution._meta.db_table, LANE_INDEX)
    return sql, params


# ReadyExecution's index of a lane's rows in claim order (led by the flag on InnoDB).
LANE_INDEX = "jobs_ready_async"


def is_lane_alone(condition: Q) -> bool:
    """Whether ``condition`` is a lane's and nothing else (a claim of every queue)."""
    return (
        not condition.negated
        and len(condition.children) == 1
        and isinstance(condition.children[0], tuple)
        and condition.children[0][0] == "is_async"
    )


def ready_rows(
    db: str,
    where: Q,
    paused: set[str] | QuerySet,
    order: tuple[str, ...],
    want: int,
    full: list[str] | None = None,
    picked: list[tuple[int, str]] | None = None,
) -> QuerySet:
    """``(job id, queue)`` of up to ``want`` ready rows matching ``where``, locked, skipping
    those other claimers hold, paused queues and the capped queues that are ``full``."""
    rows = ReadyExecution.objects.using(db).select_for_update(skip_locked=True)
    rows = rows.filter(where).exclude(queue_name__in=paused)
    if full:
        rows = rows.exclude(queue_name__in=full)
    if picked:
        # Rows this transaction already locked are not skipped: exclude them.
        rows = rows.exclude(job_id__in=[job_id for job_id, _ in picked])
    return rows.order_by(*order).values_list("job_id", "queue_name")[:want]


def take_within_caps(
    batch: list[tuple[int, str]], room: dict[str, int], picked: list[tuple[int, str]]
) -> bool:
    """Add the rows of ``batch`` to ``picked`` while their capped queue has room; True if
    one was left out for its cap (the caller then reads on, past it)."""
    over_cap = False
    for job_id, queue in batch:
        if queue in room:
            if room[queue] <= 0:
                over_cap = True
                continue
            room[queue] -= 1
        picked.append((job_id, queue))
    return over_cap


def record_claims(
    db: str, process_id: int, picked: list[tuple[int, str]], worker_id: str | None
) -> list[Job]:
    """Turn the locked ready rows of ``picked`` into claims of ``process_id``, starting the
    jobs that can start at claim (``worker_id`` given); the jobs, in claim order."""
    ids = [job_id for job_id, _ in picked]
    seam = ops(db)
    jobs = seam.read_jobs(db, ids, lock=True)
    now = timezone.now()
    seam.insert_claims(db, process_id, [(jobs[job_id], queue) for job_id, queue in picked], now)
    seam.delete_executions(db, ReadyExecution, ids)
    starting = [] if worker_id is None else [jobs[pk] for pk in ids if starts_at_claim(jobs[pk])]
    rows = [
        StartRow(job.pk, job.attempts, job.worker_ids, job.started_at, job.unique_until, None)
        for job in starting
    ]
    written = seam.write_starts(db, rows, worker_id or "", now, {})
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
    """Where a locking read locks every row it reads (InnoDB: MariaDB, MySQL), the
    queues with ready jobs that a ``prefix*`` pattern covers, to claim from by
    :func:`candidates`; None to claim with ``condition`` itself.

    InnoDB locks every row a locking read reads. Read with ``LIKE 'reports%'``,
    the planner walks the claim-order index (``jobs_ready_order``) through every
    other queue's backlog before its first match: with 10,000 older jobs in
    another queue one claim locked 20,032 rows and claims ran at 0.29 of ``*``
    (bench/throughput.py --phases prefix). Through the queue-name index it must
    sort all the matching rows first, and locks all of those. So a prefix claim
    picks its candidates by plain reads, one ordered index read per queue, and
    locks only them, by primary key.
    """
    if not features(db).locks_every_row_read or len(condition.children) != 1:
        return None
    lookup, prefix = cast(tuple[str, str], condition.children[0])
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
    _, prefix = cast(tuple[str, str], condition.children[0])
    PREFIX_NAMES.pop((db, prefix), None)


# (db, prefix) -> (when read, the queue names with ready jobs then): a queue that gets
# its first ready job is served by the claims of this process within PREFIX_NAMES_TTL,
# at once if the queues known have nothing ready.
PREFIX_NAMES: dict[tuple[str, str], tuple[float, list[str]]] = {}

PREFIX_NAMES_TTL = 1.0


def candidates(
    db: str,
    names: list[str],
    picked: list[tuple[int, str]],
    want: int,
    round_: int,
    kind: Q | None = None,
) -> list[tuple[int, int, int]]:
    """The next ``CANDIDATES * want`` ready jobs of ``names`` in claim order (priority,
    turn, id), skipping the rounds before; read without locks, so a claimer
    competing for the same ones makes the locking read skip them, not wait.
    ``(priority, turn, job id)``."""
    count = CANDIDATES * want
    taken = [job_id for job_id, _ in picked]
    parts = []
    for name in names:
        rows = ReadyExecution.objects.using(db).filter(kind or Q(), queue_name=name)
        if taken:
            rows = rows.exclude(job_id__in=taken)
        parts.append(
            rows.order_by("-priority", "turn", "job_id").values_list("priority", "turn", "job_id")[
                : count * (round_ + 1)
            ]
        )
    if not parts:
        return []
    # One round trip: each queue's part an ordered read of its own index.
    found = list(parts[0].union(*parts[1:], all=True)) if len(parts) > 1 else list(parts[0])
    found.sort(key=lambda row: (-row[0], row[1], row[2]))
    return found[count * round_ : count * (round_ + 1)]


def in_id_order(found: list[tuple[int, int, int]]) -> bool:
    """Whether the candidates' turns (in claim order) rise with their ids."""
    return all(a[2] < b[2] for a, b in pairwise(found))


def claim_in_one_statement(
    db: str,
    process_id: int,
    selector: QueueSelector,
    limit: int,
    worker_id: str | None = None,
    kind: Q | None = None,
) -> list[Job]:
    """Without queue caps, where the database can: one statement per queue pattern (and
    lane: ``kind``)."""
    now = timezone.now()
    patterns = list(selector.conditions())
    # One pattern (the usual "*") is one atomic statement; several share a transaction.
    with transaction.atomic(using=db) if len(patterns) > 1 else nullcontext():
        jobs: list[Job] = []
        for condition in patterns:
            if len(jobs) >= limit:
                break
            jobs += ops(db).claim_matching(
                db, process_id, condition & (kind or Q()), limit - len(jobs), now, worker_id
            )
    return jobs


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
