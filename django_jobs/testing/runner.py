"""``run_enqueued_jobs()``: the jobs that are due, run in the test's own process and on
its own database connection, through the state machine a worker uses.

Each job goes the way ``run_jobs`` takes it, one at a time, in claim order: claimed
(``core.ready.claim_jobs``, which starts it where a worker's claim would), started
(``core.starting.start_jobs``, for a rate-limited or ``unique_until="start"`` job),
its body run by the executor's own functions (``runtime.executor.run_watched``), its
success finished (``core.claimed.finish_jobs``, which frees its key's slot, releases
its dependents and counts its batch) or its failure or snooze recorded
(``runtime.executor.settle_failure``). What that makes due (a retry due at once, the
next blocked job of a key, a dependent, a batch callback, a job enqueued by a job) is
run in the same call, until nothing due is left. Each step is committed as far as the
test allows (``testing.transactions``).

What a worker has and this has not: threads (one job at a time, so a concurrency
limit is never reached by two jobs running at once here), the watchdog (a job's
``timeout`` is not enforced and a cancel request does not reach a running body), and
the dispatcher (promotion of due jobs is done here, each round, and only for the
queues asked for). A database error is raised to the test, never ridden out: a test
waiting for its database to come back would hang.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from functools import reduce
from operator import or_

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count, Q
from django.tasks.signals import task_started
from django.utils import timezone

from django_jobs.conf import database_alias, jobs_settings
from django_jobs.core.claimed import fail_job, finish_jobs
from django_jobs.core.operator import CANCELLED_ERROR
from django_jobs.core.processes import deregister_process, register_process
from django_jobs.core.progress import held_reports
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.db.notify import silenced
from django_jobs.exceptions import ResultNotStored, TaskNotFound
from django_jobs.models import (
    WAITING_STATUSES,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    ScheduledExecution,
)
from django_jobs.runtime.completer import announce
from django_jobs.runtime.context import ExecutionContext, Success, error_info
from django_jobs.runtime.executor import fail_unloadable, run_watched, settle_failure
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.tasks.loading import load_task
from django_jobs.tasks.results import build_result
from django_jobs.testing.errors import RunawayJobs
from django_jobs.testing.readiness import require_jobs_backend, require_jobs_tables
from django_jobs.testing.report import ErrorRecord, JobRun, Outcome, RunReport
from django_jobs.testing.transactions import run_body, step
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.testing")

# Jobs one call runs at most without a ``limit``: past it, jobs still due are taken for
# a job that enqueues another forever (RunawayJobs), not waited for.
DEFAULT_MAX_RUNS = 1000

# Scheduled rows promoted per statement.
PROMOTE_BATCH = 100


def run_enqueued_jobs(
    *,
    queue: str | Iterable[str] | None = None,
    limit: int | None = None,
    now: datetime | None = None,
    run_scheduled: bool = False,
    max_runs: int = DEFAULT_MAX_RUNS,
    using: str | None = None,
) -> RunReport:
    """Run the jobs that are due, and those they make due, until none is left.

    :param queue: the queue to run jobs of, or several (a list, tried in its order, as
        ``run_jobs --queues``); ``"prefix*"`` patterns and ``"*"`` as there. Default:
        every queue. Jobs of other queues are left as they are, due or not.
    :param limit: run at most this many jobs, then return, leaving the rest waiting.
    :param now: time travel: also run the jobs scheduled at or before this (aware)
        datetime: ``run_after``, a retry's backoff, a snooze. The clock itself does not
        move: the jobs run now, and what they schedule is scheduled from now.
    :param run_scheduled: run every scheduled job, whenever it is due; a failing job is
        then retried at once, whatever its backoff, until its attempts are used up.
        Not with ``now``.
    :param max_runs: without ``limit``, the most jobs one call runs: if jobs are still
        due after that many, :class:`~django_jobs.testing.RunawayJobs` is raised,
        naming their tasks (most likely a job that enqueues another forever).
    :param using: the database alias the jobs are in. Default: the jobs database
        (``DJANGO_JOBS["database"]``, else ``"default"``).
    :returns: a :class:`~django_jobs.testing.RunReport` of what ran, in run order.
    :raises ~django_jobs.testing.JobsNotReady: the database has no jobs tables, or no
        backend of ``TASKS`` writes jobs to it.
    """
    patterns = queue_patterns(queue)
    check_count("limit", limit, minimum=0)
    check_count("max_runs", max_runs, minimum=1)
    due_by = travel_to(now, run_scheduled)
    db = using or database_alias()
    require_jobs_tables(db)
    require_jobs_backend(db)
    report = RunReport()
    with silenced():
        with step(db):
            process = register_process(db, Process.Kind.WORKER, metadata={"testing": True})
        try:
            runner = Runner(db, process, QueueSelector(patterns), due_by, report)
            runner.run_until_done(limit, max_runs)
        finally:
            let_go(db, process)
    return report


# ``due_by`` meaning "every scheduled job, whenever it is due".
EVERY_SCHEDULED = "every scheduled"


def travel_to(now: datetime | None, run_scheduled: bool) -> datetime | str | None:
    """The time jobs must be due by to run: None for the real clock (read each round),
    a datetime, or :data:`EVERY_SCHEDULED`."""
    if run_scheduled:
        if now is not None:
            raise ValueError("run_enqueued_jobs(): pass now= or run_scheduled=True, not both")
        return EVERY_SCHEDULED
    if now is None:
        return None
    if not isinstance(now, datetime):
        raise TypeError(f"run_enqueued_jobs(): now must be a datetime, not {type(now).__name__}")
    if settings.USE_TZ and timezone.is_naive(now):
        raise ValueError(
            "run_enqueued_jobs(): now must be an aware datetime with USE_TZ = True "
            "(e.g. timezone.now() + timedelta(hours=1))"
        )
    return now


def queue_patterns(queue: str | Iterable[str] | None) -> tuple[str, ...]:
    if queue is None:
        return ("*",)
    patterns = (queue,) if isinstance(queue, str) else tuple(queue)
    if not patterns:
        raise ValueError("run_enqueued_jobs(): queue= names no queue")
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(
                f"run_enqueued_jobs(): queue= takes queue names (str), got {pattern!r}"
            )
    return patterns


def check_count(name: str, value: int | None, *, minimum: int) -> None:
    if value is None and name == "limit":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"run_enqueued_jobs(): {name} must be an int, not {value!r}")
    if value < minimum:
        raise ValueError(f"run_enqueued_jobs(): {name} must be at least {minimum}, not {value}")


def let_go(db: str, process: Process) -> None:
    """Remove this call's process row, settling any claim left (a run cut short by an
    error of ours: recovery records it as a failed attempt, as it would for a dead
    worker). Never raises over the error that cut the run short."""
    try:
        with step(db):
            left = deregister_process(db, process.pk, "run_enqueued_jobs() stopped")
    except Exception:
        logger.exception("could not remove the process row of run_enqueued_jobs()")
        return
    if left:
        logger.warning("run_enqueued_jobs() left job(s) %s claimed; recovered", sorted(left))


class Runner:
    """One call's loop: promote what is due, claim one job, run it, record its run."""

    def __init__(
        self,
        db: str,
        process: Process,
        selector: QueueSelector,
        due_by: datetime | str | None,
        report: RunReport,
    ) -> None:
        self.db = db
        self.process = process
        self.selector = selector
        self.due_by = due_by
        self.report = report
        conf = jobs_settings()
        lifecycle = Lifecycle()
        # A database error is given up on at once (executor's ``persist``), not waited out.
        lifecycle.immediate.set()
        self.ctx = ExecutionContext(
            db,
            process.pk,
            process.name,
            lifecycle,
            db_retry_max_delay=0.0,
            max_result_size=conf.max_result_size,
            max_error_size=conf.max_error_size,
        )

    def run_until_done(self, limit: int | None, max_runs: int) -> None:
        claims = 0
        while limit is None or len(self.report) < limit:
            self.promote_due()
            # A claim sent back by its rate limit runs nothing, and counts here too.
            if limit is None and claims >= max_runs:
                self.refuse_runaway(max_runs)
                return
            with step(self.db):
                claimed = claim_jobs(
                    self.db, self.process.pk, self.selector, 1, worker_id=self.process.name
                )
            if not claimed:
                return
            claims += 1
            self.run(claimed[0])

    # --- what is due -----------------------------------------------------------------

    def queue_condition(self) -> Q:
        if "*" in self.selector.patterns:
            return Q()
        return reduce(or_, self.selector.conditions())

    def promote_due(self) -> None:
        """Admit the scheduled jobs of our queues that are due by ``due_by``; a job sent
        back by its rate limit only once its planned start has passed by the real clock
        (the start decides its rate by that clock, and would send it back again)."""
        while True:
            real_now = timezone.now()
            rows = ScheduledExecution.objects.using(self.db).filter(self.queue_condition())
            if self.due_by is None:
                rows = rows.filter(scheduled_at__lte=real_now)
            elif isinstance(self.due_by, datetime):
                rows = rows.filter(scheduled_at__lte=max(self.due_by, real_now))
            rows = rows.exclude(job__rate_reserved_at__isnull=False, scheduled_at__gt=real_now)
            due = list(
                rows.order_by("scheduled_at", "-priority", "job_id").values_list(
                    "job_id", "scheduled_at"
                )[:PROMOTE_BATCH]
            )
            if not due:
                return
            with step(self.db):
                moved = promote_jobs(
                    self.db, [job_id for job_id, _ in due], due_by=max(at for _, at in due)
                )
            if not moved:
                return

    def refuse_runaway(self, max_runs: int) -> None:
        """Raise :class:`RunawayJobs` if jobs are still due after ``max_runs`` claims."""
        paused = Pause.objects.using(self.db).values_list("queue_name", flat=True)
        due = dict(
            ReadyExecution.objects.using(self.db)
            .filter(self.queue_condition())
            .exclude(queue_name__in=paused)
            .values_list("job__task_path")
            .annotate(n=Count("pk"))
            .order_by("-n")
            .values_list("job__task_path", "n")[:5]
        )
        if not due:
            return
        most = Counter(run.task_path for run in self.report.runs).most_common(5)
        raise RunawayJobs(
            f"run_enqueued_jobs() ran {len(self.report)} job(s), its max_runs of {max_runs}, "
            f"and jobs are still due: {', '.join(f'{path} ({n} due)' for path, n in due.items())}. "
            f"A job that enqueues another forever? Ran most: "
            f"{', '.join(f'{path} x{n}' for path, n in most) or 'none'}. Pass a larger "
            f"max_runs= if the work is that long, or limit= to run only so many.",
            self.report,
        )

    # --- one job ---------------------------------------------------------------------

    def run(self, job: Job) -> None:
        """Run one claimed job to its outcome, and add its run to the report."""
        failures_before = FailedExecution.objects.using(self.db).filter(job_id=job.pk).count()
        try:
            task = load_task(job.task_path)
        except TaskNotFound as exc:
            with step(self.db):
                fail_unloadable(job, self.ctx, exc)
            self.record(job, failures_before)
            return
        if job.status != JobStatus.RUNNING:
            with step(self.db):
                started = start_jobs(self.db, [job], self.process.pk, self.process.name)
            if not started:
                if job.status == JobStatus.SCHEDULED:  # over its rate: waits, no attempt
                    self.report.rate_limited.append(job.pk)
                return
        result = build_result(job, task=task)
        task_started.send(type(task.get_backend()), task_result=result)
        began = time.monotonic()
        held = held_reports.set(True)
        try:
            value = run_body(self.db, lambda: run_watched(task, job, result, self.ctx, None))
        except BaseException as exc:  # as a worker: whatever the task raised is its outcome
            with step(self.db):
                settle_failure(job, task, result, self.ctx, None, exc, time.monotonic() - began)
        else:
            self.finish(Success(job, task, result, value, time.monotonic() - began))
        finally:
            held_reports.reset(held)
        self.record(job, failures_before)

    def finish(self, success: Success) -> None:
        """Record a success as the completer does; one the database refuses fails the
        job, unretried (``ResultNotStored``), as the completer's ``write_isolated``."""
        job = success.job
        try:
            with step(self.db):
                done = finish_jobs(self.db, self.process.pk, {job.pk: success.value}, [job])
        except DatabaseError as exc:
            refusal = ResultNotStored(
                f"the database refused to record this job's success "
                f"({type(exc).__name__}: {exc})"
            )
            with step(self.db):
                fail_job(
                    self.db,
                    job.pk,
                    self.process.pk,
                    error_info(refusal, self.ctx.max_error_size),
                    worker_id=self.process.name,
                    retry=False,
                )
            return
        if job.pk in done:
            announce(success)

    def record(self, job: Job, failures_before: int) -> None:
        row = Job.objects.using(self.db).get(pk=job.pk)
        failures = list(
            FailedExecution.objects.using(self.db)
            .filter(job_id=job.pk)
            .order_by("pk")[failures_before:]
        )
        failure = failures[-1] if failures else None
        error = (
            None
            if failure is None
            else ErrorRecord(failure.exception_class_path, failure.message, failure.traceback)
        )
        if row.status == JobStatus.SUCCEEDED:
            outcome = Outcome.SUCCEEDED
        elif row.status in (JobStatus.FAILED, JobStatus.DISCARDED):
            cancelled = row.cancel_requested_at is not None or (
                failure is not None and failure.exception_class_path == CANCELLED_ERROR
            )
            outcome = Outcome.CANCELLED if cancelled else Outcome.FAILED
        elif row.status in WAITING_STATUSES:
            outcome = Outcome.WILL_RETRY if failure is not None else Outcome.SNOOZED
        else:
            raise RuntimeError(
                f"job #{job.pk} ({job.task_path}) is still {row.status}: its outcome could "
                f"not be recorded (the log says why)"
            )
        next_run_at = None
        if outcome in (Outcome.WILL_RETRY, Outcome.SNOOZED):
            next_run_at = (
                ScheduledExecution.objects.using(self.db)
                .filter(job_id=job.pk)
                .values_list("scheduled_at", flat=True)
                .first()
            )
        self.report.runs.append(
            JobRun(
                job_id=job.pk,
                task_path=row.task_path,
                args=row.args,
                kwargs=row.kwargs,
                queue_name=row.queue_name,
                attempt=row.attempts,
                outcome=outcome,
                return_value=row.return_value if outcome == Outcome.SUCCEEDED else None,
                error=error,
                next_run_at=next_run_at,
            )
        )
