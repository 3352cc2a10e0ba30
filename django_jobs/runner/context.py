"""What a worker's threads share to run jobs and record their outcomes.

A module of its own so that the executor (which runs a job) and the completer
(which records successes in batches) both use it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..conf import JobsSettings
from ..models import Job
from .db_retry import retry_until_done
from .lifecycle import Lifecycle

if TYPE_CHECKING:
    from .completer import Completer
    from .watchdog import Watchdog


@dataclass
class ExecutionContext:
    db: str
    process_id: int
    worker_id: str
    lifecycle: Lifecycle
    db_retry_max_delay: float
    # The size limits of DJANGO_JOBS (conf.JobsSettings), read once per process.
    max_result_size: int = JobsSettings.max_result_size
    max_error_size: int = JobsSettings.max_error_size
    # Where successes go to be written in batches; None writes each in its own thread.
    completer: Completer | None = None
    # Enforces timeouts and cancel requests; None runs jobs unwatched (tests).
    watchdog: Watchdog | None = None


def describe(job: Job) -> str:
    return f"task={job.task_path} job={job.pk} attempt={job.attempts}"


def persist[T](ctx: ExecutionContext, what: str, action: Callable[[], T]) -> T | None:
    """Run ``action`` until it gets through a database outage, or an immediate stop
    (then None): the job ran, and losing its outcome would make recovery run it again."""
    return retry_until_done(
        ctx.db,
        what,
        action,
        give_up=ctx.lifecycle.immediate.is_set,
        max_delay=ctx.db_retry_max_delay,
    )
