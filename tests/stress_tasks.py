"""The stress test's task: records its own start and end in the audit table."""

from __future__ import annotations

import os
import time

from django_jobs import task
from testproject.demo.models import AuditEvent


@task(takes_context=True, concurrency_key="stress:{key}", max_attempts=3, backoff=0)
def audited(context, key: str, limit: int, duration: float, fail_attempts: int) -> int:
    attempt = context.attempt
    event = AuditEvent.objects.create(
        job_id=int(context.task_result.id),
        key=key,
        limit=limit,
        attempt=attempt,
        pid=os.getpid(),
        started=time.time(),
    )
    try:
        time.sleep(duration)
        if attempt <= fail_attempts:
            raise RuntimeError(f"planned failure of attempt {attempt}")
        return attempt
    finally:
        AuditEvent.objects.filter(pk=event.pk).update(ended=time.time())


@task(takes_context=True, concurrency_key="window:{key}", max_attempts=1)
def audited_once(context, key: str, duration: float) -> str:
    """One attempt only: a body that completed and then failed is visible in the audit."""
    event = AuditEvent.objects.create(
        job_id=int(context.task_result.id),
        key=key,
        limit=1,
        attempt=1,
        pid=os.getpid(),
        started=time.time(),
    )
    time.sleep(duration)
    AuditEvent.objects.filter(pk=event.pk).update(ended=time.time())
    return key
