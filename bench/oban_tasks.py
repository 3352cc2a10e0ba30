"""The no-op worker of Oban for Python, the third peer of bench/throughput.py (PostgreSQL only).

Oban runs a job by awaiting its worker's ``process()`` on the event loop of
its ``oban start`` process (uvloop), up to the queue's limit at once; a sync
function can only be wrapped by ``@job``, which calls it on that loop too. So
the worker is async, as its documentation writes every example, and does
nothing: a drain measures only what the queue costs per job. Imported by the
harness (to build jobs) and by each worker process (``oban start
--cron-modules bench.oban_tasks``), where the job's ``worker`` column,
``bench.oban_tasks.Noop``, resolves to it. ``Sleep`` is phase "async"'s job, the same
body as bench/tasks.py's ``sleep_async``.
"""

import asyncio

from oban import Job, worker


@worker(queue="default")
class Noop:
    """Nothing, on the worker's event loop."""

    async def process(self, job: object) -> None:
        return None


@worker(queue="default")
class Sleep:
    """An I/O wait on the worker's event loop, as bench/tasks.py's ``sleep_async``."""

    async def process(self, job: Job) -> None:
        await asyncio.sleep(job.args["seconds"])
