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

Other tracers plug into the same two places through a :class:`TraceHook`
(:func:`add_trace_hook`; ``django_jobs.contrib.sentry`` is one): at the enqueue each adds
its own propagation headers to the same ``trace_context`` dict (a ``baggage`` header that
two of them set is merged into one, as one HTTP request would carry it), and the worker runs
the whole job, from its start to its recorded outcome, inside each hook's
:func:`execution_scope`. A hook is registered only by the code that installs it, so a
project without one pays an empty-tuple test at each enqueue and each run. Nothing a hook
raises reaches the enqueue or the job: it is logged (``django_jobs.tracing``) and that hook
is skipped for that job.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from django_jobs.text import jobs_logger

if TYPE_CHECKING:
    from django.tasks import Task, TaskResult

    from django_jobs.models import Job

TRACER_NAME = "django_jobs"
MESSAGING_SYSTEM = "django_jobs"

logger = jobs_logger("django_jobs.tracing")

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
    """Store on ``job`` (not yet saved) the propagation headers of every tracer there is:
    OpenTelemetry's (:func:`otel_headers`), then each :class:`TraceHook`'s. Left NULL
    when none has anything to carry."""
    api = otel_api()
    if not api and not _hooks:
        return  # neither OpenTelemetry nor a hook: the common case, kept at two lookups
    headers = otel_headers(job, api) if api else {}
    for hook in _hooks:
        try:
            hook.inject(job, headers)
        except Exception:
            # An enqueue never fails for its tracing: the job goes in without this hook's
            # headers, and its run starts a trace of its own.
            logger.exception("trace hook %r failed at the enqueue of %s", hook, job.task_path)
    if headers:
        job.trace_context = headers


def otel_headers(job: Job, api: Any) -> dict[str, str]:
    """Record an enqueue span for ``job`` and return its context as W3C headers (empty
    when there is nothing to carry).

    The span is ended at once: it marks the message's creation, the parent every attempt's
    execution span hangs from. It is recorded before the insert, so it has no job id yet.
    """
    trace, propagate, _ = api
    if nothing_to_carry(trace):
        return {}
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
    # Empty when there is no valid span (API without SDK, outside any trace).
    return carrier


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
    """Wrap ``call_task`` so the task's function runs in its execution span
    (:func:`execution_span`)."""

    @functools.wraps(call)
    def run(task: Task, job: Job, result: TaskResult) -> object:
        with execution_span(job):
            return call(task, job, result)

    return run


def execution_span(job: Job) -> contextlib.AbstractContextManager[object]:
    """The span a job's body runs in, current while it runs (an ``async def`` body enters
    it in its own asyncio task), or no span at all.

    The span's parent is exactly what the job's row carries (a job enqueued outside any
    trace starts a trace of its own), never whatever happens to be current in the worker
    thread. It is current while the function runs, so spans the task makes (HTTP calls,
    queries, jobs it enqueues) are its children.
    """
    api = otel_api()
    if not api:
        return NO_SCOPE
    trace, propagate, Context = api
    headers = row_headers(job)
    if not headers and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        # No SDK (yet) and no parent to carry: the span would be the invalid one,
        # and the thread's context has none of its own. A quarter of the cost of a
        # no-op job in a worker with the API installed but unused.
        return NO_SCOPE
    # Extracted into an empty context: the worker thread's own must not leak in.
    parent = propagate.extract(headers, context=Context())
    return trace.get_tracer(TRACER_NAME).start_as_current_span(
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
    )


def row_headers(job: Job) -> dict[str, str]:
    """The propagation headers in ``job``'s row, the strings of a dict only: a row edited
    by hand may hold anything (a list, numbers), and must cost its job no more than its
    trace (docs/design.md invariant 10)."""
    context = job.trace_context
    if not isinstance(context, dict):
        return {}
    return {k: v for k, v in context.items() if isinstance(k, str) and isinstance(v, str)}


class TraceHook(Protocol):
    """A tracer other than OpenTelemetry, carried through the job row the same way.

    ``inject`` adds the tracer's propagation headers to ``headers`` at the enqueue (use
    :func:`merge_baggage` for ``baggage``, which OpenTelemetry may have set already);
    ``execution`` returns the context the worker runs the job in, from before its start to
    after its outcome is recorded (``job.trace_context`` holds every tracer's headers); as
    it closes, :func:`did_not_run` says whether the job was handed back or lost instead.
    Either may raise: the enqueue and the run go on without this hook.
    """

    def inject(self, job: Job, headers: dict[str, str]) -> None: ...

    def execution(self, job: Job) -> contextlib.AbstractContextManager[object]: ...


# The registered hooks, in their order of registration. A tuple, replaced whole, so that a
# worker thread iterating it never sees it change under it.
_hooks: tuple[TraceHook, ...] = ()


def add_trace_hook(hook: TraceHook) -> None:
    """Register ``hook`` for every later enqueue and run in this process (once)."""
    global _hooks
    if hook not in _hooks:
        _hooks = (*_hooks, hook)


def remove_trace_hook(hook: TraceHook) -> None:
    global _hooks
    _hooks = tuple(registered for registered in _hooks if registered is not hook)


def merge_baggage(existing: str | None, added: str) -> str:
    """One W3C ``baggage`` header holding the members of both, a key kept once (the first
    seen): two tracers' baggage travels as one header, as in an HTTP request."""
    if not existing:
        return added
    members = [member.strip() for member in f"{existing},{added}".split(",")]
    seen: set[str] = set()
    merged = []
    for member in members:
        key = member.split("=", 1)[0].strip()
        if member and key not in seen:
            seen.add(key)
            merged.append(member)
    return ",".join(merged)


NO_SCOPE = contextlib.nullcontext()

# The job whose hook scopes are open in this thread but which did not run after all (set by
# the executor: handed back at a stop before it started, or its claim lost); None while the
# job in hand runs. Reset as each job's scopes open.
_not_run: ContextVar[int | None] = ContextVar("django_jobs_not_run", default=None)


def mark_not_run(job: Job) -> None:
    """Tell the hooks that ``job``, whose scopes are open, will not run: a hook reports no
    run of it (Sentry sends no ``queue.process`` transaction)."""
    if _hooks:
        _not_run.set(job.pk)


def did_not_run(job: Job) -> bool:
    """Whether the executor marked ``job`` as not run (:func:`mark_not_run`), for a hook
    closing its scope."""
    return job.pk is not None and _not_run.get() == job.pk


def execution_scope(job: Job) -> contextlib.AbstractContextManager[object]:
    """The context in which a worker runs ``job``: every hook's ``execution``, entered in
    order and left in reverse, none of them able to raise into the worker."""
    if not _hooks:
        return NO_SCOPE
    return HookScopes(job, _hooks)


class HookScopes:
    """The hooks' execution contexts of one job, each entered and left in isolation: one
    that raises is logged and skipped, the job runs and is recorded all the same
    (docs/design.md invariant 10)."""

    def __init__(self, job: Job, hooks: tuple[TraceHook, ...]) -> None:
        self.job = job
        self.hooks = hooks
        self.entered: list[tuple[TraceHook, contextlib.AbstractContextManager[object]]] = []

    def __enter__(self) -> None:
        _not_run.set(None)
        for hook in self.hooks:
            try:
                scope = hook.execution(self.job)
                scope.__enter__()
            except Exception:
                logger.exception("trace hook %r failed to open job %s", hook, self.job.pk)
            else:
                self.entered.append((hook, scope))

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        while self.entered:
            hook, scope = self.entered.pop()
            try:
                scope.__exit__(kind, exc, traceback)
            except Exception:
                logger.exception("trace hook %r failed to close job %s", hook, self.job.pk)
