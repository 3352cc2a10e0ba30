"""Queue names and recurring task keys that differ only in case, accents or trailing spaces are
different names, on every database: a worker of one queue never claims another's jobs, a pause
holds one queue only, and two recurring tasks keep two rows.

On MySQL/MariaDB a table's default collation made them one (migration 0018 says what went
wrong)."""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.db import IntegrityError, connection, transaction

from django_jobs.core.operator import pause_queue, resume_queue
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.db.lookups import ExactStartsWith
from django_jobs.models import Job, RecurringTask
from tests.factories import ReadyExecutionFactory
from tests.test_key_case import no_pad

DB = "default"
# One queue, written four ways no byte-exact comparison confuses.
NAMES = ["emails", "Emails", "emaïls", "EMAILS"]


def names() -> list[str]:
    return [*NAMES, "emails "] if no_pad() else NAMES


def ready_job(queue_name: str) -> int:
    return ReadyExecutionFactory(job__queue_name=queue_name).job_id


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("start", [False, True], ids=["claim", "claim=start"])
@pytest.mark.parametrize("prefix", [False, True], ids=["name", "prefix"])
def test_a_worker_of_one_queue_claims_only_its_own_jobs(start, prefix):
    """Each queue's worker claims its own job and none of the others' (a named claim runs
    through MySQL/MariaDB's procedure, a prefix through a LIKE), by a claim that starts the
    jobs and by one that only claims them. A prefix takes the queues that begin with it,
    byte for byte ("emails*" takes "emails " too)."""
    worker = register_process(DB, "worker")
    for name in names():
        jobs = {other: ready_job(other) for other in names()}
        selector = QueueSelector((f"{name}*" if prefix else name,))
        claimed = claim_jobs(DB, worker.pk, selector, 10, worker_id=worker.name if start else None)
        expected = [
            job_id
            for other, job_id in jobs.items()
            if (other.startswith(name) if prefix else other == name)
        ]
        assert sorted(job.pk for job in claimed) == sorted(expected), name
        Job.objects.all().delete()


@pytest.mark.django_db(transaction=True)
def test_a_pause_holds_one_queue_only():
    worker = register_process(DB, "worker")
    jobs = {name: ready_job(name) for name in names()}
    assert pause_queue(DB, "emails")
    for name in names():
        # Every other spelling is a queue of its own: it can be paused as well.
        assert pause_queue(DB, name) is (name != "emails")
    assert claim_jobs(DB, worker.pk, QueueSelector(("*",)), 10) == []
    assert pause_queue(DB, "emails") is False
    assert resume_queue(DB, "emails")
    claimed = claim_jobs(DB, worker.pk, QueueSelector(("*",)), 10)
    assert [job.pk for job in claimed] == [jobs["emails"]]


@pytest.mark.django_db
def test_recurring_tasks_whose_keys_differ_only_in_case_are_two_tasks():
    for key in names():
        RecurringTask.objects.create(key=key, task_path="tests.tasks.add", schedule="@hourly")
    assert sorted(RecurringTask.objects.values_list("key", flat=True)) == sorted(names())
    # The same key again is refused: the unique key still holds.
    with pytest.raises(IntegrityError), transaction.atomic():
        RecurringTask.objects.create(key="emails", task_path="tests.tasks.add", schedule="@daily")


def test_every_queue_name_field_has_both_fixes():
    """models.py's list of the queue name fields and migration 0018's columns name the same
    fields: a model given a ``queue_name`` later needs both (the exact prefix everywhere,
    the binary collation on MySQL/MariaDB)."""
    queue_columns = import_module("django_jobs.migrations.0018_mysql_binary_queue_names")
    fields = [
        field
        for model in apps.get_app_config("django_jobs").get_models()
        if not model._meta.proxy
        for field in model._meta.concrete_fields
        if field.name == "queue_name"
    ]
    fair_turns = import_module("django_jobs.migrations.0024_fair_turns")  # a later table's
    binary = {**queue_columns.QUEUE_COLUMNS, **fair_turns.FAIR_TURN_COLUMNS}
    assert {field.model.__name__ for field in fields} == {
        model for model, names in binary.items() if "queue_name" in names
    }
    assert all(field.get_lookup("startswith") is ExactStartsWith for field in fields)


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL/MariaDB's collations")
@pytest.mark.django_db
def test_every_queue_column_has_the_key_columns_binary_collation():
    """Every queue column and recurring key compares by bytes, all of them alike and alike
    with the key columns (0016): a later migration altering one of these fields must keep
    its collation."""
    # Each migration's own reading of its columns (it takes a schema editor for its connection).
    editor = SimpleNamespace(connection=connection)
    found = {
        collation
        for migration in ("0016_mysql_binary_keys", "0018_mysql_binary_queue_names")
        for *_, collation in import_module(f"django_jobs.migrations.{migration}").columns(
            apps, editor
        )
    }
    # 0024's: the fair groups' table, and the job's fair key (added binary).
    binary_keys = import_module("django_jobs.migrations.0016_mysql_binary_keys")
    fair = {"FairTurn": ("queue_name", "fair_key"), "Job": ("fair_key",)}
    found |= {collation for *_, collation in binary_keys.columns(apps, editor, fair)}
    assert len(found) == 1
    (collation,) = found
    assert collation.endswith("_bin")
