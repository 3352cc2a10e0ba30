"""Example tasks for the demo: plain, retried, limited per key, deferred, async, unique, batch."""

import asyncio
import logging
import random
import time

from django.tasks import task

from django_jobs import task as jobs_task

logger = logging.getLogger("testproject.demo")


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=10)
def send_welcome_email(user_id: int) -> str:
    time.sleep(0.2)
    logger.info("sent welcome email to user %s", user_id)
    return f"sent to {user_id}"


@jobs_task(queue_name="reports", max_attempts=3, backoff=0.5)
def flaky_report(report_id: int) -> str:
    if random.random() < 0.5:
        raise ConnectionError(f"report service unavailable for report {report_id}")
    return f"report {report_id} ready"


@jobs_task(concurrency_key="account:{account_id}", concurrency_limit=1)
def sync_account(account_id: int) -> int:
    time.sleep(0.3)
    logger.info("synced account %s", account_id)
    return account_id


@task
async def fetch_status(url: str) -> dict:
    await asyncio.sleep(0.05)
    return {"url": url, "status": 200}


@jobs_task(unique_key="rebuild:{account_id}")
def rebuild_index(account_id: int) -> int:
    """Unique: enqueueing it again while one waits or runs returns the existing job."""
    time.sleep(0.2)
    return account_id


@task
def import_row(row: int) -> int:
    time.sleep(0.05)
    return row


@task
def import_done(batch_id: int, succeeded: int, failed: int) -> str:
    """The batch's on_finish callback: runs once, after the last row."""
    logger.info("batch %s done: %s imported, %s failed", batch_id, succeeded, failed)
    return f"{succeeded} imported, {failed} failed"
