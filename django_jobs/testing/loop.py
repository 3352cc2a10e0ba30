"""The loop of ``run_enqueued_jobs()`` (``testing/runner.py``): promote what is due,
claim one job, run it through the executor's own functions, record its run.

Imports the models: loaded by ``run_enqueued_jobs()`` once it has checked that the app is
installed and its tables exist.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime
from functools import reduce
from operator import or_

from django.db import DatabaseError
from django.db.models import Count, Q
from django.tasks.signals import task_started
from django.utils import timezone

from django_jobs.conf import jobs_settings
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
from django_jobs.testing.report import ROLLED_BACK_HELP, ErrorRecord, JobRun, Outcome, RunReport
from django_jobs.testing.transactions import run_body, step
from django_jobs.text import clip, jobs_logger, safe_str

logger = jobs_logger("django_jobs.testing")

# Scheduled rows promoted per statement.
PROMOTE_BATCH = 100


def run_due(
    db: str,
    patterns: tuple[str, ...],
    due_by: datetime | str | None,
    limit: int | None,
    max_runs: int,
) -> RunReport:
    """``run_enqueued_jobs()`` once its arguments and the database are checked: one
    process row for the call, the loop, the row removed."""
    report = RunReport()
    with silenced():
        with step(db):
            process = register_process(db, Process.Kind.WORKER, metadata={"testing": True})
        try:
            Runner(db, process, QueueSelector(patterns), due_by, report).run_until_done(
                limit, max_runs
            )
        finally:
            let_go(db, process)
    return report


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
        sent_back = len(self.report.rate_limited)
        claims = f", {sent_back} claim(s) sent back by a rate limit" if sent_back else ""
        still = ", ".join(f"{path} ({n} due)" for path, n in due.items())
        ran = ", ".join(f"{path} x{n}" for path, n in most) or "none"
        raise RunawayJobs(
            f"run_enqueued_jobs() reached its max_runs of {max_runs} ({len(self.report)} job(s) "
            f"run{claims}) and jobs are still due: {still}. A job that enqueues another "
            f"forever? Ran most: {ran}. Pass a larger "
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
                # The claim may have started it (counted its attempt), as a worker's does.
                claim_started = job.status == JobStatus.RUNNING
                fail_unloadable(job, self.ctx, exc, started=claim_started)
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
            end = run_body(self.db, lambda: run_watched(task, job, result, self.ctx, None))
            if end.rolled_back:
                logger.warning(
                    "job %s (%s): its body's writes were rolled back: %s. %s",
                    job.pk,
                    job.task_path,
                    end.rolled_back,
                    ROLLED_BACK_HELP,
                )
            if end.raised is not None:
                # As a worker: whatever the task raised is its outcome (a failed attempt,
                # retried while attempts remain, or a snooze).
                with step(self.db):
                    settle_failure(
                        job, task, result, self.ctx, None, end.raised, time.monotonic() - began
                    )
            else:
                self.finish(Success(job, task, result, end.value, time.monotonic() - began))
        finally:
            held_reports.reset(held)
        self.record(job, failures_before, end.rolled_back)
        if isinstance(end.raised, KeyboardInterrupt):
            # Ctrl-C in the body: recorded as the failed attempt a worker's stop
            # deadline makes of a body it interrupts, then the test is let go.
            raise end.raised

    def finish(self, success: Success) -> None:
        """Record a success as the completer does; one the database refuses fails the
        job, unretried (``ResultNotStored``), as the completer's ``write_isolated``."""
        job = success.job
        try:
            with step(self.db):
                done = finish_jobs(self.db, self.process.pk, {job.pk: success.value}, [job])
        except DatabaseError as exc:
            refusal = ResultNotStored(
                f"the database refused to record this job's success ({type(exc).__name__}: "
                f"{clip(safe_str(exc), 500)})"
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

    def record(self, job: Job, failures_before: int, rolled_back: str | None = None) -> None:
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
                rolled_back=rolled_back,
            )
        )
