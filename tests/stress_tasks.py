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
