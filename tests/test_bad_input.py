"""Bad input is refused at the door, clearly and at once, with nothing written.

A new user's mistakes (a forgotten ``@task``, a call the function cannot take, a
value JSON would not keep, a misspelt setting, a queue nobody declared) must fail
where they are made, naming what is wrong, not later in a worker or never.
"""

from __future__ import annotations

import re

import pytest
from django.core.checks import Error
from django.core.management import CommandError, call_command
from django.tasks import default_task_backend
from django.tasks.exceptions import InvalidTask
from django.test import override_settings
from django.utils import timezone

from django_jobs import bulk_enqueue, enqueue_batch
from django_jobs import task as jobs_task
from django_jobs.checks import backend_checks
from django_jobs.exceptions import InvalidTaskArguments
from django_jobs.models import Batch, Job, ReadyExecution
from tests import batch_tasks as bt
from tests import tasks

pytestmark = pytest.mark.django_db

# The same function as tests.tasks.add, as this backend's task: keyless, and keyed.
add_job = jobs_task(tasks.add.func, max_attempts=2)
add_keyed = jobs_task(tasks.add.func, concurrency_key="a:{a}")


def assert_nothing_written() -> None:
    assert (Job.objects.count(), ReadyExecution.objects.count(), Batch.objects.count()) == (0, 0, 0)


# --- a plain function where a task belongs ----------------------------------------------


@pytest.mark.parametrize("enqueue", [bulk_enqueue, enqueue_batch], ids=["bulk", "batch"])
@pytest.mark.parametrize("position", [0, 1])
def test_a_plain_function_is_an_invalid_task_and_nothing_is_written(enqueue, position):
    calls = [(tasks.add, [1, 2], {})]
    calls.insert(position, (tasks.not_a_task, [], {}))
    with pytest.raises(InvalidTask) as info:
        enqueue(calls)
    message = str(info.value)
    assert f"call {position} names <function not_a_task" in message
    assert "not a task (a function decorated with @task)" in message
    assert_nothing_written()


def test_the_backend_refuses_a_plain_function_too():
    with pytest.raises(InvalidTask, match="not a task"):
        default_task_backend.bulk_enqueue([(tasks.not_a_task, [], {})])
    assert_nothing_written()


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ((tasks.add, [1, 2]), r"call 0 must be a \(task, args, kwargs\) tuple"),
        (tasks.add, r"call 0 must be a \(task, args, kwargs\) tuple"),
        ((tasks.echo, "ab", {}), "call 0's args must be a list or a tuple"),
        ((tasks.echo, [1], [("k", 1)]), "call 0's kwargs must be a dict"),
    ],
    ids=["two-items", "bare-task", "string-args", "list-kwargs"],
)
@pytest.mark.parametrize("enqueue", [bulk_enqueue, enqueue_batch], ids=["bulk", "batch"])
def test_a_call_of_the_wrong_shape_is_refused(enqueue, call, expected):
    with pytest.raises(InvalidTask, match=expected):
        enqueue([call])
    assert_nothing_written()


# --- arguments the function cannot take --------------------------------------------------


@pytest.mark.parametrize("task", [tasks.add, add_job, add_keyed], ids=["django", "jobs", "keyed"])
@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ([1], {}, "missing a required argument: 'b'"),
        ([1, 2], {"c": 3}, "got an unexpected keyword argument 'c'"),
        ([1, 2, 3], {}, "positional argument 2 is one too many"),
        ([1], {"a": 1}, "multiple values for argument 'a'"),
    ],
    ids=["missing", "unexpected", "too-many", "twice"],
)
def test_a_call_the_function_would_refuse_fails_at_enqueue(task, args, kwargs, named):
    with pytest.raises(InvalidTaskArguments, match=re.escape(named)) as info:
        task.enqueue(*args, **kwargs)
    assert "Arguments do not match tests.tasks.add(a, b): " in str(info.value)
    assert isinstance(info.value, InvalidTask) and isinstance(info.value, TypeError)
    assert_nothing_written()


def test_the_context_parameter_is_not_the_callers():
    with pytest.raises(InvalidTaskArguments, match="positional argument 1 is one too many"):
        tasks.report_attempt.enqueue(0, 1)
    with pytest.raises(InvalidTaskArguments, match="multiple values for argument 'context'"):
        tasks.report_attempt.enqueue(context=1)
    assert_nothing_written()
    tasks.report_attempt.enqueue(fail_until=1)
    assert Job.objects.get().kwargs == {"fail_until": 1}


def test_a_bulk_with_one_bad_call_writes_nothing():
    with pytest.raises(InvalidTaskArguments, match="missing a required argument: 'b'"):
        bulk_enqueue([(tasks.add, [1, 2], {}), (add_job, [1], {})])
    with pytest.raises(InvalidTaskArguments, match="missing a required argument: 'b'"):
        enqueue_batch([(bt.item, [1], {}), (tasks.add, [1], {})])
    assert_nothing_written()


def test_calls_that_fit_are_enqueued_by_position_keyword_or_default():
    tasks.add.enqueue(1, b=2)
    add_job.enqueue(a=3, b=4)
    tasks.sleep_then_return.enqueue(0.5)  # marker takes its default
    assert sorted(map(tuple, Job.objects.values_list("args", "kwargs"))) == [
        ([], {"a": 3, "b": 4}),
        ([0.5], {}),
        ([1], {"b": 2}),
    ]


# --- values JSON would not keep ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ([1, timezone.now()], {}, "positional argument 1 is not JSON serializable"),
        ([float("nan")], {"b": 1}, "positional argument 0 is not JSON serializable"),
        ([1], {"b": {1: "int key"}}, "keyword argument 'b' would change in JSON"),
        ([1], {"b": {2, 3}}, "keyword argument 'b' is not JSON serializable"),
    ],
    ids=["datetime", "nan", "int-key", "set"],
)
def test_the_json_error_names_the_argument_at_fault(args, kwargs, named):
    with pytest.raises(InvalidTaskArguments, match=re.escape(named)):
        tasks.add.enqueue(*args, **kwargs)
    assert_nothing_written()


def test_a_keyword_name_that_is_not_a_string_is_named():
    with pytest.raises(InvalidTaskArguments, match="names must be strings: 1"):
        bulk_enqueue([(tasks.echo, [], {1: "x"})])
    assert_nothing_written()


# --- system checks: every problem at once, with the likely intent -----------------------


def checked(jobs_settings) -> list[Error]:
    with override_settings(DJANGO_JOBS=jobs_settings):
        return [e for e in backend_checks(default_task_backend) if isinstance(e, Error)]


def ids(errors: list[Error]) -> list[str]:
    return sorted(error.id.removeprefix("django_jobs.") for error in errors)


def by_id(errors: list[Error], error_id: str) -> Error:
    (error,) = [e for e in errors if e.id == f"django_jobs.{error_id}"]
    return error


def test_an_unknown_setting_no_longer_hides_the_rest():
    errors = checked(
        {"thread": 3, "queues": ["default", "nope"], "threads": 0, "max_concurrency": {"slow": 0}}
    )
    assert ids(errors) == ["E003", "E005", "E007", "E009"]
    assert by_id(errors, "E003").hint == "Did you mean 'threads'?"


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("thread", "threads"),
        ("polling", "polling_interval"),
        ("shutdown_timout", "shutdown_timeout"),
        ("max_concurency", "max_concurrency"),
        ("queue", "queues"),
    ],
)
def test_a_near_miss_setting_name_gets_a_suggestion(name, meant):
    (error,) = checked({name: 1})
    assert error.id == "django_jobs.E003"
    assert repr(name) in error.msg and error.hint == f"Did you mean {meant!r}?"


def test_each_unknown_setting_is_its_own_error_and_a_far_miss_lists_the_known_ones():
    errors = checked({"thread": 3, "colour": "blue"})
    assert ids(errors) == ["E003", "E003"]
    far = next(e for e in errors if "'colour'" in e.msg)
    assert far.hint.startswith("Known settings: ") and "threads" in far.hint


def test_an_unreadable_queue_list_still_lets_the_rest_be_checked():
    assert ids(checked({"queues": 5, "threads": 0, "thred": 1})) == ["E003", "E004", "E007"]
    assert ids(checked({"queues": ["default", 7]})) == ["E004"]
    with override_settings(DJANGO_JOBS=["threads", 3]):
        assert ids(backend_checks(default_task_backend)) == ["E004"]


@pytest.mark.parametrize(
    ("queues", "errors"),
    [
        (["*"], []),
        (["reports*", "default"], []),
        (["repots*"], ["pattern 'repots*' matches no queue in QUEUES. Did you mean 'reports'?"]),
        (["nope*", "emails"], ["pattern 'nope*' matches no queue in QUEUES."]),
        (["email"], ["names 'email', which is not in QUEUES. Did you mean 'emails'?"]),
    ],
)
def test_e005_refuses_names_and_patterns_that_match_no_declared_queue(queues, errors):
    found = checked({"queues": queues})
    assert [e.msg.removeprefix("DJANGO_JOBS['queues'] ") for e in found] == errors
    for error in found:
        assert error.hint == "Known queues: default, emails, reports, reports-daily, slow."


def test_e006_suggests_the_queue_meant():
    error = by_id(checked({"max_concurrency": {"email": 1}}), "E006")
    assert error.hint == "Did you mean 'emails'?"
    assert ids(checked({"max_concurrency": 3})) == ["E009"]


def test_an_unknown_recurring_entry_key_gets_a_suggestion():
    entry = {"task": "tests.tasks.add", "schedule": "@daily", "args": [1, 2], "queue": "slow"}
    error = by_id(checked({"recurring": {"x": entry}}), "E011")
    assert error.hint.startswith("Did you mean 'queue_name'? Known keys: ")


def test_recurring_arguments_the_function_would_refuse_are_a_check_error():
    entry = {"task": "tests.tasks.add", "schedule": "@daily", "args": [1]}
    error = by_id(checked({"recurring": {"x": entry}}), "E016")
    assert error.msg.endswith("tests.tasks.add(a, b): missing a required argument: 'b'")


def test_a_misspelt_task_option_gets_a_suggestion():
    with pytest.raises(TypeError, match=r"max_attempt\. Did you mean 'max_attempts'\?"):
        jobs_task(tasks.echo.func, max_attempt=3)
    with pytest.raises(TypeError, match=r"concurency_key\. Did you mean 'concurrency_key'\?"):
        add_job.using(concurency_key="x")


TWO_BACKENDS = {
    "default": {"BACKEND": "django_jobs.backend.JobsBackend", "QUEUES": ["default", "emails"]},
    "reports": {"BACKEND": "django_jobs.backend.JobsBackend", "QUEUES": ["reports"]},
}


@override_settings(TASKS=TWO_BACKENDS)
def test_with_two_backends_settings_are_checked_once_against_all_their_queues():
    from django.tasks import task_backends

    with override_settings(DJANGO_JOBS={"thread": 3, "queues": ["emails", "reports", "nope"]}):
        errors = [e for alias in TWO_BACKENDS for e in backend_checks(task_backends[alias])]
    assert ids(errors) == ["E003", "E005"]
    assert "'nope'" in by_id(errors, "E005").msg


# --- run_jobs --queues --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("queues", "refused"),
    [("nope", ["names 'nope'"]), ("emails,nope*", ["pattern 'nope*'"]), ("x,y*", ["'x'", "'y*'"])],
)
def test_run_jobs_refuses_queues_no_backend_declares(queues, refused):
    with pytest.raises(CommandError) as info:
        call_command("run_jobs", "--once", "--queues", queues)
    message = str(info.value)
    assert message.startswith("--queues ")
    assert all(text in message for text in refused)
    assert message.endswith("Known queues: default, emails, reports, reports-daily, slow.")


def test_run_jobs_refuses_an_unknown_queue_of_the_setting_even_with_checks_skipped():
    with (
        override_settings(DJANGO_JOBS={"queues": ["default", "nope"]}),
        pytest.raises(CommandError, match=r"^DJANGO_JOBS\['queues'\] names 'nope'"),
    ):
        call_command("run_jobs", "--once", skip_checks=True)


@pytest.mark.workers
def test_a_run_jobs_process_with_an_unknown_queue_exits_instead_of_idling(run_jobs):
    proc = run_jobs("--queues", "nope")
    assert proc.wait(30) != 0
    assert "CommandError: --queues names 'nope', which is not in QUEUES." in proc.output()
