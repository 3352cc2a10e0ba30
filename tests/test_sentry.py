"""Sentry (``django_jobs.contrib.sentry``): failed attempts reported once each, with the
job's tags, grouped by task; cancels and snoozes not reported; the enqueuer's trace
continued by the run; nothing a receiver or Sentry itself does reaches the job.

Nothing is sent: Sentry's client is given a transport that keeps its envelopes in memory
(as sentry-sdk's own tests do), with a DSN nobody answers. Jobs run through the real
executor in this process, and in a real ``run_jobs`` process whose settings
(testproject/sentry_settings.py) initialise Sentry with a transport writing to a file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.db import connections
from django.tasks import task
from django.tasks.signals import task_finished

from django_jobs import Snooze, cancel
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.exceptions import ResultNotStored
from django_jobs.models import FailedExecution, Job, JobStatus
from django_jobs.observability import tracing
from django_jobs.runtime.completer import write_isolated
from django_jobs.runtime.context import ExecutionContext, Success
from django_jobs.runtime.executor import execute_job
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.watchdog import Watchdog
from django_jobs.signals import job_attempt_failed
from django_jobs.tasks.results import build_result
from testproject.demo.models import AuditEvent
from tests import control_tasks, tasks
from tests.harness import wait_until

sentry_sdk = pytest.importorskip("sentry_sdk")

from sentry_sdk.integrations.logging import LoggingIntegration  # noqa: E402
from sentry_sdk.transport import Transport  # noqa: E402

from django_jobs.contrib.sentry import SENTRY_HOOK, DjangoJobsIntegration  # noqa: E402

# transaction=True: the executor closes obsolete connections, as a worker thread must.
# What reaches Sentry is the same on every database: tox runs this module in one database's
# environment (pyproject.toml, marker one_database).
pytestmark = [pytest.mark.one_database, pytest.mark.django_db(transaction=True)]

DSN = "https://public@sentry.invalid/1"


class MemoryTransport(Transport):
    """Keeps every envelope the client would have sent."""

    def __init__(self, options=None):  # type: ignore[no-untyped-def]
        super().__init__(options)
        self.envelopes = []

    def capture_envelope(self, envelope):  # type: ignore[no-untyped-def]
        self.envelopes.append(envelope)

    def flush(self, timeout, callback=None):  # type: ignore[no-untyped-def]
        pass

    def items(self, kind: str) -> list[dict]:
        return [
            item.payload.json
            for envelope in self.envelopes
            for item in envelope.items
            if item.type == kind
        ]

    def events(self) -> list[dict]:
        return self.items("event")

    def transactions(self) -> list[dict]:
        return self.items("transaction")


@pytest.fixture(autouse=True)
def sentry_alone(monkeypatch):
    """Sentry without OpenTelemetry, as most projects run it. tests/test_tracing.py sets
    OpenTelemetry's SDK for the whole process (a tracer provider is set once, never
    unset): run before these on the same pytest worker, its headers filled the rows these
    tests expect empty. A test of the two together sets its own."""
    monkeypatch.setattr(tracing, "_api", False)


@pytest.fixture
def sentry():
    """A Sentry client with the integration (and the logging one), for one test."""
    transport = MemoryTransport()
    sentry_sdk.init(
        dsn=DSN,
        transport=transport,
        integrations=[DjangoJobsIntegration(), LoggingIntegration()],
        default_integrations=False,
        traces_sample_rate=1.0,
    )
    yield transport
    uninitialise()


def uninitialise() -> None:
    sentry_sdk.get_client().close()
    sentry_sdk.get_global_scope().set_client(None)


@pytest.fixture
def worker_ctx():
    worker = register_process("default", "worker")
    return ExecutionContext("default", worker.pk, worker.name, Lifecycle(), 1.0)


@pytest.fixture
def run_next(worker_ctx):
    """Claim the next ready job and run it through the executor, as a worker thread does."""

    def run() -> Job:
        (job,) = claim_jobs("default", worker_ctx.process_id, QueueSelector(("*",)), 1)
        execute_job(job, worker_ctx)
        return Job.objects.get(pk=job.pk)

    return run


@pytest.fixture
def watched(worker_ctx):
    """A running watchdog on the worker's context: timeouts and cancels enforced."""
    watchdog = Watchdog("default", grace=0.2, on_stuck=lambda job_id: None, poll_interval=0.05)
    watchdog.start()
    worker_ctx.watchdog = watchdog
    yield worker_ctx
    watchdog.stop()
    watchdog.thread.join(5)


def shared_helper(message: str) -> None:
    raise ValueError(message)


@task
def fails_in_the_helper() -> None:
    shared_helper("bad input")


@task
def also_fails_in_the_helper() -> None:
    shared_helper("bad input")


@task
def snoozes() -> None:
    raise Snooze(3600)


@task
def captures_and_tags(label: str) -> str:
    sentry_sdk.set_tag("left.by", label)
    sentry_sdk.capture_message(f"inside {label}")
    return label


def test_each_failed_attempt_is_one_event_with_the_jobs_tags_grouped_by_task(sentry, run_next):
    result = tasks.always_fails.using(concurrency_key="tenant-7").enqueue("no luck")
    for _ in range(3):
        job = run_next()
        promote_due_jobs("default", 10)  # the retry (backoff 0) made ready
    assert (job.status, job.attempts) == (JobStatus.FAILED, 3)

    events = sentry.events()
    assert len(events) == 3  # the logging integration's copies of "job failed" dropped
    for attempt, event in enumerate(events, 1):
        assert event["tags"] == {
            "django_jobs.task": "tests.tasks.always_fails",
            "django_jobs.job_id": result.id,
            "django_jobs.queue": "default",
            "django_jobs.attempt": str(attempt),
            "django_jobs.max_attempts": "3",
            "django_jobs.concurrency_key": "tests.tasks.always_fails/tenant-7",
            "django_jobs.will_retry": "true" if attempt < 3 else "false",
        }
        context = event["contexts"]["django_jobs"]
        assert (context["job_id"], context["attempt"]) == (int(result.id), attempt)
        assert context["will_retry"] is (attempt < 3)
        assert "args" not in context  # send_default_pii is off
        assert event["level"] == "error"
        (exception,) = event["exception"]["values"]
        assert (exception["type"], exception["value"]) == ("ValueError", "no luck")
        assert exception["mechanism"] == {"type": "django_jobs", "handled": False}
        assert event["transaction"] == "tests.tasks.always_fails"
        assert event["fingerprint"] == ["{{ default }}", "django_jobs", "tests.tasks.always_fails"]
    # The last one is the final failure: nothing scheduled after it.
    assert events[2]["contexts"]["django_jobs"]["retry_at"] is None
    assert events[0]["contexts"]["django_jobs"]["retry_at"] is not None
    # Each attempt is a queue.process transaction, failed.
    runs = [t for t in sentry.transactions() if t["transaction"] == "tests.tasks.always_fails"]
    assert [run["contexts"]["trace"]["op"] for run in runs] == ["queue.process"] * 3
    assert [run["contexts"]["trace"]["status"] for run in runs] == ["internal_error"] * 3
    assert runs[0]["contexts"]["trace"]["data"]["messaging.message.id"] == result.id


def test_two_tasks_failing_the_same_way_through_shared_code_are_two_issues(sentry, run_next):
    fails_in_the_helper.enqueue()
    also_fails_in_the_helper.enqueue()
    run_next(), run_next()
    first, second = sentry.events()
    assert first["exception"]["values"][0]["type"] == second["exception"]["values"][0]["type"]
    assert first["fingerprint"] != second["fingerprint"]
    assert first["fingerprint"][-1] == fails_in_the_helper.module_path
    assert second["fingerprint"][-1] == also_fails_in_the_helper.module_path


def test_a_snooze_is_no_event(sentry, run_next):
    snoozes.enqueue()
    job = run_next()
    assert job.status == JobStatus.SCHEDULED
    assert sentry.events() == []
    (run,) = sentry.transactions()
    assert run["contexts"]["trace"]["status"] == "ok"


def test_a_cancelled_job_is_no_event(sentry, watched):
    result = control_tasks.until_cancelled.enqueue()
    (job,) = claim_jobs("default", watched.process_id, QueueSelector(("*",)), 1)
    runner = threading.Thread(target=execute_job, args=(job, watched))
    runner.start()
    wait_until(lambda: AuditEvent.objects.filter(job_id=job.pk).exists(), what="its start")
    assert cancel(result.id) == "requested"
    runner.join(30)
    assert not runner.is_alive()
    job.refresh_from_db()
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
    failure = FailedExecution.objects.get(job_id=job.pk)
    assert failure.exception_class_path == "django_jobs.exceptions.JobCancelled"
    assert sentry.events() == []
    (run,) = sentry.transactions()
    assert run["contexts"]["trace"]["status"] == "cancelled"


def test_a_timeout_is_an_event_named_for_it_grouped_by_task(sentry, watched):
    control_tasks.too_slow.enqueue()  # timeout 0.5s, 2 attempts
    (job,) = claim_jobs("default", watched.process_id, QueueSelector(("*",)), 1)
    execute_job(job, watched)
    job.refresh_from_db()
    assert (job.status, job.attempts) == (JobStatus.SCHEDULED, 1)  # its retry, after backoff
    (event,) = sentry.events()
    exception = event["exception"]["values"][-1]
    assert (exception["module"], exception["type"]) == ("django_jobs.exceptions", "JobTimeout")
    assert exception["value"].startswith("timed out: still running after its timeout of 0.5s")
    # Its stack shows where the body was when it was stopped.
    assert "too_slow" in [frame["function"] for frame in exception["stacktrace"]["frames"]]
    assert event["fingerprint"] == ["django_jobs", "JobTimeout", "tests.control_tasks.too_slow"]
    assert event["tags"]["django_jobs.will_retry"] == "true"
    assert event["level"] == "error"
    (run,) = sentry.transactions()
    assert run["contexts"]["trace"]["status"] == "deadline_exceeded"


def test_a_task_that_cannot_be_imported_is_one_issue_per_task_path(sentry, run_next):
    tasks.add.enqueue(1, 2)
    Job.objects.update(task_path="tests.tasks.gone_in_the_last_deploy")
    job = run_next()
    assert (job.status, job.attempts) == (JobStatus.FAILED, 0)
    (event,) = sentry.events()
    assert event["exception"]["values"][-1]["type"] == "TaskNotFound"
    assert event["fingerprint"] == [
        "django_jobs",
        "TaskNotFound",
        "tests.tasks.gone_in_the_last_deploy",
    ]
    assert event["tags"]["django_jobs.attempt"] == "1"
    assert event["tags"]["django_jobs.will_retry"] == "false"


def test_the_run_continues_the_trace_of_the_span_active_at_the_enqueue(sentry, run_next):
    with sentry_sdk.start_transaction(op="http.server", name="GET /checkout") as request:
        result = tasks.always_fails.using(max_attempts=1).enqueue("in a request")
    # Run under an unrelated transaction: the trace must come from the row.
    with sentry_sdk.start_transaction(op="task", name="unrelated"):
        run_next()

    carried = Job.objects.get(pk=result.id).trace_context
    assert carried["sentry-trace"].startswith(f"{request.trace_id}-")
    assert f"sentry-trace_id={request.trace_id}" in carried["baggage"]
    (event,) = sentry.events()
    assert event["contexts"]["trace"]["trace_id"] == request.trace_id
    (run,) = [t for t in sentry.transactions() if t["transaction"] == "tests.tasks.always_fails"]
    assert run["contexts"]["trace"]["trace_id"] == request.trace_id
    # Its parent is the enqueue's queue.publish span, a child of the request.
    (checkout,) = [t for t in sentry.transactions() if t["transaction"] == "GET /checkout"]
    (publish,) = [span for span in checkout["spans"] if span["op"] == "queue.publish"]
    assert publish["description"] == "tests.tasks.always_fails"
    assert run["contexts"]["trace"]["parent_span_id"] == publish["span_id"]


def test_sentry_and_opentelemetry_headers_share_the_row(sentry, monkeypatch):
    """With OpenTelemetry's headers already there (as its hook writes them first), Sentry's
    are added, and the two baggage lists become one header."""
    monkeypatch.setattr(
        tracing,
        "otel_headers",
        lambda job, api: {
            "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
            "baggage": "tenant=t1",
        },
    )
    monkeypatch.setattr(tracing, "_api", ("trace", "propagate", "Context"))
    with sentry_sdk.start_transaction(name="request") as request:
        result = tasks.add.enqueue(1, 1)
    carried = Job.objects.get(pk=result.id).trace_context
    assert carried["traceparent"] == "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    assert carried["sentry-trace"].startswith(request.trace_id)
    members = carried["baggage"].split(",")
    assert members[0] == "tenant=t1"
    assert f"sentry-trace_id={request.trace_id}" in members


def test_each_job_runs_in_its_own_scope(sentry, run_next):
    captures_and_tags.enqueue("first")
    captures_and_tags.enqueue("second")
    first_job, second_job = run_next(), run_next()
    first, second = sentry.events()
    assert first["tags"]["left.by"] == "first" and second["tags"]["left.by"] == "second"
    assert first["tags"]["django_jobs.job_id"] == str(first_job.pk)
    assert second["tags"]["django_jobs.job_id"] == str(second_job.pk)
    assert first["tags"]["django_jobs.attempt"] == "1"
    # Nothing of a job is left on the thread that ran it.
    assert "left.by" not in sentry_sdk.get_isolation_scope()._tags
    assert "django_jobs.job_id" not in sentry_sdk.get_current_scope()._tags


@pytest.mark.parametrize("hostile", [["not", "a", "dict"], {"sentry-trace": 7}, "text"])
def test_a_row_with_a_hostile_trace_context_still_runs_and_reports(sentry, run_next, hostile):
    tasks.always_fails.using(max_attempts=1).enqueue("its own error")
    Job.objects.update(trace_context=hostile)
    job = run_next()
    assert job.status == JobStatus.FAILED
    # The task's own error, not one of reading the row's trace (OpenTelemetry's or ours).
    failure = FailedExecution.objects.get(job_id=job.pk)
    assert (failure.exception_class_path, failure.message) == (
        "builtins.ValueError",
        "its own error",
    )
    (event,) = sentry.events()
    assert event["tags"]["django_jobs.job_id"] == str(job.pk)
    assert event["exception"]["values"][-1]["value"] == "its own error"


@pytest.fixture
def raising_receiver():
    def receiver(sender, **kwargs):
        raise RuntimeError("the error tracker is down")

    job_attempt_failed.connect(receiver)
    yield receiver
    job_attempt_failed.disconnect(receiver)


def test_a_receiver_that_raises_is_logged_and_changes_nothing(
    sentry, run_next, raising_receiver, caplog
):
    caplog.set_level(logging.ERROR, logger="django_jobs.worker")
    tasks.always_fails.using(max_attempts=1).enqueue("first")
    job = run_next()
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)  # recorded
    assert FailedExecution.objects.filter(job_id=job.pk).count() == 1
    (line,) = [r for r in caplog.records if "job_attempt_failed receiver" in r.getMessage()]
    assert "RuntimeError: the error tracker is down" in line.getMessage()
    # The other receiver, Sentry's, still ran; our log line of the raising one is an
    # event too (through Sentry's logging integration, as Django's own line about it).
    reported = [e for e in sentry.events() if "exception" in e and e.get("logger") is None]
    assert [e["exception"]["values"][-1]["value"] for e in reported] == ["first"]
    # The worker goes on: the next job runs and succeeds.
    tasks.add.enqueue(2, 2)
    assert run_next().status == JobStatus.SUCCEEDED


@pytest.fixture
def exiting_receiver():
    """A receiver that ends its thread the way ``sys.exit()`` would, which ``send_robust``
    does not catch."""

    def receiver(sender, **kwargs):
        raise SystemExit(3)

    job_attempt_failed.connect(receiver)
    yield receiver
    job_attempt_failed.disconnect(receiver)


def test_a_receiver_that_raises_system_exit_is_logged_and_ends_neither_the_thread_nor_the_job(
    exiting_receiver, worker_ctx, caplog
):
    """Run in a thread of its own, as a worker's: the failure is recorded, task_finished
    still sent, and the same thread runs the next job."""
    caplog.set_level(logging.ERROR, logger="django_jobs.worker")
    finished: list[str] = []

    def on_finished(sender, task_result, **kwargs):
        finished.append(task_result.status)

    task_finished.connect(on_finished)
    tasks.always_fails.using(max_attempts=1).enqueue("first")
    tasks.add.enqueue(2, 2)
    ran: list[Job] = []

    def worker_thread() -> None:
        try:
            for _ in range(2):
                (job,) = claim_jobs("default", worker_ctx.process_id, QueueSelector(("*",)), 1)
                execute_job(job, worker_ctx)
                ran.append(Job.objects.get(pk=job.pk))
        finally:
            connections.close_all()  # this thread's, before the test database is dropped

    try:
        thread = threading.Thread(target=worker_thread)
        thread.start()
        thread.join(60)
    finally:
        task_finished.disconnect(on_finished)
    assert [job.status for job in ran] == [JobStatus.FAILED, JobStatus.SUCCEEDED]
    assert finished == ["FAILED", "SUCCESSFUL"]
    (line,) = [r for r in caplog.records if "could not be sent to every receiver" in r.getMessage()]
    assert line.exc_info is not None and line.exc_info[0] is SystemExit


def test_a_success_the_database_refuses_is_reported_once_in_the_jobs_trace(sentry, worker_ctx):
    """The completer's net (``write_isolated``): the job fails with ``ResultNotStored``,
    announced from the completer's thread, outside the run's scope; one event, with the
    job's tags, in the enqueuer's trace; the log line's copy dropped."""
    announced: list[dict] = []

    def receiver(sender, **kwargs):
        announced.append(kwargs)

    job_attempt_failed.connect(receiver)
    with sentry_sdk.start_transaction(name="request") as request:
        result = tasks.add.enqueue(1, 2)
    (job,) = claim_jobs(
        "default", worker_ctx.process_id, QueueSelector(("*",)), 1, worker_id=worker_ctx.worker_id
    )
    too_deep: list = []
    for _ in range(3000):  # refused in Python by the finish, on every database
        too_deep = [too_deep]
    success = Success(job, tasks.add, build_result(job), too_deep, 0.0)

    def completer_thread() -> None:
        try:
            write_isolated(worker_ctx, [success])
        finally:
            connections.close_all()

    try:
        completer = threading.Thread(target=completer_thread)
        completer.start()
        completer.join(60)
    finally:
        job_attempt_failed.disconnect(receiver)

    assert Job.objects.get(pk=result.id).status == JobStatus.FAILED
    (call,) = announced
    assert isinstance(call["exception"], ResultNotStored)
    assert (call["attempt"], call["will_retry"], call["interrupted_by"]) == (1, False, None)
    assert call["error"].exception_class_path == "django_jobs.exceptions.ResultNotStored"
    (event,) = sentry.events()
    (exception,) = event["exception"]["values"]
    assert exception["type"] == "ResultNotStored"
    assert exception["value"].startswith("the database refused to record this job's success")
    assert event["tags"]["django_jobs.job_id"] == result.id
    assert event["tags"]["django_jobs.will_retry"] == "false"
    assert event["contexts"]["trace"]["trace_id"] == request.trace_id
    assert event["fingerprint"] == ["{{ default }}", "django_jobs", "tests.tasks.add"]


def test_a_job_that_does_not_run_after_all_sends_no_transaction(sentry, worker_ctx):
    """Handed back at a stop before it started, or its claim lost: no ``queue.process``
    transaction says it ran (and ran "ok")."""
    tasks.add.enqueue(1, 1)
    tasks.add.enqueue(2, 2)
    (handed_back,) = claim_jobs("default", worker_ctx.process_id, QueueSelector(("*",)), 1)
    stopping = ExecutionContext(
        "default", worker_ctx.process_id, worker_ctx.worker_id, Lifecycle(), 1.0
    )
    stopping.lifecycle.stopping.set()
    execute_job(handed_back, stopping)
    assert Job.objects.get(pk=handed_back.pk).status == JobStatus.READY

    other = register_process("default", "worker")
    (lost,) = claim_jobs("default", other.pk, QueueSelector(("*",)), 1)
    # Run by a process that does not hold its claim: the start finds none.
    execute_job(lost, worker_ctx)
    assert Job.objects.get(pk=lost.pk).status == JobStatus.CLAIMED
    assert sentry.transactions() == []

    # The thread's next job that runs has its transaction, ok.
    (job,) = claim_jobs("default", worker_ctx.process_id, QueueSelector(("*",)), 1)
    assert job.pk != lost.pk
    execute_job(job, worker_ctx)
    (run,) = sentry.transactions()
    assert run["contexts"]["trace"]["status"] == "ok"
    assert run["contexts"]["trace"]["data"]["messaging.message.id"] == str(job.pk)


def test_sentry_failing_inside_the_run_costs_the_job_nothing(sentry, run_next, monkeypatch, caplog):
    """The hook's scope cannot open (Sentry raising in continue_trace): logged, and the
    job runs and is recorded as without Sentry."""

    def broken(*args, **kwargs):
        raise RuntimeError("sentry broke")

    monkeypatch.setattr(sentry_sdk, "continue_trace", broken)
    monkeypatch.setattr(sentry_sdk, "get_traceparent", broken)
    result = tasks.add.enqueue(20, 22)  # the enqueue goes through too
    job = run_next()
    assert (job.status, job.return_value) == (JobStatus.SUCCEEDED, 42)
    assert Job.objects.get(pk=result.id).trace_context is None
    messages = [r.getMessage() for r in caplog.records if r.name == "django_jobs.tracing"]
    assert any("failed at the enqueue of tests.tasks.add" in m for m in messages)
    assert any(f"failed to open job {job.pk}" in m for m in messages)


def test_without_a_client_nothing_is_reported_or_stored(run_next, caplog):
    """The integration set up by an earlier client of this process, none now: its hook
    and receiver are registered and do nothing."""
    sentry_sdk.init(dsn=DSN, transport=MemoryTransport(), integrations=[DjangoJobsIntegration()])
    uninitialise()
    assert SENTRY_HOOK in tracing._hooks
    caplog.set_level(logging.WARNING, logger="django_jobs")
    result = tasks.always_fails.using(max_attempts=1).enqueue()
    job = run_next()
    assert job.status == JobStatus.FAILED
    assert Job.objects.get(pk=result.id).trace_context is None
    assert not [r for r in caplog.records if r.name == "django_jobs.tracing"]
    assert not [r for r in caplog.records if "receiver" in r.getMessage()]


def test_with_a_client_that_does_not_list_it_nothing_is_reported(run_next):
    transport = MemoryTransport()
    sentry_sdk.init(dsn=DSN, transport=transport, default_integrations=False)
    try:
        result = tasks.always_fails.using(max_attempts=1).enqueue()
        assert run_next().status == JobStatus.FAILED
        assert Job.objects.get(pk=result.id).trace_context is None
        assert transport.events() == []
    finally:
        uninitialise()


WITHOUT_SENTRY = """
import sys
sys.modules["sentry_sdk"] = None  # as if not installed
import django
django.setup()
import django_jobs.backend, django_jobs.runtime.executor, django_jobs.signals
from django_jobs.observability import tracing
try:
    import django_jobs.contrib.sentry
except ImportError:
    print("contrib: ImportError")
print("hooks:", len(tracing._hooks))
print("loaded:", sorted(m for m in sys.modules if m.startswith("sentry_sdk") and sys.modules[m]))
"""


def test_without_sentry_sdk_the_package_imports_and_registers_nothing():
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_SENTRY],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["contrib: ImportError", "hooks: 0", "loaded: []"]


# --- a real run_jobs process ---------------------------------------------------------


def read_sentry_file(path: Path) -> list[dict]:
    """The items the processes' transport wrote so far. Read under a shared lock: each
    writer appends its lines under an exclusive one (testproject/sentry_settings.py), so a
    line being written is never read half (a JSON error, seen in CI)."""
    if not path.exists():
        return []
    with path.open() as events:
        fcntl.flock(events, fcntl.LOCK_SH)
        text = events.read()
    return [json.loads(line) for line in text.splitlines() if line]


def events_of(items: list[dict], kind: str = "event") -> list[dict]:
    return [item["payload"] for item in items if item["type"] == kind]


@pytest.mark.workers
def test_a_run_jobs_process_reports_its_jobs_failures(sentry, run_jobs, tmp_path):
    """Settings that initialise Sentry (testproject/sentry_settings.py), as a project's
    would: every failed attempt of the worker's jobs is one event in the enqueuer's trace,
    the cancelled and snoozed ones none."""
    with sentry_sdk.start_transaction(op="http.server", name="POST /orders") as request:
        failing = tasks.always_fails.enqueue("from the worker")  # 3 attempts
        slow = control_tasks.too_slow.enqueue()  # timeout 0.5s, 2 attempts
        snoozed = control_tasks.snoozes_once.enqueue(0.1)
        cancelled = control_tasks.until_cancelled.enqueue()
        ok = tasks.add.enqueue(1, 2)
    path = tmp_path / "sentry.jsonl"
    proc = run_jobs(
        "--processes",
        "1",
        "--threads",
        "4",
        env={
            "DJANGO_SETTINGS_MODULE": "testproject.sentry_settings",
            "JOBS_SENTRY_EVENTS": str(path),
            "JOBS_INTERRUPT_GRACE": "0.5",
        },
    )
    wait_until(
        lambda: AuditEvent.objects.filter(job_id=int(cancelled.id)).exists(),
        30,
        what=f"the cancelled job's start; run_jobs said:\n{proc.output()}",
    )
    assert cancel(cancelled.id) == "requested"
    ended = {JobStatus.FAILED, JobStatus.SUCCEEDED}
    ids = [int(r.id) for r in (failing, slow, snoozed, cancelled, ok)]
    wait_until(
        lambda: set(Job.objects.filter(pk__in=ids).values_list("status", flat=True)) <= ended,
        60,
        what=f"every job ended; run_jobs said:\n{proc.output()}",
    )
    # Five failed attempts: three of one job, two timeouts; the cancel and snooze none.
    wait_until(lambda: len(events_of(read_sentry_file(path))) >= 5, 30, what="five events")
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0
    items = read_sentry_file(path)
    events = events_of(items)
    by_job = {}
    for event in events:
        by_job.setdefault(event["tags"]["django_jobs.job_id"], []).append(event)
    assert sorted(by_job) == sorted([failing.id, slow.id]), [e["tags"] for e in events]
    # In attempt order: a retry due at once may run, in another thread, before the
    # thread of the attempt before it has sent its event.
    attempts = sorted(by_job[failing.id], key=lambda e: e["tags"]["django_jobs.attempt"])
    assert [
        (e["tags"]["django_jobs.attempt"], e["tags"]["django_jobs.will_retry"]) for e in attempts
    ] == [
        ("1", "true"),
        ("2", "true"),
        ("3", "false"),
    ]
    assert {tuple(e["fingerprint"]) for e in by_job[failing.id]} == {
        ("{{ default }}", "django_jobs", "tests.tasks.always_fails")
    }
    assert [e["exception"]["values"][-1]["type"] for e in by_job[slow.id]] == ["JobTimeout"] * 2
    for event in events:
        assert event["contexts"]["trace"]["trace_id"] == request.trace_id
    # The worker's "job failed" lines reached Sentry's logging integration, and were dropped.
    assert "job failed task=tests.tasks.always_fails" in proc.output()
    assert not [e for e in events if e.get("logger") == "django_jobs.worker"]
    # Every attempt that ran, each a queue.process transaction in the same trace.
    runs = events_of(items, "transaction")
    statuses = sorted(
        (run["transaction"], run["contexts"]["trace"]["status"])
        for run in runs
        if run["contexts"]["trace"]["op"] == "queue.process"
    )
    assert statuses == sorted(
        [("tests.tasks.always_fails", "internal_error")] * 3
        + [("tests.control_tasks.too_slow", "deadline_exceeded")] * 2
        + [("tests.control_tasks.snoozes_once", "ok")] * 2
        + [("tests.control_tasks.until_cancelled", "cancelled")]
        + [("tests.tasks.add", "ok")]
    )
    assert {run["contexts"]["trace"]["trace_id"] for run in runs} == {request.trace_id}


def test_merge_baggage_keeps_each_key_once():
    assert tracing.merge_baggage(None, "sentry-a=1") == "sentry-a=1"
    assert tracing.merge_baggage("t=1,u=2", "sentry-a=1, t=9") == "t=1,u=2,sentry-a=1"
    assert tracing.merge_baggage("", "x=1") == "x=1"


def test_an_idle_thread_between_jobs_keeps_no_job_scope(sentry, run_next):
    """After a job, events the worker thread makes carry none of the job's tags."""
    tasks.always_fails.using(max_attempts=1).enqueue()
    run_next()
    sentry_sdk.capture_message("between jobs")
    between = sentry.events()[-1]
    assert between["message"] == "between jobs"
    assert not any(name.startswith("django_jobs.") for name in between.get("tags", {}))


@pytest.mark.workers
def test_a_run_jobs_process_whose_sentry_transport_fails_records_every_outcome(run_jobs, tmp_path):
    """Sentry itself failing in the worker (its transport cannot write): the jobs' outcomes
    are recorded as without it, and the worker goes on and stops cleanly."""
    failing = tasks.always_fails.using(max_attempts=1).enqueue("still recorded")
    ok = tasks.add.enqueue(2, 3)
    proc = run_jobs(
        "--processes",
        "1",
        "--threads",
        "2",
        env={
            "DJANGO_SETTINGS_MODULE": "testproject.sentry_settings",
            "JOBS_SENTRY_EVENTS": str(tmp_path / "no-such-directory" / "sentry.jsonl"),
        },
    )
    wait_until(
        lambda: (
            Job.objects.get(pk=ok.id).status == JobStatus.SUCCEEDED
            and Job.objects.get(pk=failing.id).status == JobStatus.FAILED
        ),
        30,
        what=f"both jobs ended; run_jobs said:\n{proc.output()}",
    )
    failure = FailedExecution.objects.get(job_id=int(failing.id))
    assert (failure.exception_class_path, failure.message) == (
        "builtins.ValueError",
        "still recorded",
    )
    later = tasks.add.enqueue(4, 5)  # the worker still takes jobs
    wait_until(
        lambda: Job.objects.get(pk=later.id).status == JobStatus.SUCCEEDED,
        30,
        what=f"a later job; run_jobs said:\n{proc.output()}",
    )
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0
    # Sentry raised in the failure's report: logged (its lines all written by the exit).
    output = proc.output()
    assert (
        f"job {failing.id}: the job_attempt_failed receiver report_failed_attempt raised "
        "FileNotFoundError" in output
    )
