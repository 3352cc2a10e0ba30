"""Tasks for the cancel and timeout tests: they record their own start in the audit table."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from django_jobs import Snooze, cancel_requested, task
from testproject.demo.models import AuditEvent


def audit(context, key: str = "control") -> AuditEvent:
    return AuditEvent.objects.create(
        job_id=int(context.task_result.id),
        key=key,
        limit=1,
        attempt=context.attempt,
        pid=os.getpid(),
        started=time.time(),
    )


async def audit_async(context) -> AuditEvent:
    return await AuditEvent.objects.acreate(
        job_id=int(context.task_result.id),
        key="control",
        limit=1,
        attempt=context.attempt,
        pid=os.getpid(),
        started=time.time(),
    )


async def cancelled_at(event: AuditEvent) -> None:
    """Its ``ended``: when the task's await raised CancelledError (asyncio's own stop)."""
    await AuditEvent.objects.filter(pk=event.pk).aupdate(ended=time.time())


@task(takes_context=True, max_attempts=3)
def until_cancelled(context) -> str:
    """Cooperative: checks between steps and returns when asked to stop."""
    audit(context)
    while not cancel_requested():
        time.sleep(0.01)
    return "stopped"


@task(takes_context=True, max_attempts=3)
def ignores_cancel(context, seconds: float = 60.0) -> str:
    """Uncooperative, but in Python: an interrupt lands between two sleeps."""
    audit(context)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)
    return "ran to the end"


@task(takes_context=True, max_attempts=2, timeout=0.5)
def too_slow(context) -> str:
    audit(context)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
    return "never"


@task(takes_context=True, timeout=0.5, concurrency_key="{key}", concurrency_group="stuck")
def stuck_in_c(context, key: str, seconds: float) -> None:
    """One C call that no Python exception interrupts."""
    audit(context, key)
    time.sleep(seconds)


@task(takes_context=True, concurrency_key="{key}", concurrency_group="stuck")
def after_stuck(context, key: str) -> bool:
    """Starts once its key's slot is free: True if every earlier holder's process is gone."""
    audit(context, key)
    earlier = AuditEvent.objects.filter(key=key).exclude(job_id=int(context.task_result.id))
    return all(not process_alive(event.pid) for event in earlier)


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@task(takes_context=True, max_attempts=1)
def snoozes_once(context, seconds: float) -> int:
    """Asks to run later on its first start, succeeds on its second."""
    audit(context)
    if context.attempt == 1:
        raise Snooze(seconds)
    return context.attempt


@task(takes_context=True, max_attempts=3)
async def sleeps_async(context, seconds: float = 60.0) -> str:
    """An async task in one long await; cleans up (records when) if it is cancelled."""
    event = await audit_async(context)
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await cancelled_at(event)
        raise
    return "slept"


@task(takes_context=True, max_attempts=2, timeout=1)
async def too_slow_async(context) -> str:
    event = await audit_async(context)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await cancelled_at(event)
        raise
    return "never"


@task(takes_context=True, max_attempts=3)
async def swallows_cancel(context, seconds: float = 60.0) -> str:
    """Catches CancelledError and goes on awaiting: only its process's exit stops it."""
    event = await audit_async(context)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(deadline - time.monotonic())
        except asyncio.CancelledError:
            await cancelled_at(event)
    return "ran to the end"
