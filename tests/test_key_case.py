"""Keys that differ only in case, accents or trailing spaces are different keys, on every
database: each gets its own concurrency slot, rate window and unique lock.

On MySQL/MariaDB a table's default collation made them one key (migration 0016 says what
went wrong: a rate-limited job whose key's row was stored in another case was sent back to
wait at every start, for ever)."""

from __future__ import annotations

import pytest
from django.db import connection

from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.models import Job, JobStatus, RateLimit, Semaphore
from tests import rate_tasks, workflow_tasks

DB = "default"
ALL = QueueSelector(("*",))
# One account, written four ways no byte-exact comparison confuses.
ACCOUNTS = ["acme", "Acme", "acmé", "ACME"]


def no_pad() -> bool:
    """Whether this server compares "acme " and "acme" as different (PostgreSQL and SQLite
    always; MySQL/MariaDB where it has a binary no-pad collation, migration 0016)."""
    if connection.vendor != "mysql":
        return True
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT collation_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = 'key'",
            [RateLimit._meta.db_table],
        )
        (collation,) = cursor.fetchone()
        cursor.execute(f"SELECT 'acme' = 'acme ' COLLATE {collation}")
        (same,) = cursor.fetchone()
    return not same


def accounts() -> list[str]:
    return [*ACCOUNTS, "acme "] if no_pad() else ACCOUNTS


@pytest.mark.django_db(transaction=True)
def test_rate_keys_differing_only_in_case_each_start_in_a_window_of_their_own():
    worker = register_process(DB, "worker")
    names = accounts()
    for account in names:
        rate_tasks.call_api.enqueue(account)
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    started = start_jobs(DB, claimed, worker.pk, worker.name)
    assert sorted(job.rate_key for job in started) == sorted(
        f"{rate_tasks.call_api.module_path}/{account}" for account in names
    )
    assert sorted(RateLimit.objects.values_list("key", flat=True)) == sorted(
        job.rate_key for job in started
    )
    assert all(len(starts) == 1 for starts in RateLimit.objects.values_list("starts", flat=True))


@pytest.mark.django_db(transaction=True)
def test_concurrency_keys_differing_only_in_case_each_have_a_slot():
    """Limit 1 per account: one job of each account is ready at once, none blocked."""
    names = accounts()
    for account in names:
        rate_tasks.keyed_and_rated.enqueue(account)
    assert Job.objects.filter(status=JobStatus.READY).count() == len(names)
    assert Semaphore.objects.count() == len(names)
    # A second job of one account does wait: the keys are not simply ignored.
    rate_tasks.keyed_and_rated.enqueue("acme")
    assert Job.objects.filter(status=JobStatus.BLOCKED).count() == 1


@pytest.mark.django_db
def test_unique_keys_differing_only_in_case_are_different_jobs():
    names = accounts()
    ids = {workflow_tasks.unique.enqueue(account).id for account in names}
    assert len(ids) == len(names)
    # The same key again is the same job.
    assert workflow_tasks.unique.enqueue("acme").id in ids
    assert Job.objects.count() == len(names)


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL/MariaDB's collations")
@pytest.mark.django_db
def test_every_key_column_has_one_binary_collation():
    """Every key column compares by bytes, and all of them alike (a join of two key columns
    of different collations is an "illegal mix"): a later migration altering one of these
    fields must keep its collation."""
    from importlib import import_module

    key_columns = import_module("django_jobs.migrations.0016_mysql_binary_keys").KEY_COLUMNS
    from django.apps import apps

    found = set()
    with connection.cursor() as cursor:
        for model_name, names in key_columns.items():
            table = apps.get_model("django_jobs", model_name)._meta.db_table
            for name in names:
                cursor.execute(
                    "SELECT collation_name FROM information_schema.columns "
                    "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
                    [table, name],
                )
                found.add(cursor.fetchone()[0])
    assert len(found) == 1
    (collation,) = found
    assert collation.endswith("_bin")
