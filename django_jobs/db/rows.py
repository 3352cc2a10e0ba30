"""The rows the seam's operations take and return, by name: what a caller reads is
``row.attempts``, not ``row[1]``."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple


class StartRow(NamedTuple):
    """What a start reads of a job under its claim's lock (the field names are ``Job``'s,
    so ``values_list(*StartRow._fields)`` reads one)."""

    pk: int
    attempts: int
    worker_ids: list[str] | None
    started_at: datetime | None
    unique_until: str | None
    rate_key: str | None
    rate_limit: int | None = None
    rate_period: float | None = None
    rate_reserved_at: datetime | None = None


class Started(NamedTuple):
    """A start as written: the job's new attempt count, workers and times."""

    attempts: int
    worker_ids: list[str]
    started_at: datetime
    last_attempted_at: datetime


class HeldClaim(NamedTuple):
    """A claim this process holds, locked by a finish: what the finish frees and counts."""

    job_id: int
    concurrency_key: str | None
    batch_id: int | None
    # The job's workflow, read under its row's lock: a job of one may have dependents.
    workflow_id: int | None = None


class PrunedRound(NamedTuple):
    """One round of the prune: jobs and failure rows deleted, and the latest finish time
    among those jobs (where the next round of the same status starts; None: none went)."""

    jobs: int
    failures: int
    last_finished_at: datetime | None
