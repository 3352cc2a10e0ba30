"""Tasks for the shutdown-deadline tests (tests/test_shutdown_deadline.py).

Each attempt writes an ``AuditEvent`` as its body begins and stamps ``ended``
when the body returns or raises, from inside the job: the tests check the
order of bodies and outcomes from what actually ran.

A slot freed while its body still runs is a window between a commit and a
process exit; another worker has to claim the next job inside it for anyone to
notice. ``hold_while_the_body_runs`` makes that window wide every time: a
process that records a failed attempt of a job whose body is still running in
it stays alive, after the commit, until the next job of the key has started.
It changes nothing for a correct worker, which never records such an attempt.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from django_jobs import task
from django_jobs.models import FailedExecution
from testproject.demo.models import AuditEvent

# job id -> concurrency key, for the bodies running in this process right now.
RUNNING_HERE: dict[int, str] = {}
HOLD_TIMEOUT = 20.0


@contextmanager
def body(context, key: str) -> Iterator[None]:
    job_id = int(context.task_result.id)
    event = AuditEvent.objects.create(
        job_id=job_id,
        key=key,
        limit=1,
        attempt=context.attempt,
        pid=os.getpid(),
        started=time.time(),
    )
    RUNNING_HERE[job_id] = key
    try:
        yield
    finally:
        RUNNING_HERE.pop(job_id, None)
        AuditEvent.objects.filter(pk=event.pk).update(ended=time.time())


@task(takes_context=True, concurrency_key="{key}", concurrency_group="shutdown", backoff=0)
def blocked_in_c(context, key: str, seconds: float) -> int:
    """Attempt 1 blocks in one C call (``time.sleep``) that no Python exception
    interrupts; a later attempt returns at once. Returns the attempt."""
    with body(context, key):
        if context.attempt == 1:
            time.sleep(seconds)
    return context.attempt


@task(takes_context=True, concurrency_key="{key}", concurrency_group="shutdown", backoff=0)
def loops_in_python(context, key: str, seconds: float) -> int:
    """Attempt 1 runs Python for ``seconds`` (an interrupt lands between two short
    sleeps); a later attempt returns at once. Returns the attempt."""
    with body(context, key):
        deadline = time.monotonic() + (seconds if context.attempt == 1 else 0)
        while time.monotonic() < deadline:
            time.sleep(0.01)
    return context.attempt


@task(takes_context=True, concurrency_key="{key}", concurrency_group="shutdown", backoff=0)
def retries_any_error(context, key: str, seconds: float) -> int:
    """As ``loops_in_python``, inside a retry loop of its own that swallows every
    ``Exception``: the interrupt must not be one of them. Returns the attempt."""
    with body(context, key):
        deadline = time.monotonic() + (seconds if context.attempt == 1 else 0)
        while time.monotonic() < deadline:
            try:
                time.sleep(0.01)
            except Exception:
                continue
    return context.attempt


@task(takes_context=True, backoff=0)
async def awaits(context, seconds: float, finish_when_cancelled: bool = False) -> str:
    """Attempt 1 awaits ``asyncio.sleep(seconds)``; a later one returns at once.

    If the await raises ``CancelledError`` it re-raises it, or with
    ``finish_when_cancelled`` sleeps out the rest of its ``seconds`` and returns:
    a body that ends by itself, with its value, after the interrupt. Its
    ``AuditEvent`` gets ``ended`` as the body ends. Returns how it ended.
    """
    began = time.monotonic()
    event = await AuditEvent.objects.acreate(
        job_id=int(context.task_result.id),
        key="async",
        limit=1,
        attempt=context.attempt,
        pid=os.getpid(),
        started=time.time(),
    )
    outcome = "slept"
    try:
        if context.attempt == 1:
            await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        outcome = "finished after its CancelledError"
        if not finish_when_cancelled:
            raise
        await asyncio.sleep(max(0.0, seconds - (time.monotonic() - began)))
    finally:
        await AuditEvent.objects.filter(pk=event.pk).aupdate(ended=time.time())
    return outcome


@task
def runs_until(log: str, label: str, gate: str) -> str:
    """Appends ``label`` to the file ``log`` as it starts, returns once ``gate`` exists:
    a job that is running when the test stops the worker and then ends in time."""
    with open(log, "a") as f:
        f.write(f"{label}\n")
    while not os.path.exists(gate):
        time.sleep(0.01)
    return label


@task(takes_context=True, concurrency_key="{key}", concurrency_group="shutdown")
def next_holder(context, key: str) -> list[int]:
    """Returns the pids of the processes that ran an earlier body of ``key`` and
    are still alive as this one starts: [] when every one of them is gone."""
    with body(context, key):
        earlier = AuditEvent.objects.filter(key=key).exclude(job_id=int(context.task_result.id))
        return sorted({event.pid for event in earlier if process_alive(event.pid)})


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@receiver(post_save, sender=FailedExecution)
def hold_while_the_body_runs(sender, instance: FailedExecution, created: bool, using: str, **kw):
    key = RUNNING_HERE.get(instance.job_id)
    if created and key is not None:
        transaction.on_commit(lambda: wait_for_next_holder(instance.job_id, key), using=using)


def wait_for_next_holder(job_id: int, key: str) -> None:
    deadline = time.monotonic() + HOLD_TIMEOUT
    while time.monotonic() < deadline:
        if AuditEvent.objects.filter(key=key).exclude(job_id=job_id).exists():
            return
        time.sleep(0.02)
