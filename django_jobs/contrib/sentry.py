"""Sentry for django-jobs: a job's failed attempts as Sentry events, in the enqueuer's trace.

Listed like any other integration (the ``sentry`` extra, docs/sentry.md)::

    sentry_sdk.init(dsn=..., integrations=[DjangoJobsIntegration()])

It is never enabled by ``sentry_sdk.init`` alone: the SDK's list of integrations it turns
on by itself is its own, and a project that has not asked for these events keeps what it
had (the worker's "job failed" log line, through Sentry's logging integration). Listed, it:

- reports each failed attempt once (``job_attempt_failed``, django_jobs/signals.py), with
  the job's tags and context, and drops the log line's copy of the same failure;
- skips a cancelled job's attempt; a ``Snooze`` is not a failure and never reaches it;
- carries Sentry's ``sentry-trace`` and ``baggage`` headers from the enqueue into
  ``Job.trace_context`` and runs each job in an isolation scope of its own, in a
  ``queue.process`` transaction that continues that trace
  (django_jobs/observability/tracing.py's ``TraceHook``).

Every entry point asks the current client whether it lists the integration, as Sentry's own
integrations do: ``setup_once`` runs once per process, whatever clients come later.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sentry_sdk
from sentry_sdk.integrations import Integration
from sentry_sdk.scope import add_global_event_processor, should_send_default_pii
from sentry_sdk.utils import capture_internal_exceptions, event_from_exception

from django_jobs.exceptions import (
    JobCancelled,
    JobInterrupted,
    JobTimeout,
    TaskNotFound,
    WorkerShutdown,
)
from django_jobs.observability import tracing
from django_jobs.signals import ATTEMPT_FAILED_LOG_MARK, job_attempt_failed
from django_jobs.text import clip

if TYPE_CHECKING:
    from sentry_sdk._types import Event, Hint

    from django_jobs.core.rows import ErrorInfo
    from django_jobs.models import Job

ORIGIN = "auto.queue.django_jobs"
OP_PUBLISH = "queue.publish"
OP_PROCESS = "queue.process"
# Sentry keeps a tag's value to 200 characters; a concurrency key may have 255.
MAX_TAG_VALUE = 200

# The transaction's status for an attempt stopped by the watchdog (Sentry's span statuses).
INTERRUPTED_STATUS = {
    JobCancelled: "cancelled",
    JobTimeout: "deadline_exceeded",
    WorkerShutdown: "aborted",
}


class DjangoJobsIntegration(Integration):
    """Report failed job attempts to Sentry and carry traces through the job row."""

    identifier = "django_jobs"
    origin = ORIGIN

    @staticmethod
    def setup_once() -> None:
        tracing.add_trace_hook(SENTRY_HOOK)
        job_attempt_failed.connect(
            report_failed_attempt, weak=False, dispatch_uid="django_jobs.contrib.sentry"
        )
        add_global_event_processor(drop_logged_copy)


def enabled() -> bool:
    """Whether the current client lists the integration (checked at each use)."""
    return sentry_sdk.get_client().get_integration(DjangoJobsIntegration) is not None


class SentryHook:
    """The trace hook (``tracing.TraceHook``): Sentry's headers into the row at the
    enqueue, an isolation scope and a ``queue.process`` transaction around each run."""

    def __repr__(self) -> str:
        return "<django_jobs.contrib.sentry hook>"

    def inject(self, job: Job, headers: dict[str, str]) -> None:
        if not enabled():
            return
        if sentry_sdk.get_current_span() is None:
            carry(headers)
            return
        # Inside a transaction (a request's): the enqueue is a span of it, the run's parent.
        with sentry_sdk.start_span(op=OP_PUBLISH, name=job.task_path, origin=ORIGIN) as span:
            span.set_data("messaging.system", "django_jobs")
            span.set_data("messaging.destination.name", job.queue_name)
            carry(headers)

    @contextlib.contextmanager
    def execution(self, job: Job) -> Iterator[None]:
        if not enabled():
            yield
            return
        with sentry_sdk.isolation_scope() as scope:
            # The worker thread's own breadcrumbs (other jobs' log lines) are not this job's.
            scope.clear_breadcrumbs()
            for name, value in job_tags(job).items():
                scope.set_tag(name, value)
            scope.add_event_processor(job_event_processor(job))
            transaction = sentry_sdk.continue_trace(
                tracing.row_headers(job), op=OP_PROCESS, name=job.task_path, source="task"
            )
            transaction.origin = ORIGIN
            transaction.set_data("messaging.system", "django_jobs")
            transaction.set_data("messaging.destination.name", job.queue_name)
            transaction.set_data("messaging.message.id", str(job.pk))
            running = RUNNING.set(job.pk)
            try:
                with sentry_sdk.start_transaction(transaction):
                    yield
                    if tracing.did_not_run(job):
                        # Handed back at a stop, or its claim lost: no run to report.
                        transaction.sampled = False
                    elif transaction.status is None:
                        transaction.set_status("ok")
            finally:
                RUNNING.reset(running)


SENTRY_HOOK = SentryHook()

# The job whose run's scope (``SentryHook.execution``) this thread is in, if any: a failure
# announced outside it (a success the database refused, recorded by the completer's
# thread) is reported in a scope of its own, in the job's trace.
RUNNING: ContextVar[int | None] = ContextVar("django_jobs_sentry_running", default=None)


def carry(headers: dict[str, str]) -> None:
    """Add the current trace's ``sentry-trace`` and ``baggage`` to ``headers``."""
    traceparent = sentry_sdk.get_traceparent()
    if traceparent:
        headers["sentry-trace"] = traceparent
    baggage = sentry_sdk.get_baggage()
    if baggage:
        headers["baggage"] = tracing.merge_baggage(headers.get("baggage"), baggage)


def job_tags(job: Job) -> dict[str, str]:
    """The tags every event of a job's run gets, attempt aside (it changes at the start)."""
    tags = {
        "django_jobs.task": job.task_path,
        "django_jobs.job_id": str(job.pk),
        "django_jobs.queue": job.queue_name,
        "django_jobs.max_attempts": str(job.max_attempts),
    }
    if job.concurrency_key is not None:
        tags["django_jobs.concurrency_key"] = job.concurrency_key
    if job.workflow_id is not None:
        tags["django_jobs.workflow"] = str(job.workflow_id)
    return {name: clip(value, MAX_TAG_VALUE) for name, value in tags.items()}


def job_context(job: Job) -> dict[str, Any]:
    """The job as the ``django_jobs`` context of an event; its arguments only where the
    client may send personal data (``send_default_pii``)."""
    context: dict[str, Any] = {
        "job_id": job.pk,
        "task": job.task_path,
        "queue": job.queue_name,
        "backend": job.backend,
        "priority": job.priority,
        "attempt": job.attempts,
        "max_attempts": job.max_attempts,
        "concurrency_key": job.concurrency_key,
        "workflow_id": job.workflow_id,
        "batch_id": job.batch_id,
        "enqueued_at": job.enqueued_at,
    }
    if should_send_default_pii():
        context["args"] = job.args
        context["kwargs"] = job.kwargs
    return context


def job_event_processor(job: Job) -> Any:
    """Give every event of the job's run (the task's own captures and log errors too) its
    attempt, as counted when the event is made, and the job's context; drop the one
    Sentry's logging integration makes of Django's own line for this job's final failure
    (``django.tasks``: "Task id=... state=FAILED"), which :func:`report_failed_attempt`
    reports with its exception."""
    job_id = str(job.pk)

    def process(event: Event, hint: Hint) -> Event | None:
        record = hint.get("log_record") if hint else None
        if is_djangos_failure_line(record, job_id):
            return None
        with capture_internal_exceptions():
            event.setdefault("tags", {}).setdefault("django_jobs.attempt", str(job.attempts))
            contexts = event.setdefault("contexts", {})
            contexts.setdefault("django_jobs", job_context(job))
        return event

    return process


def is_djangos_failure_line(record: Any, job_id: str) -> bool:
    return (
        record is not None
        and record.name == "django.tasks"
        and record.levelno >= logging.ERROR
        and isinstance(record.args, tuple)
        and bool(record.args)
        and str(record.args[0]) == job_id
    )


def report_failed_attempt(
    sender: object,
    *,
    job: Job,
    exception: BaseException,
    error: ErrorInfo,
    attempt: int,
    will_retry: bool,
    retry_at: datetime | None,
    interrupted_by: type[JobInterrupted] | None,
    **kwargs: object,
) -> None:
    """The ``job_attempt_failed`` receiver: one event per failed attempt, none for a
    cancelled one."""
    client = sentry_sdk.get_client()
    if client.get_integration(DjangoJobsIntegration) is None:
        return
    transaction = sentry_sdk.get_current_scope().transaction
    if transaction is not None and transaction.op == OP_PROCESS:
        status = INTERRUPTED_STATUS.get(interrupted_by, "internal_error")  # type: ignore[arg-type]
        transaction.set_status(status)
    if interrupted_by is JobCancelled:
        return  # what someone asked for, not an error
    event, hint = event_from_exception(
        exception,
        client_options=client.options,
        mechanism={"type": DjangoJobsIntegration.identifier, "handled": False},
    )
    if interrupted_by is not None:
        name_the_interruption(event, error)
    event["level"] = "warning" if interrupted_by is WorkerShutdown and will_retry else "error"
    event["fingerprint"] = fingerprint(job, exception, interrupted_by)
    tags = event.setdefault("tags", {})
    tags.update(job_tags(job))
    tags["django_jobs.attempt"] = str(attempt)
    tags["django_jobs.will_retry"] = "true" if will_retry else "false"
    context = job_context(job)
    context.update(attempt=attempt, will_retry=will_retry, retry_at=retry_at)
    event.setdefault("contexts", {})["django_jobs"] = context
    if RUNNING.get() == job.pk:
        sentry_sdk.capture_event(event, hint=hint)
        return
    # Outside the run's scope (the completer's thread): a scope of the job's own, without
    # that thread's breadcrumbs, continuing the job's trace (no transaction is started).
    with sentry_sdk.isolation_scope() as scope:
        scope.clear_breadcrumbs()
        sentry_sdk.continue_trace(tracing.row_headers(job))
        sentry_sdk.capture_event(event, hint=hint)


def name_the_interruption(event: Event, error: ErrorInfo) -> None:
    """Title an interrupted attempt's event as recorded (``JobTimeout: timed out: still
    running after its timeout of 5s``), whatever the body raised as it was stopped (an
    async body raises ``CancelledError``); its stack still shows where it was stopped."""
    values = event.get("exception", {}).get("values") or []
    if not values:
        return
    module, _, name = error.exception_class_path.rpartition(".")
    values[-1].update(type=name, module=module, value=error.message)


def fingerprint(
    job: Job, exception: BaseException, interrupted_by: type[JobInterrupted] | None
) -> list[str]:
    """How failures group into issues (docs/sentry.md, "Grouping").

    Sentry's own grouping (the exception's type and its stack), split by task: the
    attempts of a job that fail the same way are one issue, and two tasks that raise the
    same error through shared code, or through ours (a return value that cannot be stored),
    are two. An interruption is about the task, not where its body happened to be when it
    was stopped: one issue per task and kind. So is a task that cannot be imported.
    """
    if interrupted_by is not None:
        return ["django_jobs", interrupted_by.__name__, job.task_path]
    if isinstance(exception, TaskNotFound):
        return ["django_jobs", "TaskNotFound", job.task_path]
    return ["{{ default }}", "django_jobs", job.task_path]


def drop_logged_copy(event: Event, hint: Hint) -> Event | None:
    """Drop the event Sentry's logging integration makes of the worker's "job failed" line
    (an ERROR record without the exception): the failure is reported by
    :func:`report_failed_attempt`, or skipped on purpose (a cancel)."""
    record = hint.get("log_record") if hint else None
    if record is not None and hasattr(record, ATTEMPT_FAILED_LOG_MARK) and enabled():
        return None
    return event
