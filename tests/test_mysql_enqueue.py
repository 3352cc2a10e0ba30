"""MySQL/MariaDB: a single ready enqueue is one ``CALL`` of migration 0013's procedure, which
writes the same rows as the statements' path, all or nothing, in autocommit and inside the
caller's transaction; without the procedure the statements' path takes over."""

from __future__ import annotations

from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.apps import apps
from django.db import DatabaseError, connection, transaction
from django.db.migrations.state import ProjectState
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_jobs.core.enqueue import new_job, prepare_job
from django_jobs.db import ops
from django_jobs.db.mysql import ENQUEUE_PROCEDURE, _procedure_fields
from django_jobs.models import Job, JobStatus, ReadyExecution
from tests import tasks
from tests.mysql_columns import column_changed

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the procedure is MySQL's"),
]

DB = "default"


def migration():
    from importlib import import_module

    return import_module("django_jobs.migrations.0013_mysql_enqueue_procedure")


def procedure_parameters() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT parameter_name FROM information_schema.parameters "
            "WHERE specific_schema = DATABASE() AND specific_name = %s ORDER BY ordinal_position",
            [ENQUEUE_PROCEDURE],
        )
        return [row[0] for row in cursor.fetchall()]


def row_of(pk: int) -> dict:
    row = Job.objects.filter(pk=pk).values().get()
    row.pop("id")
    row.pop("enqueued_at")
    # Each enqueue's own span, where the tests run with an OpenTelemetry SDK.
    assert (row.pop("trace_context") is None) == (not otel_sdk())
    return row


def otel_sdk() -> bool:
    """A tracer provider is set (tests/test_tracing.py sets one for the rest of its process)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return False
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_the_procedure_takes_every_job_column_in_order():
    """A migration that adds a job column must create the procedure again
    (``db/enqueue_procedure.follow_job_columns``): until then this fails, as
    tests/test_enqueue_procedure.py does on every database (and a job setting the column
    takes the statements' path)."""
    columns = [field.column for field in Job._meta.concrete_fields if not field.primary_key]
    first, *rest = procedure_parameters()
    assert first == "own_transaction"
    assert sorted(rest) == sorted(f"p_{column}" for column in columns)  # in the table's order


def test_one_call_writes_what_the_statements_write():
    tasks.add.enqueue(0, 0)  # the procedure's parameters are read once per process
    with CaptureQueriesContext(connection) as captured:
        called = tasks.echo.using(priority=3).enqueue({"k": ["v", 1.5, None]})
    assert [q["sql"].split("(")[0] for q in captured.captured_queries] == [
        f"CALL {ENQUEUE_PROCEDURE}"
    ]
    # The same call through the statements: the procedure's path refused.
    job, _ = prepare_job(
        tasks.echo.get_backend(), tasks.echo.using(priority=3), [{"k": ["v", 1.5, None]}], {}
    )
    with transaction.atomic():
        job.save()
        ReadyExecution.objects.create(
            job=job, queue_name=job.queue_name, priority=job.priority, created_at=job.enqueued_at
        )
    assert row_of(int(called.id)) == row_of(job.pk)
    ready = ReadyExecution.objects.get(job_id=int(called.id))
    stored = Job.objects.get(pk=int(called.id))
    assert (ready.queue_name, ready.priority, ready.created_at) == (
        "emails",
        3,
        stored.enqueued_at,
    )
    assert stored.status == JobStatus.READY and stored.args == [{"k": ["v", 1.5, None]}]


def test_in_the_callers_transaction_one_call_and_a_failure_leaves_it_usable():
    backend = tasks.add.get_backend()
    tasks.add.enqueue(0, 0)  # the procedure's parameters are read once per process
    Job.objects.all().delete()
    with transaction.atomic():
        with CaptureQueriesContext(connection) as captured:
            kept = tasks.add.enqueue(1, 2)
        assert len(captured.captured_queries) == 1
        bad, _ = prepare_job(backend, tasks.add, [3, 4], {})
        bad.priority = 70000  # beyond the column's range: the first INSERT fails
        with pytest.raises(DatabaseError):
            ops(DB).enqueue_ready(DB, bad)
        # Rolled back to the procedure's savepoint: nothing of it, and the block goes on.
        after = tasks.add.enqueue(5, 6)
    assert sorted(Job.objects.values_list("args", flat=True)) == [[1, 2], [5, 6]]
    assert ReadyExecution.objects.count() == 2
    assert {int(kept.id), int(after.id)} == set(
        ReadyExecution.objects.values_list("job_id", flat=True)
    )


def test_without_the_procedure_the_statements_take_over():
    schema_state = ProjectState.from_apps(apps)
    with connection.schema_editor() as editor:
        migration().drop_procedure(schema_state.apps, editor)
    try:
        result = tasks.add.enqueue(1, 2)  # the cache still names the procedure: the CALL fails
        again = tasks.add.enqueue(3, 4)  # the cache forgot it: straight to the statements
        assert (
            ReadyExecution.objects.filter(job_id__in=[int(result.id), int(again.id)]).count() == 2
        )
        assert _procedure_fields  # read again, and found missing
        assert all(fields is None for fields in _procedure_fields.values())
    finally:
        with connection.schema_editor() as editor:
            migration().create_procedure(schema_state.apps, editor)
        _procedure_fields.clear()
    assert tasks.add.enqueue(5, 6).id
    assert procedure_parameters()


@pytest.fixture
def ready_queue_names_of_three():
    """The ready table's queue_name cut to 3 characters: the procedure's second INSERT
    fails for a longer one, after its first succeeded."""
    with column_changed(ReadyExecution, "queue_name", "VARCHAR(3) NOT NULL"):
        yield


@pytest.mark.parametrize("in_atomic", [False, True])
def test_a_failure_after_the_job_row_takes_the_job_row_back(ready_queue_names_of_three, in_atomic):
    job, _ = prepare_job(tasks.echo.get_backend(), tasks.echo, ["x"], {})  # queue "emails"
    if in_atomic:
        with transaction.atomic():
            with pytest.raises(DatabaseError):
                ops(DB).enqueue_ready(DB, job)
            assert not Job.objects.exists()  # the savepoint, not the caller's block, undone
            Job.objects.create(
                task_path="kept", queue_name="q", enqueued_at=job.enqueued_at, args=[], kwargs={}
            )
        assert list(Job.objects.values_list("task_path", flat=True)) == ["kept"]
    else:
        with pytest.raises(DatabaseError):
            ops(DB).enqueue_ready(DB, job)
        assert not Job.objects.exists()
    assert not ReadyExecution.objects.exists()


class Label(str):
    """A str subclass: its value goes through the field's own preparation, as an enum
    member's does."""


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
numbers = st.integers(0, 10_000) | st.floats(0, 1e6, allow_nan=False)
# Aware datetimes in any fixed offset: MySQL stores them as naive UTC, which Django's
# preparation does and the driver would not.
offsets = st.timedeltas(timedelta(hours=-14), timedelta(hours=14)).map(
    lambda delta: dt_timezone(timedelta(minutes=delta // timedelta(minutes=1)))
)
moments = st.datetimes(datetime(1971, 1, 1), datetime(2200, 1, 1), timezones=offsets)
# The columns a ready job without key or uniqueness may carry, each NULL or not.
optional_values = st.fixed_dictionaries(
    {},
    optional={
        "timeout": numbers,
        "backoff": json_values,
        "trace_context": st.dictionaries(texts, texts, max_size=2),
        "rate_key": texts | texts.map(Label),
        "rate_limit": st.integers(1, 10_000),
        "rate_period": numbers,
        "progress_message": texts,
        "progress_done": numbers,
        "last_attempted_at": moments,
        "run_after": moments,
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=optional_values,
    priority=st.integers(-100, 100),
    queue=texts.filter(bool) | texts.filter(bool).map(Label),
    args=st.lists(json_values, max_size=3),
)
def test_any_values_the_procedure_writes_as_django_does(values, priority, queue, args):
    """Only the non-NULL values are bound (NULLs are written into the CALL), and a str, int
    or float of a plain field skips the field's preparation: neither may change a value.
    The same job through ``Model.save()`` is the reference."""
    tasks.add.enqueue(0, 0)  # the procedure's parameters are read once per process
    now = timezone.now()
    common = dict(
        task_path="tests.tasks.echo",
        queue_name=queue[:128],
        priority=priority,
        args=args,
        kwargs={"k": args},
        status=JobStatus.READY,
        enqueued_at=now,
        **values,
    )
    called = new_job(**common)
    assert ops(DB).enqueue_ready(DB, called)
    saved = new_job(**common)
    saved.save()
    assert row_of_any(called.pk) == row_of_any(saved.pk)
    ready = ReadyExecution.objects.get(job_id=called.pk)
    assert (ready.queue_name, ready.priority, ready.created_at) == (
        queue[:128],
        priority,
        now.replace(microsecond=now.microsecond),
    )


def row_of_any(pk: int) -> dict:
    row = Job.objects.filter(pk=pk).values().get()
    row.pop("id")
    return row
