"""A sync and an ``async def`` task of each shape the lane tests need (tests/test_lanes.py).

Each pair differs in its kind alone, so a test parametrized over the two proves that the
kind (``Job.is_async``, migration 0022) is what follows the job, whatever else it carries.
The options a path needs (a key, retries, a delay) are given with ``.using(...)``.
"""

from __future__ import annotations

from django.tasks import task

from django_jobs import task as jobs_task
from tests.progress_tasks import wait_for


@jobs_task
def sync_echo(value: object = None) -> object:
    return value


@jobs_task
async def async_echo(value: object = None) -> object:
    return value


@task
def sync_callback(batch_id: int, succeeded: int, failed: int) -> int:
    return batch_id


@task
async def async_callback(batch_id: int, succeeded: int, failed: int) -> int:
    return batch_id


# By kind: whether the task is ``async def``.
ECHO = {False: sync_echo, True: async_echo}
CALLBACK = {False: sync_callback, True: async_callback}


@jobs_task
def sync_hold(gate: str, most: float = 60.0) -> bool:
    """Hold a thread until the file ``gate`` exists: True once released; a job that waited
    ``most`` seconds fails (``progress_tasks.wait_for``'s TimeoutError)."""
    wait_for(gate, most)
    return True
