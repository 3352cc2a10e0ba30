"""Tasks for the progress tests: they report progress, then wait for the test's go."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from django_jobs import cancel_requested, set_progress, task


def wait_for(gate: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {gate} within {timeout}s")
        time.sleep(0.01)


@task
def reports_steps(gate: str) -> str:
    """Step 1 reported, then waits for ``gate``; then three reports in a row and returns:
    the last two come within the interval of the one before them."""
    set_progress(1, 4, "step 1: downloading")
    wait_for(gate)
    set_progress(2, 4, "step 2: converting")
    set_progress(3, 4, "step 3: uploading")
    set_progress(4, 4, "done")
    return "ok"


@task
async def reports_from_async(gate: str) -> str:
    """An ``async def`` task: set_progress does no I/O of its own, so it is called as is."""
    set_progress(5, message="rows imported")
    while not Path(gate).exists():
        await asyncio.sleep(0.01)
    set_progress(7, message="rows imported")
    return "ok"


@task(takes_context=True, max_attempts=3)
def reports_until_cancelled(context, gate: str) -> str:
    """Counts rows of 200 until asked to stop, reporting each; stops cooperatively, once
    ``gate`` exists too (the test holds it running while it looks at the cancel pending)."""
    row = 0
    while not cancel_requested():
        row = min(row + 1, 199)
        set_progress(row, 200, f"row {row} of 200")
        time.sleep(0.02)
    while not Path(gate).exists():
        time.sleep(0.01)
    return f"stopped at row {row}"
