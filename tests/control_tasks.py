"""Tasks for the cancel and timeout tests: they record their own start in the audit table."""

from __future__ import annotations

import os
import time
from pathlib import Path

from django_jobs import Snooze, cancel_requested, task
from testproject.demo.models import AuditEvent


def audit(context, key: str = "control") -> None:
    AuditEvent.objects.create(
        job_id=int(context.task_result.id),
        key=key,
        limit=1,
        attempt=context.attempt,
        pid=os.getpid(),
        started=time.time(),
    )


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
