"""``async def`` tasks for the event loop's tests (tests/test_async_jobs.py)."""

from __future__ import annotations

import asyncio
import time

from django.tasks import task


@task
async def wait(seconds: float) -> float:
    """Simulated I/O: an await that takes ``seconds``."""
    await asyncio.sleep(seconds)
    return seconds


@task
async def block_the_loop(seconds: float) -> str:
    """The mistake the loop monitor finds: a blocking call in an async body."""
    time.sleep(seconds)
    return "blocked"
