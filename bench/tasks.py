"""No-op tasks for bench/throughput.py: each job costs only what the queue itself costs.

``noop``, ``noop_keyed`` and ``noop_rated`` run on django-jobs (the ``default`` backend);
``peer_noop`` runs on django-tasks-db (the ``peer`` backend of
bench/settings.py). They are separate functions because a task is found again
by its function's dotted path, which must name the ``Task`` of the right backend.
``sleep_async`` and ``noop_async`` are phase "async"'s: ``async def`` bodies, which a
worker runs on its event loop (issue 39).
"""

import asyncio

from django.tasks import task as django_task

from django_jobs import task


@task
def noop() -> None:
    """Nothing: a job of ours with no concurrency key."""


@task(concurrency_key="{key}", concurrency_limit=1)
def noop_keyed(key: int) -> None:
    """Nothing, one at a time per ``key``: admission, blocking and promotion are the cost."""


@task(rate_limit="10000/s", rate_key="{key}")
def noop_rated(key: int) -> None:
    """Nothing, under a rate limit that never binds: the cost of the start that checks
    it (the key's row locked, its window read and written) and nothing else."""


@task
async def sleep_async(seconds: float) -> None:
    """An I/O wait and nothing else: what an async job spends its time on (an HTTP call,
    a query on an async driver), without the noise of a real server at the other end."""
    await asyncio.sleep(seconds)


@task
async def noop_async() -> None:
    """Nothing, on the event loop: the latency probe of phase "async"."""


@django_task(backend="peer")
def peer_noop() -> None:
    """Nothing: a job of django-tasks-db."""
