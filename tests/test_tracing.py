"""OpenTelemetry: the enqueuing request's trace carried through the job row into its run.

Spans are recorded by the SDK's in-memory exporter (the ``otel-test`` extra) from real
enqueues and real runs through the executor, in this process, on the database under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.tasks import task

from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.models import Job, JobStatus
from django_jobs.observability import tracing
from django_jobs.runtime.context import ExecutionContext
from django_jobs.runtime.executor import execute_job
from django_jobs.runtime.lifecycle import Lifecycle
from tests import tasks

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

# transaction=True: the executor closes obsolete connections, as a worker thread must.
pytestmark = pytest.mark.django_db(transaction=True)


class GatedExporter(InMemorySpanExporter):
    """Keeps spans only while a test of this module records: the global provider can be
    set once per process, and the rest of the suite must not fill memory with spans."""

    recording = False

    def export(self, spans):  # type: ignore[no-untyped-def]
        return super().export(spans) if self.recording else super().export([])


EXPORTER = GatedExporter()


@pytest.fixture(scope="module", autouse=True)
def tracer_provider():
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    assert isinstance(trace.get_tracer_provider(), TracerProvider)


@pytest.fixture
def spans(monkeypatch):
    monkeypatch.setattr(tracing, "_api", None)  # looked up afresh, with the SDK there
    EXPORTER.clear()
    EXPORTER.recording = True
    yield EXPORTER
    EXPORTER.recording = False
    EXPORTER.clear()


@pytest.fixture
def run_next():
    """Claim the next ready job and run it through the executor, as a worker thread does."""
    worker = register_process("default", "worker")
    ctx = ExecutionContext("default", worker.pk, worker.name, Lifecycle(), 1.0)

    def run() -> Job:
        (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
        execute_job(job, ctx)
        return Job.objects.get(pk=job.pk)

    return run


def w3c_traceparent(span: ReadableSpan) -> str:
    """The ``traceparent`` header naming ``span``: version-trace id-span id-flags."""
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def named(recorded: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in recorded.get_finished_spans() if span.name == name]


def test_the_run_span_continues_the_enqueuing_requests_trace(spans, run_next):
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("GET /checkout") as request:
        result = tasks.add.enqueue(2, 3)
    request_context = request.get_span_context()

    # Run under an unrelated span: the parent must come from the row, not the thread.
    with tracer.start_as_current_span("unrelated"):
        job = run_next()
    assert job.status == JobStatus.SUCCEEDED

    (enqueue,) = named(spans, "enqueue tests.tasks.add")
    (run,) = named(spans, "run tests.tasks.add")
    assert enqueue.kind == SpanKind.PRODUCER and run.kind == SpanKind.CONSUMER
    assert enqueue.parent.span_id == request_context.span_id
    assert run.context.trace_id == request_context.trace_id
    assert run.parent.trace_id == request_context.trace_id
    assert run.parent.span_id == enqueue.context.span_id
    assert run.parent.is_remote  # extracted from the row
    # The row carries the enqueue span's context as a W3C traceparent header.
    traceparent = job.trace_context["traceparent"]
    assert traceparent == w3c_traceparent(enqueue)
    assert enqueue.context.trace_id == request_context.trace_id
    assert run.attributes["django_jobs.job_id"] == int(result.id)
    assert run.attributes["messaging.message.id"] == result.id
    assert run.attributes["django_jobs.attempt"] == 1
    assert run.attributes["django_jobs.task"] == "tests.tasks.add"
    assert run.attributes["messaging.destination.name"] == "default"
    assert enqueue.attributes["django_jobs.queue"] == "default"
    assert run.status.status_code == StatusCode.UNSET


def test_each_attempt_is_a_span_under_the_same_enqueue_and_errors_are_recorded(spans, run_next):
    with trace.get_tracer("tests").start_as_current_span("request") as request:
        tasks.always_fails.enqueue("no luck")  # 3 attempts, backoff 0
    for _ in range(3):
        job = run_next()
        promote_due_jobs("default", 10)  # the retry, due at once, made ready
    assert (job.status, job.attempts) == (JobStatus.FAILED, 3)

    (enqueue,) = named(spans, "enqueue tests.tasks.always_fails")
    runs = named(spans, "run tests.tasks.always_fails")
    assert [run.attributes["django_jobs.attempt"] for run in runs] == [1, 2, 3]
    for run in runs:
        assert run.context.trace_id == request.get_span_context().trace_id
        assert run.parent.span_id == enqueue.context.span_id
        assert run.status.status_code == StatusCode.ERROR
        (event,) = [event for event in run.events if event.name == "exception"]
        assert event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == "no luck"


def test_a_job_enqueued_outside_any_trace_gets_a_trace_of_its_own(spans, run_next):
    tasks.add.enqueue(1, 1)
    run_next()
    (enqueue,) = named(spans, "enqueue tests.tasks.add")
    (run,) = named(spans, "run tests.tasks.add")
    assert enqueue.parent is None
    assert run.parent.span_id == enqueue.context.span_id


@task
def make_a_child_span() -> str:
    with trace.get_tracer("tests").start_as_current_span("inside the task"):
        return "done"


@task
async def make_a_child_span_async() -> str:
    with trace.get_tracer("tests").start_as_current_span("inside the task"):
        return "done"


@pytest.mark.parametrize("body", [make_a_child_span, make_a_child_span_async])
def test_spans_the_task_makes_are_children_of_its_run_span(spans, run_next, body):
    body.enqueue()
    assert run_next().return_value == "done"
    (run,) = named(spans, f"run {body.module_path}")
    (inside,) = named(spans, "inside the task")
    assert inside.parent.span_id == run.context.span_id


def test_jobs_enqueued_in_bulk_each_get_their_own_enqueue_span(spans):
    from django.tasks import default_task_backend

    with trace.get_tracer("tests").start_as_current_span("request") as request:
        results = default_task_backend.bulk_enqueue([(tasks.add, (n, n), {}) for n in range(3)])
    contexts = [Job.objects.get(pk=r.id).trace_context["traceparent"] for r in results]
    enqueues = named(spans, "enqueue tests.tasks.add")
    assert len(enqueues) == 3
    assert sorted(contexts) == sorted(w3c_traceparent(span) for span in enqueues)
    assert {span.context.trace_id for span in enqueues} == {request.get_span_context().trace_id}


def test_without_opentelemetry_nothing_is_stored_and_no_span_is_made(spans, run_next, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import fails, as uninstalled
    monkeypatch.setattr(tracing, "_api", None)
    result = tasks.add.enqueue(4, 5)
    job = run_next()
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, 9)
    assert Job.objects.get(pk=result.id).trace_context is None
    assert tracing._api is False
    assert spans.get_finished_spans() == ()


def test_importing_the_backend_and_worker_imports_no_opentelemetry():
    code = (
        "import sys, django; django.setup(); "
        "import django_jobs.backend, django_jobs.runtime.executor, django_jobs.tracing; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


API_ONLY = """
import json, django
django.setup()
from opentelemetry import baggage, context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from django_jobs.models import Job
from django_jobs.observability import tracing

assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # no SDK

def carried():
    job = Job(task_path="tests.tasks.add", queue_name="default", backend="default")
    tracing.record_enqueue(job)
    return job.trace_context

outside = carried()
parent = SpanContext(
    trace_id=0x1234, span_id=0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
)
with trace.use_span(NonRecordingSpan(parent)):
    propagated = carried()
token = context.attach(baggage.set_baggage("tenant", "t1"))
with_baggage = carried()
context.detach(token)
print(json.dumps([outside, propagated, with_baggage]))
"""


def test_with_the_api_alone_a_propagated_trace_or_baggage_is_carried_and_nothing_else():
    """No SDK (a subprocess: this one has a provider set): outside any trace nothing is
    stored, but a trace that reached the request through its headers, or baggage, is."""
    done = subprocess.run(
        [sys.executable, "-c", API_ONLY], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    outside, propagated, with_baggage = json.loads(done.stdout)
    assert outside is None
    assert propagated == {"traceparent": f"00-{0x1234:032x}-{0x5678:016x}-01"}
    assert with_baggage == {"baggage": "tenant=t1"}
