"""Tasks for the batch and unique-job tests; importable by run_jobs subprocesses."""

from __future__ import annotations

import time

from django.tasks import task

from django_jobs import enqueue_batch
from django_jobs import task as jobs_task


@jobs_task(max_attempts=1)
def item(n: int, fail: bool = False, pause: float = 0.0) -> int:
    if pause:
        time.sleep(pause)
    if fail:
        raise ValueError(f"item {n} failed")
    return n


@jobs_task(max_attempts=2, backoff=0)
def flaky_item(n: int) -> int:
    raise ValueError(f"item {n} always fails")


@task
def callback(batch_id: int, succeeded: int, failed: int) -> dict[str, int]:
    return {"batch_id": batch_id, "succeeded": succeeded, "failed": failed}


@task(queue_name="reports", priority=3)
def report_callback(batch_id: int, succeeded: int, failed: int) -> int:
    return batch_id


@jobs_task(concurrency_key="batch:{batch_id}")
def keyed_callback(batch_id: int, succeeded: int, failed: int) -> int:
    return batch_id


@task
def not_a_callback(n: int) -> int:
    return n


@task
def next_stage(batch_id: int, succeeded: int, failed: int) -> int:
    """A callback that enqueues a batch of its own: batches nest this way."""
    child = enqueue_batch(
        [(item, [n], {}) for n in range(3)], on_finish=callback, description="child"
    )
    return child.id


@jobs_task(unique_key="report:{account_id}")
def unique_report(account_id: int, pause: float = 0.0) -> int:
    if pause:
        time.sleep(pause)
    return account_id


@jobs_task(unique_key="report:{account_id}", unique_until="start")
def unique_while_waiting(account_id: int) -> int:
    return account_id


@jobs_task(unique_key="sync:{n}", concurrency_key="acct:{account_id}", on_conflict="discard")
def unique_discarding(account_id: int, n: int) -> int:
    return n


@jobs_task(unique_key="retry:{account_id}", max_attempts=2, backoff=60)
def unique_flaky(account_id: int) -> int:
    raise ValueError("fails")
