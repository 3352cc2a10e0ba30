"""Tasks for the test toolkit's tests (tests/test_testing_toolkit.py).

Each records what it did as an ``AuditEvent`` row (``key`` says what), written on the
connection the body runs on: inside a ``TestCase`` the test reads them back from its own
transaction.
"""

from __future__ import annotations

import os
import signal
import time

from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.db import DatabaseError, IntegrityError, connection, transaction

import django_jobs
from django_jobs import Snooze, enqueue_on_commit, set_progress
from django_jobs import task as jobs_task
from testproject.demo.models import AuditEvent


def note(key: str, attempt: int = 0) -> None:
    AuditEvent.objects.create(
        job_id=0, key=key, limit=0, attempt=attempt, pid=0, started=time.time()
    )


def notes() -> list[str]:
    return list(AuditEvent.objects.order_by("pk").values_list("key", flat=True))


@jobs_task
def add(a: int, b: int) -> int:
    note(f"add {a} {b}")
    return a + b


@jobs_task
async def async_add(a: int, b: int) -> int:
    """An ``async def`` body: its ORM calls run in the test's thread, on its connection."""
    await sync_to_async(note)(f"async add {a} {b}")
    return a + b


@jobs_task(queue_name="emails")
def send_email(to: str) -> str:
    note(f"email {to}")
    return to


@jobs_task(queue_name="reports")
def build_report(name: str) -> str:
    note(f"report {name}")
    return name


@jobs_task(max_attempts=3, backoff=60, takes_context=True)
def flaky(context, label: str, succeed_on: int) -> int:
    """Fails until its attempt ``succeed_on``; retried 60 s later each time."""
    attempt = context.attempt
    note(f"flaky {label} attempt {attempt}", attempt)
    if attempt < succeed_on:
        raise ValueError(f"{label}: attempt {attempt} fails")
    return attempt


@jobs_task(takes_context=True)
def snoozing(context, seconds: float) -> int:
    """Snoozes its first run for ``seconds``, then succeeds."""
    note(f"snoozing attempt {context.attempt}", context.attempt)
    if context.attempt == 1:
        raise Snooze(seconds)
    return context.attempt


@jobs_task(concurrency_key="account:{account}", concurrency_limit=1)
def keyed(account: int, label: str) -> str:
    note(f"keyed {label}")
    return label


@jobs_task
def fan_out(n: int) -> int:
    """Enqueues ``n`` jobs of ``add`` from inside a job."""
    for i in range(n):
        add.enqueue(i, 1)
    return n


@jobs_task
def forever(n: int) -> int:
    """Enqueues itself again: a test's runaway job."""
    forever.enqueue(n + 1)
    return n


@jobs_task(unique_key="sync:{account}")
def unique_sync(account: int) -> int:
    note(f"sync {account}")
    return account


@jobs_task
def enqueue_after_commit(label: str) -> str:
    """Enqueues its follow-up with ``enqueue_on_commit``, as a view would."""
    enqueue_on_commit(send_email, f"{label}@example.com")
    return label


@jobs_task(takes_context=True)
def reports_progress(context) -> str:
    """Reports progress, and notes whether the progress writer's thread (which writes on
    a connection of its own) was handed it."""
    from django_jobs.core.progress import WRITER

    set_progress(1, 3, "one")
    set_progress(3, 3, "done")
    handed = int(context.task_result.id) in WRITER.entries
    note(f"the writer thread {'has' if handed else 'does not have'} it")
    return "ok"


@jobs_task(max_attempts=1)
def breaks_a_unique_constraint(username: str) -> None:
    """Writes a row, then fails on a database constraint (on PostgreSQL the transaction
    is then unusable until rolled back)."""
    note(f"before the error {username}")
    User.objects.create(username=username)
    User.objects.create(username=username)


@jobs_task(max_attempts=1)
def fails_after_writing(label: str) -> None:
    note(f"wrote {label}")
    raise RuntimeError(f"{label} failed after writing")


@jobs_task(max_attempts=3, takes_context=True)
def cancels_itself(context) -> None:
    """Asks for its own cancel, then fails: a cancelled job is never retried."""
    django_jobs.cancel(context.task_result.id)
    raise RuntimeError("stopping after my cancel request")


@jobs_task(max_attempts=1)
def catches_a_constraint_error(username: str, guarded: bool) -> str:
    """Catches the IntegrityError of a duplicate and goes on, as code that expects it
    may: ``guarded`` with the write in an ``atomic()`` of its own, else without."""
    note(f"{username} before")
    User.objects.create(username=username)
    try:
        if guarded:
            with transaction.atomic():
                User.objects.create(username=username)
        else:
            User.objects.create(username=username)
    except IntegrityError:
        note(f"{username} caught")
    note(f"{username} after")
    return "ok"


@jobs_task(max_attempts=1)
def catches_a_raw_error(label: str) -> str:
    """A raw statement fails and the body catches it and returns: on PostgreSQL that
    aborts the transaction, elsewhere not."""
    note(f"{label} before")
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM toolkit_no_such_table")
    except DatabaseError:
        pass
    return label


@jobs_task
def durable_write(label: str) -> str:
    """Writes in a durable block, as code that must commit right there does."""
    with transaction.atomic(durable=True):
        note(f"durable {label}")
    return label


@jobs_task(max_attempts=2)
def waits_for_ctrl_c() -> None:
    """Sends its own process SIGINT, as Ctrl-C in the terminal does, and waits for the
    KeyboardInterrupt it raises in this (the main) thread."""
    note("waiting for Ctrl-C")
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError("no KeyboardInterrupt came within 10 s")


@jobs_task
def notes_on_commit(label: str) -> str:
    """Leaves its note for after the commit of the ``default`` database: with the jobs
    in a database of their own, a commit the runner does not stand in for."""
    transaction.on_commit(lambda: note(f"committed {label}"), using="default")
    return label
