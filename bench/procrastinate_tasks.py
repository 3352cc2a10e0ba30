"""No-op tasks of Procrastinate, the second peer of bench/throughput.py (PostgreSQL only).

Imported only when bench/settings.py installs Procrastinate's Django app
(``JOBS_BENCH_PROCRASTINATE=true`` on PostgreSQL): the app object they are
registered on exists only then. Both run nothing, so a drain measures only
what the queue costs per job. The async one is the bench's default, the form
Procrastinate's documentation recommends (its workers are asyncio sub-workers,
and a sync task is handed to a thread per job); the sync one is there to check
that choice (``throughput.py --procrastinate-task sync``). ``sleep_async`` is
phase "async"'s job, the same body as bench/tasks.py's.
"""

import asyncio

from procrastinate.contrib.django import app


@app.task(name="bench.procrastinate_noop_async", queue="default")
async def noop_async() -> None:
    """Nothing, on the worker's event loop."""


@app.task(name="bench.procrastinate_noop_sync", queue="default")
def noop_sync() -> None:
    """Nothing, in a thread of the worker (``sync_to_async``), like a Django view's code."""


@app.task(name="bench.procrastinate_sleep_async", queue="default")
async def sleep_async(seconds: float) -> None:
    """An I/O wait on the worker's event loop, as bench/tasks.py's ``sleep_async``."""
    await asyncio.sleep(seconds)
