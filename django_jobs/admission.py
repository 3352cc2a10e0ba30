"""Admission: turning a waiting job into a ready one, through its key's semaphore.

Every path that makes a job runnable (enqueue, bulk enqueue, promotion of a due
scheduled job, retry, hand-back at shutdown) calls :func:`admit_jobs`, and
every path that ends a holder's claim calls :func:`release_slot`, always inside
the caller's transaction. The semaphore row of a key is locked with
``select_for_update()`` before it is read, so an enqueue that decides to block
and a finish that looks for blocked jobs can never miss each other (the race of
Solid Queue #456): whichever locks second sees the other's committed rows.

Lock order (DESIGN.md section 4): a claimed row, then one semaphore at a time
in ascending key order, then the ready/blocked rows of that key.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from django.db import connections
from django.db.models import Count, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from .models import BlockedExecution, ClaimedExecution, Job, JobStatus, ReadyExecution, Semaphore


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
    if keyless:
        make_ready(db, keyless)
    discarded: list[Job] = []
    for key in sorted(by_key):
        discarded += admit_to_key(db, key, by_key[key])
    # Batch rows come after every semaphore (lock order): counted once all keys are done.
    count_discarded(db, discarded)


def make_ready(db: str, jobs: list[Job]) -> None:
    now = timezone.now()
    ReadyExecution.objects.using(db).bulk_create(
        [
            ReadyExecution(
                job_id=job.pk,
                queue_name=job.queue_name,
                priority=job.priority,
                concurrency_key=job.concurrency_key,
                created_at=now,
            )
            for job in jobs
        ]
    )
    set_status(db, jobs, JobStatus.READY)


def set_status(db: str, jobs: list[Job], status: JobStatus) -> None:
    changed = [job.pk for job in jobs if job.status != status]
    if changed:
        Job.objects.using(db).filter(pk__in=changed).update(status=status)
    for job in jobs:
        job.status = status


def lock_semaphore(db: str, key: str, limit: int) -> Semaphore:
    """Lock (creating on first use, conflict-safely) the semaphore row of ``key``."""
    semaphores = Semaphore.objects.using(db).select_for_update()
    semaphore = semaphores.filter(key=key).first()
    if semaphore is None:
        # An upsert whose update is a no-op, not INSERT IGNORE: on MySQL/MariaDB a
        # duplicate-key INSERT IGNORE takes a *shared* lock on the row another
        # enqueue just inserted, and two such waiters both upgrading to the FOR
        # UPDATE below deadlock. The upsert takes the exclusive lock at once.
        features = connections[db].features
        Semaphore.objects.using(db).bulk_create(
            [Semaphore(key=key, limit=limit, value=limit)],
            update_conflicts=True,
            update_fields=["key"],
            unique_fields=["key"] if features.supports_update_conflicts_with_target else None,
        )
        semaphore = semaphores.get(key=key)
    return semaphore


def lock_existing_semaphore(db: str, key: str) -> Semaphore | None:
    """Lock ``key``'s semaphore row if it exists (it does for every key with a waiting job)."""
    return Semaphore.objects.using(db).select_for_update().filter(key=key).first()


def admit_to_key(db: str, key: str, jobs: list[Job]) -> list[Job]:
    """Admit ``jobs`` of ``key`` as far as its free slots go; return the ones discarded."""
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
    admitted, rest = jobs[:free], jobs[free:]
    semaphore.value -= len(admitted)
    semaphore.updated_at = timezone.now()
    semaphore.save(using=db, update_fields=["limit", "value", "updated_at"])
    if admitted:
        make_ready(db, admitted)
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


def count_discarded(db: str, jobs: list[Job]) -> None:
    """A discarded batch item is terminal: its batch counts it as failed."""
    from .batches import count_outcomes

    per_batch: dict[int, int] = defaultdict(int)
    for job in jobs:
        if job.batch_id is not None:
            per_batch[job.batch_id] += 1
    count_outcomes(db, {batch_id: (0, n) for batch_id, n in per_batch.items()})


def release_slot(db: str, key: str) -> int:
    """After a holder of ``key`` is gone: recount the free slots and fill them.

    The caller has already deleted the holder's row in this transaction. The
    free count is recounted from the holders rather than incremented, so a
    release can never raise it above the limit, however many times it runs for
    one holder (Solid Queue PR #689 item 4, #761), and a holder whose lease
    expired is not given back twice. Returns the number promoted.
    """
    return reconcile_key(db, key)


def reconcile_key(db: str, key: str) -> int:
    """Recount ``key``'s holders under its lock, repair drift, promote what fits."""
    semaphore = lock_existing_semaphore(db, key)
    if semaphore is None:
        return 0
    semaphore.value = semaphore.limit - count_holders(db, key)
    return promote_blocked(db, semaphore)


def count_holders(db: str, key: str) -> int:
    """Ready and claimed jobs of ``key``; a claim whose lease ran out no longer counts.

    One statement, run after the semaphore's lock is granted: a statement of its
    own takes a fresh snapshot (READ COMMITTED), so it sees every holder committed
    before the lock. Counting inside the locking SELECT would not: its subqueries
    read the snapshot taken before it waited for the lock.
    """
    ready = (
        ReadyExecution.objects.using(db)
        .filter(concurrency_key=key)
        .order_by()
        .values("concurrency_key")
        .annotate(n=Count("pk"))
        .values("n")
    )
    claimed = (
        ClaimedExecution.objects.using(db)
        .filter(concurrency_key=key)
        .exclude(lease_expires_at__lt=timezone.now())
        .order_by()
        .values("concurrency_key")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return (
        Semaphore.objects.using(db)
        .filter(key=key)
        .annotate(holders=Coalesce(Subquery(ready), 0) + Coalesce(Subquery(claimed), 0))
        .values_list("holders", flat=True)
        .get()
    )


def promote_blocked(db: str, semaphore: Semaphore) -> int:
    promoted: list[Job] = []
    if semaphore.value > 0:
        # What make_ready needs is on the blocked rows: no read of the jobs.
        promoted = [
            Job(
                pk=job_id,
                queue_name=queue_name,
                priority=priority,
                concurrency_key=semaphore.key,
                status=JobStatus.BLOCKED,
            )
            for job_id, queue_name, priority in BlockedExecution.objects.using(db)
            .filter(concurrency_key=semaphore.key)
            .order_by("-priority", "job_id")
            .values_list("job_id", "queue_name", "priority")[: semaphore.value]
        ]
        if promoted:
            BlockedExecution.objects.using(db).filter(
                job_id__in=[job.pk for job in promoted]
            ).delete()
            make_ready(db, promoted)
            semaphore.value -= len(promoted)
    semaphore.updated_at = timezone.now()
    Semaphore.objects.using(db).filter(pk=semaphore.pk).update(
        value=semaphore.value, updated_at=semaphore.updated_at
    )
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
