"""OpenTelemetry spans for enqueue and execution, with the enqueuer's trace carried into the job.

Optional, through ``opentelemetry-api`` only (the ``otel`` extra): the project's own SDK
setup decides whether and where spans are exported. Two hooks:

- :func:`record_enqueue` (called by ``JobsBackend.prepare_job``) records a short
  ``PRODUCER`` span ``enqueue <task path>``, a child of whatever span is current (the
  request's), and stores its context in ``Job.trace_context`` as W3C propagation headers
  (``traceparent``, ``tracestate``, through the globally configured propagator);
- :func:`traced_execution` (decorating ``runtime.executor.call_task``) runs the task's
  function inside a ``CONSUMER`` span ``run <task path>`` whose parent is the context
  extracted from that row, so the job's work appears in the enqueuing request's trace,
  however much later and on whichever host it runs. Every attempt gets its own span under
  the same enqueue span; a raised exception is recorded on it with status ``ERROR``.

Spans follow OpenTelemetry's messaging conventions where they fit (one ``create`` span per
message, ``process`` spans parented to it). Without ``opentelemetry-api`` installed nothing
changes: the first hook call tries the import once, and every later one costs one global
lookup; rows get no trace context. With the API but no SDK, spans are no-ops and, outside
any trace, nothing is stored either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.tasks import Task, TaskResult

    from django_jobs.models import Job

TRACER_NAME = "django_jobs"
MESSAGING_SYSTEM = "django_jobs"

# The opentelemetry API as (trace, propagate, Context) once looked up; False when it is not
# installed; None until the first hook asks. A module global rather than a functools.cache
# so tests can reset it.
_api: Any = None


def otel_api() -> Any:
    """``(opentelemetry.trace, opentelemetry.propagate, Context)``, or False without it.

    Imported on first use, never at Django startup or module import: a project without
    OpenTelemetry pays one failed import attempt per process, and one that has it loads
    it only when it first enqueues or runs a job.
    """
    global _api
    if _api is None:
        try:
            from opentelemetry import propagate, trace
            from opentelemetry.context import Context
        except ImportError:
            _api = False
        else:
            _api = (trace, propagate, Context)
    return _api


def job_attributes(job: Job) -> dict[str, Any]:
    """Span attributes that say which job, task and queue (None values left out)."""
    attributes = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.destination.name": job.queue_name,
        "django_jobs.task": job.task_path,
        "django_jobs.queue": job.queue_name,
        "django_jobs.priority": job.priority,
        "django_jobs.backend": job.backend,
        "django_jobs.concurrency_key": job.concurrency_key,
    }
    return {name: value for name, value in attributes.items() if value is not None}


def record_enqueue(job: Job) -> None:
    """Record an enqueue span for ``job`` (not yet saved) and store its context on the job.

    The span is ended at once: it marks the message's creation, the parent every attempt's
    execution span hangs from. It is recorded before the insert, so it has no job id yet.
    """
    api = otel_api()
    if not api:
        return
    trace, propagate, _ = api
    if nothing_to_carry(trace):
        return
    span = trace.get_tracer(TRACER_NAME).start_span(
        f"enqueue {job.task_path}",
        kind=trace.SpanKind.PRODUCER,
        attributes={
            **job_attributes(job),
            "messaging.operation.type": "create",
            "messaging.operation.name": "enqueue",
        },
    )
    try:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
    finally:
        span.end()
    # Empty when there is no valid span (API without SDK, outside any trace): store NULL.
    job.trace_context = carrier or None


def nothing_to_carry(trace: Any) -> bool:
    """No SDK has set a tracer provider, and the context holds neither a valid span nor
    baggage: the span would be a no-op and the carrier would stay empty.

    The common case of a project that has ``opentelemetry-api`` (often pulled in by
    another library) and no SDK: making and propagating the no-op span was about 20 µs
    of an enqueue's 560 (PostgreSQL, ``noop.enqueue()`` in turns with and without).
    A trace propagated into the request (its context extracted from the request's
    headers, which works without an SDK) or baggage is still carried.
    """
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False
    if trace.get_current_span().get_span_context().is_valid:
        return False
    from opentelemetry import baggage

    return not baggage.get_all()


def traced_execution(
    call: Callable[[Task, Job, TaskResult], object],
) -> Callable[[Task, Job, TaskResult], object]:
    """Wrap ``call_task`` so the task's function runs in an execution span.

    The span's parent is exactly what the job's row carries (a job enqueued outside any
    trace starts a trace of its own), never whatever happens to be current in the worker
    thread. It is current while the function runs, so spans the task makes (HTTP calls,
    queries, jobs it enqueues) are its children.
    """

    @functools.wraps(call)
    def run(task: Task, job: Job, result: TaskResult) -> object:
        api = otel_api()
        if not api:
            return call(task, job, result)
        trace, propagate, Context = api
        if not job.trace_context and isinstance(
            trace.get_tracer_provider(), trace.ProxyTracerProvider
        ):
            # No SDK (yet) and no parent to carry: the span would be the invalid one,
            # and the thread's context has none of its own. A quarter of the cost of a
            # no-op job in a worker with the API installed but unused.
            return call(task, job, result)
        # Extracted into an empty context: the worker thread's own must not leak in.
        parent = propagate.extract(job.trace_context or {}, context=Context())
        with trace.get_tracer(TRACER_NAME).start_as_current_span(
            f"run {job.task_path}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes={
                **job_attributes(job),
                "messaging.operation.type": "process",
                "messaging.operation.name": "run",
                "messaging.message.id": str(job.pk),
                "django_jobs.job_id": job.pk,
                "django_jobs.attempt": job.attempts,
            },
            record_exception=True,
            set_status_on_exception=True,
        ):
            return call(task, job, result)

    return run
