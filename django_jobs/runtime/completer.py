"""Recording successes in batches: one finish transaction for every job that ended meanwhile.

A job's outcome costs a transaction (lock the claim, delete it, update the
job, free the key's slot). Written by the job's own thread, that is one
transaction per job and a thread that cannot take the next job until it
commits. Here the threads hand their successes to one completer thread and go
back to work; it writes whatever has piled up while its previous transaction
ran, so batches grow with the load and an idle worker adds no delay.

The worker counts unwritten successes against its claims (see
``Worker.idle_threads``): running jobs and unwritten successes together never
pass ``2 x threads``, the most a SIGKILL can turn from done into a failed
attempt (docs/design.md invariant 8, docs/running.md).

Exactly-once holds because :func:`~django_jobs.core.claimed.finish_jobs` finalises
only the claims this process still holds, under their locks. A crash before
the batch commits leaves those jobs running under a dead process's claims:
recovery counts them as failed attempts and retries them, as it would a job
whose own finish transaction never committed. A graceful stop flushes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import close_old_connections
from django.tasks import TaskResultStatus
from django.tasks.signals import task_finished

from django_jobs.core.claimed import finish_jobs
from django_jobs.db.retry import reset_connection
from django_jobs.exceptions import ResultNotStored
from django_jobs.runtime.context import (
    ExecutionContext,
    Success,
    announce_failure,
    describe,
    error_info,
    fail_or_stop,
    persist,
)
from django_jobs.signals import ATTEMPT_FAILED_LOG_MARK
from django_jobs.text import clip, jobs_logger, safe_str

logger = jobs_logger("django_jobs.worker")


class Completer:
    """A thread that finalises the successes of one worker process's jobs in batches."""

    def __init__(self, ctx: ExecutionContext, on_written: Callable[[], None]) -> None:
        self.ctx = ctx
        self.on_written = on_written
        self.changed = threading.Condition()
        self.queue: list[Success] = []
        # Jobs handed over and not yet written: their claims are still ours, and no
        # thread runs them (the worker must not mistake them for orphans).
        self.pending: set[int] = set()
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="django-jobs-completer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, success: Success) -> None:
        with self.changed:
            self.queue.append(success)
            self.pending.add(success.job.pk)
            self.changed.notify()

    def pending_ids(self) -> set[int]:
        with self.changed:
            return set(self.pending)

    def stop(self, timeout: float | None = None) -> None:
        """Write what is queued, then end the thread."""
        with self.changed:
            self.stopping = True
            self.changed.notify()
        self.thread.join(timeout)

    def run(self) -> None:
        try:
            while True:
                with self.changed:
                    while not self.queue and not self.stopping:
                        self.changed.wait()
                    if not self.queue:
                        return
                    batch, self.queue = self.queue, []
                self.write(batch)
        except BaseException:
            # Not one job's doing (those are settled in write_isolated): a bug of ours.
            # Without this thread no success of this process is ever recorded again.
            logger.exception("the completer stopped")
            self.ctx.lifecycle.request_broken("the completer thread stopped")
        finally:
            close_old_connections()

    def write(self, batch: list[Success]) -> None:
        try:
            write_isolated(self.ctx, batch)
        finally:
            with self.changed:
                self.pending.difference_update(success.job.pk for success in batch)
            self.on_written()


def write_isolated(ctx: ExecutionContext, batch: list[Success]) -> None:
    """:func:`write_successes`, with a batch the database refuses split in halves until
    only the job it refuses is left, which is then failed (``ResultNotStored``).

    Values are checked in the jobs' own threads (``json_return_value``), so this is
    the net for what no check foresaw: one job's row must not stop the others'
    finishes, nor this thread (docs/design.md, invariant 10).
    """
    try:
        write_successes(ctx, batch)
        return
    except Exception as exc:
        reset_connection(ctx.db)  # whatever state the refused statement left it in
        if len(batch) > 1:
            logger.warning(
                "a finish of %d jobs was refused (%s: %s); writing it in halves",
                len(batch),
                type(exc).__name__,
                clip(safe_str(exc), 300),
            )
            middle = len(batch) // 2
            write_isolated(ctx, batch[:middle])
            write_isolated(ctx, batch[middle:])
            return
        refused = exc
    (success,) = batch
    job = success.job
    refusal = ResultNotStored(
        f"the database refused to record this job's success ({type(refused).__name__}: "
        f"{clip(safe_str(refused), 500)})"
    )
    # Marked as the executor's "job failed" line is: a receiver that reports the failure
    # (Sentry's) drops the log line's copy of it.
    logger.error("job %s: %s", job.pk, refusal, extra={ATTEMPT_FAILED_LOG_MARK: job.pk})
    error = error_info(refusal, ctx.max_error_size)
    outcome = fail_or_stop(ctx, job.pk, error, retry=False)
    if outcome is not None:
        # Announced as the executor announces a failure, once it is recorded, but from
        # this thread: the job's own has left the job's tracing scopes.
        announce_failure(job, refusal, error, job.attempts, outcome, None)


def write_successes(ctx: ExecutionContext, batch: list[Success]) -> None:
    """Finalise ``batch`` in one transaction (riding out outages), then log and signal
    each success recorded. Also the whole finish of a worker without a completer."""
    values = {success.job.pk: success.value for success in batch}
    # The jobs as the worker knows them (batch, concurrency key): where the database can,
    # those without a batch are finished in one statement.
    known = [success.job for success in batch]
    done = persist(
        ctx,
        f"finishing job{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}",
        lambda: finish_jobs(ctx.db, ctx.process_id, values, known),
    )
    if done is None:
        logger.error(
            "stopping now: the success of job(s) %s was not recorded; recovery will "
            "count each as a failed attempt",
            ", ".join(str(pk) for pk in values),
        )
        return
    for success in batch:
        if success.job.pk not in done:
            logger.warning(
                "job %s finished but its claim was already settled elsewhere", success.job.pk
            )
            continue
        announce(success)


def announce(success: Success) -> None:
    """Log the success and send ``task_finished``; a receiver that raises is logged, not
    let loose in the thread that records every other job's success."""
    job, result = success.job, success.result
    logger.info("job finished %s duration=%.3fs", describe(job), success.duration)
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "_return_value", success.value)
    try:
        task_finished.send(type(success.task.get_backend()), task_result=result)
    except Exception:
        logger.exception("job %s: a task_finished receiver raised", job.pk)
