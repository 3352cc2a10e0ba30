"""Admission: turning a waiting job into a ready one, through its key's semaphore.

Every path that makes a job runnable (enqueue, bulk enqueue, promotion of a due
scheduled job, retry, hand-back at shutdown) calls :func:`admit_jobs`, and
every path that ends a holder's claim calls :func:`release_slot`, always inside
the caller's transaction. The semaphore row of a key is locked with
``select_for_update()`` before it is read, so an enqueue that decides to block
and a finish that looks for blocked jobs can never miss each other (the race of
Solid Queue #456): whichever locks second sees the other's committed rows.

Lock order (docs/design.md section 4): a claimed row, then one semaphore at a time
in ascending key order, then the ready/blocked rows of that key.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from django.db import connections
from django.utils import timezone

from django_jobs.core.batches import count_outcomes
from django_jobs.core.dependencies import batch_failures, merge_outcomes, settle_ended
from django_jobs.core.ready import make_ready, set_status
from django_jobs.db import features, ops
from django_jobs.models import (
    BlockedExecution,
    Job,
    JobStatus,
    Semaphore,
)


def admit_jobs(db: str, jobs: Iterable[Job]) -> None:
    """Make ``jobs`` (saved, with no execution row) ready, or blocked if their key is full.

    Must run inside ``transaction.atomic(using=db)``. Updates ``status`` on the
    passed objects and in the database.
    """
    keyless: list[Job] = []
    by_key: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        if job.concurrency_key:
            by_key[job.concurrency_key].append(job)
        else:
            keyless.append(job)
    discarded: list[Job] = []
    admitted: list[Job] = []
    for key in sorted(by_key):
        discarded += admit_to_key(db, key, by_key[key], admitted)
    # After every semaphore: a fair group's stamp is the last lock a transaction takes
    # (core/fairness.py, docs/design.md section 4).
    if keyless or admitted:
        make_ready(db, keyless + admitted)
    # A discarded job is terminal: what waits for it meets its policy, and its batch
    # counts it as failed; both after every semaphore (lock order), once all keys are done.
    if discarded:
        ended = settle_ended(db, {job.pk: False for job in discarded})
        count_outcomes(db, merge_outcomes(batch_failures(discarded), ended))


def lock_semaphore(db: str, key: str, limit: int) -> Semaphore:
    """Lock (creating on first use, conflict-safely) the semaphore row of ``key``."""
    semaphores = Semaphore.objects.using(db).select_for_update()
    semaphore = semaphores.filter(key=key).first()
    if semaphore is None:
        # An upsert whose update is a no-op, not INSERT IGNORE: on MySQL/MariaDB a
        # duplicate-key INSERT IGNORE takes a *shared* lock on the row another
        # enqueue just inserted, and two such waiters both upgrading to the FOR
        # UPDATE below deadlock. The upsert takes the exclusive lock at once.
        supports = connections[db].features
        Semaphore.objects.using(db).bulk_create(
            [Semaphore(key=key, limit=limit, value=limit)],
            update_conflicts=True,
            update_fields=["key"],
            unique_fields=["key"] if supports.supports_update_conflicts_with_target else None,
        )
        semaphore = semaphores.get(key=key)
    return semaphore


def lock_existing_semaphore(db: str, key: str) -> Semaphore | None:
    """Lock ``key``'s semaphore row if it exists (it does for every key with a waiting job)."""
    return Semaphore.objects.using(db).select_for_update().filter(key=key).first()


def admit_to_key(db: str, key: str, jobs: list[Job], admitted: list[Job]) -> list[Job]:
    """Admit ``jobs`` of ``key`` as far as its free slots go, into ``admitted`` (for the
    caller to make ready once every key's semaphore is locked); return the ones discarded."""
    limit = max(job.concurrency_limit or 1 for job in jobs)
    semaphore = lock_semaphore(db, key, limit)
    if semaphore.limit != limit:
        # The newest declaration wins; free slots move by the same amount.
        semaphore.value += limit - semaphore.limit
        semaphore.limit = limit
        if semaphore.value > 0:
            # A raised limit opens slots: the jobs already blocked on the key get
            # them first, or they would wait behind free slots (invariant 2).
            # (``limit`` itself is saved below.)
            promote_blocked(db, semaphore)
    jobs = sorted(jobs, key=lambda j: (-j.priority, j.pk))
    free = max(0, semaphore.value)
    admitted += jobs[:free]
    rest = jobs[free:]
    semaphore.value -= len(jobs) - len(rest)
    semaphore.updated_at = timezone.now()
    semaphore.save(using=db, update_fields=["limit", "value", "updated_at"])
    discarded = [job for job in rest if job.on_conflict == "discard"]
    blocked = [job for job in rest if job.on_conflict != "discard"]
    if discarded:
        now = timezone.now()
        Job.objects.using(db).filter(pk__in=[job.pk for job in discarded]).update(
            status=JobStatus.DISCARDED, finished_at=now, unique_lock=None
        )
        for job in discarded:
            job.status, job.finished_at, job.unique_lock = JobStatus.DISCARDED, now, None
    if blocked:
        BlockedExecution.objects.using(db).bulk_create(
            [
                BlockedExecution(
                    job_id=job.pk,
                    queue_name=job.queue_name,
                    priority=job.priority,
                    concurrency_key=key,
                )
                for job in blocked
            ]
        )
        set_status(db, blocked, JobStatus.BLOCKED)
    return discarded


def release_slot(db: str, key: str) -> int:
    """After a holder of ``key`` is gone: recount the free slots and fill them.

    The caller has already deleted the holder's row in this transaction. The
    free count is recounted from the holders rather than incremented, so a
    release can never raise it above the limit, however many times it runs for
    one holder (Solid Queue PR #689 item 4, #761), and a holder whose lease
    expired is not given back twice. Returns the number promoted.
    """
    return release_slots(db, [key])


def release_slots(db: str, keys: Iterable[str]) -> int:
    """:func:`release_slot` for many keys at once: a finish batch's.

    Every semaphore is locked before any row of any key is touched. Doing the
    keys one after another (lock A, promote A's next job, lock B, ...) is what
    deadlocked on MariaDB: a transaction holding A's semaphore and A's new rows
    waited for B's semaphore while the holder of B waited for one of those rows
    (see ``finish_jobs``). With all semaphores first, a transaction that waits
    for a row holds every semaphore it will ever take, so nobody holding one of
    them can be waiting for it. The holders are then recounted in one statement,
    the next blocked jobs of every key picked in one windowed query, and the
    writes done in bulk.
    """
    semaphores = lock_semaphores(db, keys)
    if not semaphores:
        return 0
    if features(db).can_promote_in_one_statement:
        # The recount and the promotion below, in one statement.
        return ops(db).recount_and_promote(db, semaphores, timezone.now())
    holders = count_holders_by_key(db, [semaphore.key for semaphore in semaphores])
    for semaphore in semaphores:
        semaphore.value = semaphore.limit - holders.get(semaphore.key, 0)
    return promote_blocked_by_key(db, semaphores)


def lock_semaphores(db: str, keys: Iterable[str]) -> list[Semaphore]:
    """Lock the existing semaphores of ``keys`` in ascending key order (Python's, by code point).

    Every path that holds several semaphores takes them in this order, so no
    two can deadlock on them (``Operations.lock_in_key_order`` says how each
    database is made to lock them in it).
    """
    return ops(db).lock_in_key_order(Semaphore.objects.using(db), keys)


def reconcile_key(db: str, key: str) -> int:
    """Recount ``key``'s holders under its lock, repair drift, promote what fits."""
    semaphore = lock_existing_semaphore(db, key)
    if semaphore is None:
        return 0
    semaphore.value = semaphore.limit - count_holders(db, key)
    return promote_blocked(db, semaphore)


def count_holders(db: str, key: str) -> int:
    """Ready and claimed jobs of ``key``; a claim whose lease ran out no longer counts."""
    return count_holders_by_key(db, [key]).get(key, 0)


def count_holders_by_key(db: str, keys: list[str]) -> dict[str, int]:
    """Ready and claimed jobs of each of ``keys``, in one statement.

    Run after the semaphores' locks are granted: a statement of its own takes a
    fresh snapshot (READ COMMITTED), so it sees every holder committed before the
    lock. Counting inside the locking SELECT would not: its subqueries read the
    snapshot taken before it waited for the lock.
    """
    return ops(db).count_holders(db, keys, timezone.now())


def promote_blocked(db: str, semaphore: Semaphore) -> int:
    return promote_blocked_by_key(db, [semaphore])


def promote_blocked_by_key(db: str, semaphores: list[Semaphore]) -> int:
    """Fill each locked semaphore's free slots with its key's next blocked jobs.

    One windowed query picks, per key, the blocked jobs in priority order; what
    make_ready needs is on the blocked rows, so the jobs are not read. Writes
    the semaphores' recounted values (one UPDATE per distinct value).
    """
    free = {semaphore.key: semaphore.value for semaphore in semaphores if semaphore.value > 0}
    promoted: list[Job] = []
    if free:
        rows = ops(db).blocked_in_order(db, list(free), max(free.values()))
        promoted = [
            Job(
                pk=job_id,
                queue_name=queue_name,
                priority=priority,
                concurrency_key=key,
                status=JobStatus.BLOCKED,
                is_async=is_async,
                fair_key=fair_key,
                fair_weight=fair_weight,
            )
            for job_id, queue_name, priority, key, position, is_async, fair_key, fair_weight in rows
            if position <= free[key]
        ]
        if promoted:
            promoted.sort(key=lambda job: job.pk)
            ops(db).delete_executions(db, BlockedExecution, [job.pk for job in promoted])
            make_ready(db, promoted, at_head=True)
            per_key: dict[str, int] = defaultdict(int)
            for job in promoted:
                per_key[job.concurrency_key or ""] += 1
            for semaphore in semaphores:
                semaphore.value -= per_key.get(semaphore.key, 0)
    now = timezone.now()
    by_value: dict[int, list[int]] = defaultdict(list)
    for semaphore in semaphores:
        semaphore.updated_at = now
        by_value[semaphore.value].append(semaphore.pk)
    ops(db).set_semaphore_values(db, by_value, now)
    return len(promoted)


def hand_back_to_key(db: str, key: str, job: Job) -> None:
    """Free ``job``'s slot and let it compete again, in priority order, with the blocked jobs.

    The caller has deleted the job's claimed row. The job waits as blocked and
    the recount decides, so it never bypasses the limit (Solid Queue PR #689
    items 3 and 6).
    """
    if not Semaphore.objects.using(db).select_for_update().filter(key=key).exists():
        admit_jobs(db, [job])
        return
    BlockedExecution.objects.using(db).create(
        job_id=job.pk, queue_name=job.queue_name, priority=job.priority, concurrency_key=key
    )
    set_status(db, [job], JobStatus.BLOCKED)
    reconcile_key(db, key)
