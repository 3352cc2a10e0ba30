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

Deadlocks on InnoDB (MySQL, MariaDB). An INSERT into a unique index first
scans the index for a duplicate and takes a *shared* next-key lock on every
entry with the key it finds, including entries that are delete-marked and not
yet purged: the holders that let go of the key (``unique_lock`` set to NULL
leaves the old entry behind until purge). Two enqueues of a key that was just
let go both take that shared lock, then each needs an insert-intention lock on
the gap the other's shared lock covers::

    T1: S next-key on ('task/k', old id)    T2: S next-key on ('task/k', old id)
    T1: insert intention, waits for T2      T2: insert intention, waits for T1

(``SHOW ENGINE INNODB STATUS``: "lock_mode X locks gap before rec insert
intention waiting" against "lock mode S" on a record with info bits 32, both on
index ``unique_lock``). The same cycle forms when a third enqueue holding the
key rolls back while two others wait for it (MySQL's manual has this example).
No lock order prevents it: it is inside one statement of each transaction, and
a locking read at READ COMMITTED does not keep a lock on a delete-marked
entry, so nothing can serialise the two before their inserts. PostgreSQL and
SQLite are not affected (no gap locks; a second insert of a key waits for the
first transaction and then fails on the duplicate).

The database breaks the cycle by rolling one transaction back whole. When that
transaction is the enqueue's own (no ``atomic()`` of the caller around it),
:func:`retry_after` lets the backend run it again: the winner's row is then
seen, and the retry returns the holder's result. Inside the caller's
``atomic()`` their whole transaction is gone, so the error is theirs to retry
(with a note saying so). Within one bulk, unique jobs are inserted in key
order (:func:`unique_in_key_order`), so two bulks can never wait for each
other's keys in opposite orders, on any database.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import IntegrityError, OperationalError, transaction

from django_jobs.models import Job
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.enqueue")

# An insert that fails on the key and then finds no holder raced a holder that let
# go of the key in between; trying again will either insert or find the new holder.
MAX_INSERT_TRIES = 5

# Tries of one enqueue (its own transaction) that the database picks as a deadlock
# victim. Each retry finds the winner's committed row, so one retry nearly always
# settles it; more than a few in a row means something else is wrong.
MAX_DEADLOCK_TRIES = 5

MYSQL_DEADLOCK = 1213  # ER_LOCK_DEADLOCK
POSTGRESQL_DEADLOCK = "40P01"  # deadlock_detected

CALLERS_TRANSACTION_NOTE = (
    "django-jobs: the database broke a deadlock by rolling back this transaction, which "
    "enqueued inside your atomic() block: nothing of that block was saved. Run the whole "
    "block again; an enqueue of a unique task in it will not make a second job. "
    "See docs/unique.md, 'Deadlocks on MySQL and MariaDB'."
)


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


def unique_in_key_order(prepared: Sequence[tuple[Job, Any]]) -> list[int]:
    """Indexes of the unique jobs of one bulk, in key order (calls' order within a key).

    Every enqueue takes its keys in the same order, so two bulks sharing keys
    wait for one another at most, never in a cycle.
    """
    unique = [index for index, (job, _) in enumerate(prepared) if job.unique_lock is not None]
    return sorted(unique, key=lambda index: prepared[index][0].unique_lock or "")


def is_deadlock(exc: OperationalError) -> bool:
    """Whether the database rolled the transaction back to break a deadlock."""
    return error_code(exc) in (MYSQL_DEADLOCK, POSTGRESQL_DEADLOCK)


def error_code(exc: OperationalError) -> int | str | None:
    """The database's code for ``exc``: MySQL/MariaDB's error number, PostgreSQL's SQLSTATE
    (psycopg 3's ``sqlstate``, psycopg2's ``pgcode``)."""
    if exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)


def retry_after(exc: OperationalError, attempt: int, *, own_transaction: bool) -> bool:
    """Whether an enqueue that raised ``exc`` on try ``attempt`` may run again.

    Only a deadlock victim, only in its own transaction (the database rolled
    back all of it, and all of it was this enqueue), and only a few times.
    Inside the caller's transaction, ``exc`` gets a note telling them what
    happened and what to do.
    """
    if not is_deadlock(exc):
        return False
    if not own_transaction:
        exc.add_note(CALLERS_TRANSACTION_NOTE)
        return False
    if attempt >= MAX_DEADLOCK_TRIES:
        return False
    logger.info(
        "enqueue chosen as a deadlock victim (try %d of %d): enqueueing again",
        attempt,
        MAX_DEADLOCK_TRIES,
    )
    return True
