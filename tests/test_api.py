"""The backend as Django users meet it: enqueue, results, options, bad input, checks."""

from __future__ import annotations

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.core.checks import Error
from django.db import transaction
from django.tasks import TaskResultStatus, default_task_backend
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued
from django.test import override_settings
from django.utils import timezone

from django_jobs import Exponential, bulk_enqueue, enqueue_on_commit
from django_jobs import task as jobs_task
from django_jobs.checks import backend_checks, sqlite_checks
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_job
from django_jobs.exceptions import InvalidTaskArguments
from django_jobs.models import Job, JobStatus, ReadyExecution, ScheduledExecution
from tests import tasks

pytestmark = pytest.mark.django_db


def test_backend_declares_every_feature():
    backend = default_task_backend
    assert backend.supports_defer and backend.supports_priority
    assert backend.supports_get_result and backend.supports_async_task


def test_enqueue_writes_a_job_and_a_ready_execution():
    result = tasks.echo.enqueue({"a": [1, 2]})
    job = Job.objects.get(pk=int(result.id))
    assert result.status == TaskResultStatus.READY
    assert result.args == [{"a": [1, 2]}] and result.kwargs == {}
    assert result.enqueued_at is not None and result.started_at is None
    assert (job.task_path, job.queue_name, job.priority) == ("tests.tasks.echo", "emails", 5)
    assert job.status == JobStatus.READY
    assert ReadyExecution.objects.filter(job=job, queue_name="emails", priority=5).exists()


def test_get_result_round_trips_and_rejects_unknown_ids():
    result = tasks.add.enqueue(1, 2)
    again = default_task_backend.get_result(result.id)
    assert (again.id, again.args, again.status) == (result.id, [1, 2], TaskResultStatus.READY)
    assert again.task.func is tasks.add.func
    fetched = async_to_sync(tasks.add.aget_result)(result.id)
    assert fetched.id == result.id
    for bad in ("999999999", "not-a-number", ""):
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(bad)
    with pytest.raises(TaskResultMismatch):
        tasks.echo.get_result(result.id)


def test_a_results_task_is_the_enqueued_one_shared_until_the_settings_change(settings):
    first, second = tasks.add.enqueue(1, 2), tasks.add.enqueue(3, 4)
    other = tasks.add.using(priority=7).enqueue(5, 6)
    get = default_task_backend.get_result
    # One task per set of values (a worker builds one per job it runs), its own per value.
    assert get(first.id).task is get(second.id).task
    assert (get(other.id).task.priority, get(first.id).task.priority) == (7, 0)
    mail = tasks.echo.enqueue("x")
    assert get(mail.id).task.queue_name == "emails"
    # The queue removed from TASKS: the task as declared, not the one built before.
    settings.TASKS = {
        alias: {**conf, "QUEUES": ["default"]} for alias, conf in settings.TASKS.items()
    }
    assert get(mail.id).task is tasks.echo


def test_aenqueue_works_from_async_code():
    result = async_to_sync(tasks.async_double.aenqueue)(21)
    assert Job.objects.get(pk=int(result.id)).task_path == "tests.tasks.async_double"


def test_run_after_in_the_future_is_scheduled():
    later = timezone.now() + timedelta(hours=1)
    result = tasks.add.using(run_after=later).enqueue(1, 1)
    job = Job.objects.get(pk=int(result.id))
    assert job.status == JobStatus.SCHEDULED
    assert ScheduledExecution.objects.get(job=job).scheduled_at == later
    assert not ReadyExecution.objects.filter(job=job).exists()


def test_unknown_queue_is_refused():
    with pytest.raises(InvalidTask):
        tasks.add.using(queue_name="nope").enqueue(1, 1)


@pytest.mark.django_db(transaction=True)
def test_enqueue_in_a_rolled_back_transaction_leaves_nothing():
    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        tasks.add.enqueue(1, 2)
        bulk_enqueue([(tasks.add, [3, 4], {})])
        raise Rollback
    assert Job.objects.count() == 0
    assert ReadyExecution.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_enqueue_on_commit_waits_for_the_commit():
    with transaction.atomic():
        enqueue_on_commit(tasks.add, 5, 6, using="default")
        assert Job.objects.count() == 0
    assert list(Job.objects.values_list("args", flat=True)) == [[5, 6]]

    with pytest.raises(ZeroDivisionError), transaction.atomic():
        enqueue_on_commit(tasks.add, 7, 8)
        1 / 0  # noqa: B018
    assert Job.objects.count() == 1


def test_task_enqueued_signal_carries_the_result():
    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append(task_result.id)

    task_enqueued.connect(receiver)
    try:
        result = tasks.add.enqueue(1, 2)
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [result.id]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("way", ["bulk_enqueue", "workflow", "enqueue_batch"])
def test_task_enqueued_is_sent_once_per_job_after_the_enqueue_committed(way):
    """Every way that runs its own tries (core.attempts) announces the jobs after them:
    outside its transaction, the jobs already visible, once each; a try rolled back is
    never announced."""
    from django.db import connection

    from django_jobs import enqueue_batch, workflow

    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append((task_result.id, connection.in_atomic_block))
        assert Job.objects.filter(pk=int(task_result.id)).exists()

    calls = [(tasks.add, (n, n), {}) for n in range(3)]
    task_enqueued.connect(receiver)
    try:
        if way == "bulk_enqueue":
            ids = [r.id for r in bulk_enqueue(calls)]
        elif way == "workflow":
            with workflow() as wf:
                nodes = [wf.add(task, *args) for task, args, _ in calls]
            ids = [node.result.id for node in nodes]
        else:
            ids = [r.id for r in enqueue_batch(calls).results]
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [(pk, False) for pk in ids]


@pytest.mark.parametrize(
    "bad",
    [
        [timezone.now()],
        [object()],
        [{1, 2}],
        [{1: "int key"}],
        [float("nan")],
    ],
    ids=["datetime", "object", "set", "int-key", "nan"],
)
def test_arguments_that_do_not_survive_json_fail_at_enqueue(bad):
    with pytest.raises(InvalidTaskArguments) as info:
        tasks.echo.enqueue(*bad)
    assert isinstance(info.value, InvalidTask) and isinstance(info.value, TypeError)
    assert "JSON" in str(info.value)
    assert Job.objects.count() == 0


def test_tuples_become_lists():
    result = tasks.echo.enqueue((1, (2, 3)))
    assert Job.objects.get(pk=int(result.id)).args == [[1, [2, 3]]]


def test_bulk_enqueue_is_a_few_queries_for_thousands(django_assert_max_num_queries):
    calls = [(tasks.add, [i, i], {}) for i in range(3000)]
    with django_assert_max_num_queries(12):
        results = bulk_enqueue(calls)
    assert len(results) == 3000 == Job.objects.count() == ReadyExecution.objects.count()
    assert {int(r.id) for r in results} == set(Job.objects.values_list("pk", flat=True))


def test_bulk_enqueue_is_all_or_nothing():
    with pytest.raises(InvalidTaskArguments):
        bulk_enqueue([(tasks.add, [1, 2], {}), (tasks.echo, [object()], {})])
    assert Job.objects.count() == 0


def test_bulk_enqueue_mixes_ready_and_scheduled():
    later = timezone.now() + timedelta(minutes=5)
    bulk_enqueue([(tasks.add, [1, 1], {}), (tasks.add.using(run_after=later), [2, 2], {})])
    assert ReadyExecution.objects.count() == 1 and ScheduledExecution.objects.count() == 1


def module_level_backoff(attempt: int) -> float:
    return attempt * 10.0


def test_task_options_are_stored_on_the_job():
    limited = jobs_task(
        tasks.echo.func,
        max_attempts=4,
        backoff=Exponential(base=1, max=8),
        concurrency_key="echo:{value}",
        concurrency_limit=2,
    )
    job = Job.objects.get(pk=int(limited.enqueue("x").id))
    assert (job.max_attempts, job.concurrency_key, job.concurrency_limit) == (
        4,
        "tests.tasks.echo/echo:x",
        2,
    )
    assert job.backoff == {"exponential": {"base": 1, "factor": 2.0, "max": 8, "jitter": 0.25}}
    per_call = limited.using(max_attempts=1, backoff=7, concurrency_limit=3)
    job = Job.objects.get(pk=int(per_call.enqueue("y").id))
    assert (job.max_attempts, job.concurrency_limit) == (1, 3)
    assert job.backoff == {"fixed": 7.0}
    declared = jobs_task(tasks.echo.func, backoff=module_level_backoff)
    job = Job.objects.get(pk=int(declared.using(max_attempts=2).enqueue("z").id))
    assert job.backoff == {"path": "tests.test_api.module_level_backoff"}


def test_a_backoff_function_per_call_is_refused():
    """A worker calls only the backoff function the loaded task declares (a row's path is
    never imported): one given per call would be dropped there, so it is refused here."""
    with pytest.raises(InvalidTask, match="a backoff function is declared with the task"):
        jobs_task(tasks.echo.func).using(backoff=module_level_backoff)


def test_concurrency_key_callable_and_defaults():
    def key(value):
        return f"v-{value}"

    by_callable = jobs_task(tasks.echo.func, concurrency_key=key)
    assert (
        Job.objects.get(pk=int(by_callable.enqueue(3).id)).concurrency_key == "tests.tasks.echo/v-3"
    )
    with_default = jobs_task(tasks.sleep_then_return.func, concurrency_key="s:{marker}")
    job = Job.objects.get(pk=int(with_default.enqueue(0.1).id))
    assert job.concurrency_key == "tests.tasks.sleep_then_return/s:None"


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"max_attempts": "3"},
        {"backoff": -1},
        {"backoff": lambda attempt: 1},
        {"concurrency_limit": 0},
        {"concurrency_key": "x:{missing}"},
        {"concurrency_key": "x:{0}"},
        {"concurrency_key": ""},
    ],
)
def test_bad_options_fail_at_declaration(options):
    with pytest.raises(InvalidTask):
        jobs_task(tasks.echo.func, **options)


def test_unknown_options_are_type_errors():
    with pytest.raises(TypeError):
        jobs_task(tasks.echo.func, max_attempt=3)
    with pytest.raises(TypeError):
        tasks.add.using(retries=3)


def test_result_is_complete_after_failed_and_successful_attempts():
    result = jobs_task(tasks.echo.func, max_attempts=2, backoff=0).enqueue("v")
    job_id = int(result.id)
    worker = register_process("default", "worker")
    for outcome in ("fail", "ok"):
        (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
        assert start_job("default", job, worker.pk, worker.name)
        if outcome == "fail":
            fail_job(
                "default",
                job_id,
                worker.pk,
                ErrorInfo("builtins.ValueError", "bad", "Traceback: ValueError: bad"),
                worker_id=worker.name,
            )
        else:
            assert finish_job("default", job_id, worker.pk, "v")
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.attempts == 2 and result.worker_ids == [worker.name, worker.name]
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"]
    assert result.errors[0].exception_class is ValueError
    assert "ValueError: bad" in result.errors[0].traceback
    assert result.return_value == "v"
    assert result.started_at <= result.last_attempted_at <= result.finished_at


def test_result_of_a_job_whose_task_no_longer_imports():
    result = tasks.add.enqueue(1, 2)
    Job.objects.filter(pk=int(result.id)).update(task_path="tests.gone.task")
    again = default_task_backend.get_result(result.id)
    assert again.status == TaskResultStatus.READY and again.args == [1, 2]


def error_ids(errors):
    return sorted(e.id for e in errors if isinstance(e, Error))


def test_checks_pass_on_the_test_settings():
    assert error_ids(backend_checks(default_task_backend)) == []


def test_check_sqlite_needs_immediate_transactions():
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3"}
    assert error_ids(sqlite_checks("jobs", sqlite)) == ["django_jobs.E002"]
    deferred = {**sqlite, "OPTIONS": {"transaction_mode": "DEFERRED"}}
    assert error_ids(sqlite_checks("jobs", deferred)) == ["django_jobs.E002"]
    immediate = {**sqlite, "OPTIONS": {"transaction_mode": "IMMEDIATE"}}
    assert sqlite_checks("jobs", immediate) == []
    assert sqlite_checks("jobs", {"ENGINE": "django.db.backends.postgresql"}) == []


@pytest.mark.parametrize(
    ("jobs_settings", "expected"),
    [
        ({"threds": 3}, "django_jobs.E003"),
        ({"queues": ["default", "missing"]}, "django_jobs.E005"),
        ({"max_concurrency": {"missing": 1}}, "django_jobs.E006"),
        ({"threads": 0}, "django_jobs.E007"),
        ({"max_jobs_per_child": 0}, "django_jobs.E007"),
        ({"max_memory_per_child": "512"}, "django_jobs.E007"),
        ({"polling_interval": 0}, "django_jobs.E008"),
        ({"max_concurrency": {"default": 0}}, "django_jobs.E009"),
        ({"database": "nowhere"}, "django_jobs.E001"),
    ],
)
def test_bad_settings_are_check_errors(jobs_settings, expected):
    with override_settings(DJANGO_JOBS=jobs_settings):
        assert expected in error_ids(backend_checks(default_task_backend))


@pytest.mark.parametrize(
    "options",
    [
        {"concurrency_key": "x:{value}", "concurrency_group": ""},
        {"concurrency_key": "x:{value}", "concurrency_group": "a/b"},
        {"concurrency_key": "x:{value}", "concurrency_duration": 0},
        {"concurrency_key": "x:{value}", "concurrency_duration": "1h"},
        {"concurrency_key": "x:{value}", "on_conflict": "skip"},
        {"concurrency_group": "sync"},
        {"concurrency_duration": 30},
    ],
)
def test_bad_concurrency_options_fail_at_declaration(options):
    with pytest.raises(InvalidTask):
        jobs_task(tasks.echo.func, **options)


def test_tasks_share_a_limit_only_through_a_group():
    mine = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_group="sync")
    theirs = jobs_task(tasks.add.func, concurrency_key="acct:{a}", concurrency_group="sync")
    alone = jobs_task(tasks.add.func, concurrency_key="acct:{a}")
    first = Job.objects.get(pk=int(mine.enqueue(1).id))
    second = Job.objects.get(pk=int(theirs.enqueue(1, 0).id))
    third = Job.objects.get(pk=int(alone.enqueue(1, 0).id))
    assert first.concurrency_key == second.concurrency_key == "sync/acct:1"
    assert (first.status, second.status) == (JobStatus.READY, JobStatus.BLOCKED)
    assert (third.concurrency_key, third.status) == ("tests.tasks.add/acct:1", JobStatus.READY)


def test_on_conflict_discard_drops_the_job_instead_of_blocking():
    once = jobs_task(tasks.echo.func, concurrency_key="k:{value}", on_conflict="discard")
    first, second = once.enqueue(1), once.enqueue(1)
    assert Job.objects.get(pk=int(first.id)).status == JobStatus.READY
    dropped = Job.objects.get(pk=int(second.id))
    assert dropped.status == JobStatus.DISCARDED and dropped.finished_at is not None
    assert default_task_backend.get_result(second.id).status == TaskResultStatus.FAILED


def test_a_lease_is_stored_in_seconds():
    leased = jobs_task(
        tasks.echo.func, concurrency_key="k:{value}", concurrency_duration=timedelta(minutes=2)
    )
    assert Job.objects.get(pk=int(leased.enqueue(1).id)).concurrency_duration == 120.0
