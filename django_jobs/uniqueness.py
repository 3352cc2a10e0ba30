"""Unique jobs: the database's unique index decides, never a read-then-insert.

A unique job is inserted with ``unique_lock`` set to its key. A second job with
the same key, enqueued while the first still holds it, violates the unique
index on that column: the insert waits for the first transaction to commit
(or roll back) and then fails (or succeeds), so two enqueues at the same
instant can never both get in (the race of Oban OSS's check-then-insert). The
loser is handed the holder's row and the caller gets the holder's result.

The lock is dropped (``unique_lock`` set to NULL) in the same statement that
moves the job out of the states it covers: at its first start for
``unique_until="start"``, at its terminal state for ``"finish"``.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from .models import Job

# An insert that fails on the key and then finds no holder raced a holder that let
# go of the key in between; trying again will either insert or find the new holder.
MAX_INSERT_TRIES = 5


class UniqueKeyContention(RuntimeError):
    """The key changed hands too many times in a row to settle who holds it."""


def insert_unique(db: str, job: Job) -> Job | None:
    """Insert ``job`` (which has ``unique_lock`` set); or return the job holding its key.

    Must run inside ``transaction.atomic(using=db)``: the insert is tried in a
    savepoint, so a duplicate leaves the caller's transaction usable.

    A plain (non-locking) read for a committed holder comes first. It decides
    nothing (the index does); it spares the common duplicate a failed insert,
    which on InnoDB keeps a shared lock on the key and the gap before it until
    the caller commits: that would hold up the holder's own release of the key
    and inserts of other jobs into that gap.
    """
    for _ in range(MAX_INSERT_TRIES):
        holder = Job.objects.using(db).filter(unique_lock=job.unique_lock).first()
        if holder is not None:
            return holder
        try:
            with transaction.atomic(using=db):
                job.save(using=db, force_insert=True)
            return None
        except IntegrityError:
            job.pk = None
            holder = Job.objects.using(db).filter(unique_lock=job.unique_lock).first()
            if holder is not None:
                return holder
    raise UniqueKeyContention(f"could not settle unique key {job.unique_lock!r}")
