"""When a worker process should make way for a fresh one.

Long-running Python processes grow: caches, fragmentation, a leak in a task's
library. ``max_jobs_per_child`` and ``max_memory_per_child`` let the supervisor
replace a worker process before that matters. The worker stops claiming, lets
its running jobs finish (no shutdown timeout: nobody is in a hurry, so no job
is cut short and re-run), writes their successes, exits with
:data:`RECYCLE_EXIT_CODE`, and the supervisor starts its replacement at once.
"""

from __future__ import annotations

import os
import time

# The exit code of a worker process that stopped to be replaced (EX_TEMPFAIL).
RECYCLE_EXIT_CODE = 75
# ... and of one that left behind a job whose body may still run: one it could not
# interrupt past its timeout or cancel (runtime/watchdog.py), or one still running
# after the interrupt at the shutdown deadline (runtime/worker.py). Its supervisor
# settles that job's claim now that the process, and so the body, is gone.
ABANDONED_EXIT_CODE = 76

# Reading /proc costs a system call: at most once per this many seconds.
MEMORY_CHECK_INTERVAL = 1.0


def resident_mb() -> float | None:
    """This process's resident memory in MB (Linux /proc), or None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


class RecyclePolicy:
    """Counts the jobs a worker process started and watches its memory."""

    def __init__(self, max_jobs: int | None, max_memory_mb: int | None) -> None:
        self.max_jobs = max_jobs
        self.max_memory_mb = max_memory_mb
        self.started = 0
        self.next_memory_check = 0.0

    def room(self, wanted: int) -> int:
        """How many of ``wanted`` jobs may still be claimed before the job limit."""
        if self.max_jobs is None:
            return wanted
        return max(0, min(wanted, self.max_jobs - self.started))

    def count(self, started: int) -> None:
        self.started += started

    def reason(self) -> str | None:
        """Why to recycle now, or None. Memory counts only once a job has run: a
        process that starts above the limit would otherwise be replaced forever
        without doing any work."""
        if self.max_jobs is not None and self.started >= self.max_jobs:
            return f"ran {self.started} jobs (max_jobs_per_child={self.max_jobs})"
        if self.max_memory_mb is None or self.started == 0:
            return None
        now = time.monotonic()
        if now < self.next_memory_check:
            return None
        self.next_memory_check = now + MEMORY_CHECK_INTERVAL
        rss = resident_mb()
        if rss is not None and rss > self.max_memory_mb:
            return (
                f"resident memory {rss:.0f} MB > max_memory_per_child={self.max_memory_mb} "
                f"after {self.started} jobs"
            )
        return None
