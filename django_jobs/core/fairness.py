"""Turns: where a ready row stands in claim order among the ready rows of its priority.

Claims take ready rows by priority (descending), then ``turn``, then job id. A job of a
queue that is not fair takes ``id * TURN_SCALE``: the id order, as before fairness. A job of
a fair queue (``DJANGO_JOBS["fair_queues"]``, docs/fairness.md) takes a virtual start time
(start-time fair queuing): its group (queue, priority, fair key) was last given turn ``L``
and the queue's head, the lowest turn ready at that priority, is ``H``; while the job of turn
``L`` still waits, its next jobs take ``max(H, L + step)``, then a step apart, with ``step =
TURN_SCALE / weight``; once nothing of the group waits they start at ``H``, and at a level
with nothing ready, at the first job's own place. A group with a backlog is thus behind every
group with fewer jobs waiting, one turn per job, and a group that was idle starts at the
head: no credit for the time it had nothing waiting, and no debt for turns it ran ahead of
the others while it ran alone.

The group's ``L`` is its ``FairTurn`` row, with the job given ``L``, whose ready row is what
"still waits" reads (another group's job may hold the same turn). The row is locked for the
write, in ascending group order, after every semaphore the transaction takes (docs/design.md
section 4): two transactions never give two jobs of one group the same turn. A row whose
``last_turn`` is NULL, negative or far past the head (edited by hand) does not stop anything:
its group's jobs take their FIFO turns (``id * TURN_SCALE``), a warning is logged, and the
row is written again.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from django.db import connections
from django.utils import timezone

from django_jobs.db import features, ops
from django_jobs.limits import (
    LARGEST_TURN,
    MAX_FAIR_WEIGHT,
    MAX_TURN_LEAD,
    MIN_FAIR_WEIGHT,
    TURN_SCALE,
)
from django_jobs.models import FairTurn, Job, ReadyExecution

logger = logging.getLogger("django_jobs.fairness")


def fifo_turn(job_id: int) -> int:
    """The turn of a job of a queue that is not fair: its id's place."""
    return job_id * TURN_SCALE


def step_of(weight: float | None) -> int:
    """Turns between two jobs of a group of ``weight`` (None: 1)."""
    if weight is None or not math.isfinite(weight) or weight <= 0:
        return TURN_SCALE
    return max(1, round(TURN_SCALE / min(max(weight, MIN_FAIR_WEIGHT), MAX_FAIR_WEIGHT)))


Group = tuple[str, int, str]


def ready_turns(db: str, jobs: Sequence[Job], at_head: bool = False) -> dict[int, int]:
    """The turn of each of ``jobs`` (saved: their ids are known), about to be made ready
    in the caller's transaction, by job id. The groups of fair jobs are stamped here:
    their ``FairTurn`` rows are locked, in ascending order, and moved past the turns given.

    ``at_head``: jobs let in by their concurrency key's freed slot (``admission``'s
    promotion, also PostgreSQL's one statement): a fair one takes its level's head, having
    had its turn once when it was enqueued and blocked; no stamp is read or locked, so a
    release, which holds semaphores, never waits for a stamp.
    """
    turns: dict[int, int] = {}
    groups: dict[Group, list[Job]] = defaultdict(list)
    for job in jobs:
        if job.fair_key is None:
            turns[job.pk] = fifo_turn(job.pk)
        else:
            groups[(job.queue_name, job.priority, job.fair_key)].append(job)
    if not groups:
        return turns
    if at_head:
        for (queue, priority, _), members in groups.items():
            head = queue_head(db, queue, priority)
            for job in members:
                turns[job.pk] = fifo_turn(job.pk) if head is None else head
        return turns
    if len(groups) == 1 and len(jobs) == 1 and features(db).writes_hold_the_database:
        (job,) = jobs
        turns[job.pk] = stamp_alone(db, job)
        return turns
    # Where a level has nothing ready, the groups of this call start at its first job's
    # FIFO turn: one call's groups are interleaved, not one after the other.
    first_fifo: dict[tuple[str, int], int] = {}
    for (queue, priority, _), members in groups.items():
        lowest = min(fifo_turn(job.pk) for job in members)
        level = (queue, priority)
        first_fifo[level] = min(first_fifo.get(level, lowest), lowest)
    stamps, created = lock_stamps(
        db, {group: min(job.pk for job in groups[group]) for group in groups}
    )
    # The heads after the stamps' locks (which may have waited for another enqueue): the
    # turns count from the head read here, and the claims move it on until this
    # transaction commits; the later it is read, the fewer of them its jobs go ahead of
    # (docs/fairness.md, the stale head).
    heads = {level: queue_head(db, *level) for level in first_fifo}
    # Whether each group's last job still waits, read for all of them at the first that
    # decides (a read per 500 groups, not one per group), after every stamp's lock.
    waiting = WaitingJobs(db, [stamp.last_job_id for stamp in stamps.values()])
    now = timezone.now()
    changed: list[FairTurn] = []
    for group in sorted(groups):
        members = sorted(groups[group], key=lambda job: job.pk)
        level = group[:2]
        head = heads[level]
        stamp = stamps[group]
        last = stamp.last_turn
        if group not in created and is_broken(last, head, first_fifo[level]):
            warn_of_stamp(members[0], last)
            for job in members:
                turn = turns[job.pk] = fifo_turn(job.pk)
        else:
            turn = opening_turn(
                head,
                last,
                lambda: waiting.has(stamp.last_job_id),  # noqa: B023
                first_fifo[level],
                members[0].fair_weight,
            )
            turns[members[0].pk] = turn
            for job in members[1:]:
                # Each job's own weight: a call's using(fair_weight=...) moves its own steps.
                turn += step_of(job.fair_weight)
                turns[job.pk] = turn
        stamp.last_turn = turn
        stamp.last_job_id = members[-1].pk
        stamp.updated_at = now
        changed.append(stamp)
    if len(changed) == 1:
        # One group, the usual enqueue: a plain UPDATE (bulk_update builds a CASE per
        # column, a fifth of a single fair enqueue's time on SQLite).
        (stamp,) = changed
        FairTurn.objects.using(db).filter(pk=stamp.pk).update(
            last_turn=stamp.last_turn, last_job_id=stamp.last_job_id, updated_at=now
        )
    else:
        # The rows exist and are this transaction's: an upsert by their group updates them,
        # in the order they were locked. Not bulk_update, whose CASE of every row's id per
        # column each row runs through: a bulk enqueue over 20,000 tenants spent minutes in
        # one such statement, 11 s in chunks of 500 (PostgreSQL, the plain bulk 1.6 s).
        upsert_stamps(
            db,
            [
                FairTurn(
                    queue_name=stamp.queue_name,
                    priority=stamp.priority,
                    fair_key=stamp.fair_key,
                    last_turn=stamp.last_turn,
                    last_job_id=stamp.last_job_id,
                    updated_at=now,
                )
                for stamp in changed
            ],
            ["last_turn", "last_job_id", "updated_at"],
        )
    return turns


# Keys read by one statement of a bulk enqueue over many groups.
STAMPS_PER_STATEMENT = 500


def upsert_stamps(db: str, rows: list[FairTurn], update_fields: list[str]) -> None:
    """Insert ``rows`` (no id), or update ``update_fields`` of the row of the same group
    (``INSERT ... ON CONFLICT DO UPDATE``, or ``ON DUPLICATE KEY UPDATE``), in their order."""
    supports = connections[db].features
    FairTurn.objects.using(db).bulk_create(
        rows,
        update_conflicts=True,
        update_fields=update_fields,
        unique_fields=(
            ["queue_name", "priority", "fair_key"]
            if supports.supports_update_conflicts_with_target
            else None
        ),
    )


def opening_turn(
    head: int | None,
    last: int | None,
    waiting: Callable[[], bool],
    idle_start: int,
    weight: float | None,
) -> int:
    """The turn of a group's first job of this call, its stamp ``last`` being sound (None:
    a new group): ``waiting()`` says whether the job of turn ``last`` still waits (read
    only where it decides)."""
    if head is None:
        # Nothing ready at its level, the queue is idle: every group starts anew, those of
        # one call from its first job's place (``idle_start``), interleaved.
        return idle_start
    if last is not None and waiting():
        # Its last job still waits: its next one comes a step after it.
        return max(head, last + step_of(weight))
    # Nothing of it waits (the last turn may be far ahead, given while it ran alone before
    # an idle spell: not a debt): it starts at the head.
    return head


def is_broken(last: int | None, head: int | None, idle_start: int) -> bool:
    """Whether an existing group's stamp is one no enqueue writes (edited by hand): NULL,
    negative, past :data:`LARGEST_TURN`, or more than :data:`MAX_TURN_LEAD` ahead of the
    head (of ``idle_start`` at an idle level)."""
    return last is None or not is_sane(last, idle_start if head is None else head)


def stamp_alone(db: str, job: Job) -> int:
    """One job's turn and its group's stamp where the caller's write transaction holds the
    database (``features.writes_hold_the_database``): one read, one upsert, nothing to lock
    (docs/fairness.md); the rule is :func:`ready_turns`'."""
    assert job.fair_key is not None
    queue, priority, key = job.queue_name, job.priority, job.fair_key
    head, found, last, waiting = ops(db).fair_group_state(db, queue, priority, key)
    fifo = fifo_turn(job.pk)
    if found and is_broken(last, head, fifo):
        warn_of_stamp(job, last)
        turn = fifo
    else:
        turn = opening_turn(head, last if found else None, lambda: waiting, fifo, job.fair_weight)
    ops(db).write_fair_stamp(db, queue, priority, key, turn, job.pk, timezone.now())
    return turn


def warn_of_stamp(job: Job, last: object = "not one an enqueue writes") -> None:
    logger.warning(
        "The fair turn of %r (queue %r, priority %d) is %s: its jobs take their FIFO turns "
        "and the row is written again.",
        job.fair_key,
        job.queue_name,
        job.priority,
        last if isinstance(last, str) else f"{last!r}, which no enqueue writes",
    )


def is_sane(last: int, start: int) -> bool:
    return 0 <= last <= LARGEST_TURN and last - start <= MAX_TURN_LEAD


def still_waiting(db: str, job_id: int | None) -> bool:
    """Whether the group's last job (``FairTurn.last_job_id``; None: a stamp written by hand
    or before migration 0025) still waits: its ready row, by primary key. Read after the
    stamp's lock, by a statement of its own: at READ COMMITTED it sees the ready row of an
    enqueue of the group that held the lock before. By the job, not by its turn: other
    groups' jobs may share the turn (groups that arrive together start at the same head),
    and a group taken for waiting by another's job steps a turn past its due."""
    return WaitingJobs(db, [job_id]).has(job_id)


class WaitingJobs:
    """Which of ``job_ids`` (the stamps' last jobs; None: none) still have a ready row:
    :func:`still_waiting` for many, read on the first :meth:`has`."""

    def __init__(self, db: str, job_ids: Sequence[int | None]) -> None:
        self.db = db
        self.job_ids = sorted({pk for pk in job_ids if pk is not None})
        self.found: set[int] | None = None

    def has(self, job_id: int | None) -> bool:
        if job_id is None:
            return False
        if self.found is None:
            self.found = set()
            for start in range(0, len(self.job_ids), STAMPS_PER_STATEMENT):
                chunk = self.job_ids[start : start + STAMPS_PER_STATEMENT]
                self.found.update(
                    ReadyExecution.objects.using(self.db)
                    .filter(pk__in=chunk)
                    .values_list("pk", flat=True)
                )
        return job_id in self.found


def queue_head(db: str, queue: str, priority: int) -> int | None:
    """The lowest turn ready in ``queue`` at ``priority``: the virtual time now (one row
    read from ``jobs_ready_poll``)."""
    return (
        ReadyExecution.objects.using(db)
        .filter(queue_name=queue, priority=priority)
        .order_by("turn")
        .values_list("turn", flat=True)
        .first()
    )


def lock_stamps(db: str, groups: dict[Group, int]) -> tuple[dict[Group, FairTurn], set[Group]]:
    """Lock the ``FairTurn`` rows of ``groups`` (each with the id of the first job it is
    stamped for), making the missing ones; the rows, read after the locks (their latest
    turns), and the groups made here.

    One upsert of every group in ascending order (``INSERT ... ON CONFLICT DO UPDATE``, or
    ``ON DUPLICATE KEY UPDATE``) makes a missing row and locks an existing one exclusively,
    row after row, as a semaphore is made (``admission.lock_semaphore``): two enqueues lock
    their common groups in one order, and a bulk of 1,000 tenants takes an upsert and two
    reads, not a locking read per tenant.

    A row made here holds no turn and, as its job, the negative of its first job's id,
    until :func:`ready_turns` writes it: no enqueue writes a negative job, and no hand edit
    knows the id of a job being enqueued, so a row made here is told from every row that was
    there before, whatever was written into that one (a turn of -1 set by hand is a broken
    stamp, as on PostgreSQL's one statement, not a new group)."""
    now = timezone.now()
    order = sorted(groups)
    upsert_stamps(
        db,
        [
            FairTurn(
                queue_name=queue,
                priority=priority,
                fair_key=key,
                last_turn=None,
                last_job_id=-groups[(queue, priority, key)],
                updated_at=now,
            )
            for queue, priority, key in order
        ],
        ["updated_at"],
    )
    found = read_stamps(db, order)
    created = {group for group, row in found.items() if row.last_job_id == -groups[group]}
    for group in created:
        found[group].last_job_id = None
    return found, created


def read_stamps(db: str, groups: list[Group]) -> dict[Group, FairTurn]:
    """The ``FairTurn`` rows of ``groups``: one read per (queue, priority) level and
    :data:`STAMPS_PER_STATEMENT` keys (an ``IN`` list of 20,000 keys passes SQLite's limit
    on parameters well before 100,000 tenants)."""
    by_level: dict[tuple[str, int], list[str]] = defaultdict(list)
    for queue, priority, key in groups:
        by_level[(queue, priority)].append(key)
    wanted = set(groups)
    found: dict[Group, FairTurn] = {}
    for (queue, priority), keys in by_level.items():
        for start in range(0, len(keys), STAMPS_PER_STATEMENT):
            rows = FairTurn.objects.using(db).filter(
                queue_name=queue,
                priority=priority,
                fair_key__in=keys[start : start + STAMPS_PER_STATEMENT],
            )
            for row in rows:
                if row_group(row) in wanted:
                    found[row_group(row)] = row
    return found


def row_group(row: FairTurn) -> Group:
    return (row.queue_name, row.priority, row.fair_key)
