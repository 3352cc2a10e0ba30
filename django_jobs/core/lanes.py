"""The two kinds of room a worker process has for jobs: threads for sync task bodies, an
event loop for ``async def`` ones (``runtime/async_lane.py``).

A job's row says which it needs (``Job.is_async``, set at enqueue from its task's function,
copied to its ready row): a claim for room of one kind takes jobs of that kind only."""

from __future__ import annotations

from enum import StrEnum


class Lane(StrEnum):
    SYNC = "sync"
    ASYNC = "async"

    @property
    def is_async(self) -> bool:
        return self is Lane.ASYNC
