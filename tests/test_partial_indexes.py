"""The indexes of the mostly-NULL key columns (``django_jobs.db.indexes.NotNullIndex``).

Where the database has partial indexes they leave the NULL rows out, and the lookups our
code makes by those columns (a value, or a list of values) can still use them; on
MySQL/MariaDB they are plain indexes, built without the warning (``models.W037``) that an
``Index(condition=...)`` gives there at every ``migrate``.
"""

from __future__ import annotations

import pytest
from django.core import checks
from django.db import IntegrityError, connection, transaction
from django.db.models import QuerySet

from django_jobs.models import ClaimedExecution, Job, JobStatus, ReadyExecution

# Each index: the column it leaves the NULLs of out, and a lookup of ours that must use it.
LOOKUPS = {
    "jobs_job_concurrency_keyed": (
        "concurrency_key",
        lambda: Job.objects.filter(concurrency_key="k"),
    ),
    "jobs_job_unique_keyed": ("unique_key", lambda: Job.objects.filter(unique_key__in=["u", "v"])),
    "jobs_job_unique_lock": ("unique_lock", lambda: Job.objects.filter(unique_lock="u")),
    "jobs_job_batch": ("batch_id", lambda: Job.objects.filter(batch_id=7)),
    "jobs_job_workflow_nodes": (
        "workflow_id",
        lambda: Job.objects.filter(workflow_id=3, status=JobStatus.BLOCKED),
    ),
    "jobs_ready_keyed": (
        "concurrency_key",
        lambda: ReadyExecution.objects.filter(concurrency_key__in=["k", "l"]),
    ),
    "jobs_claimed_keyed": (
        "concurrency_key",
        lambda: ClaimedExecution.objects.filter(concurrency_key="k"),
    ),
}


def index_sql(name: str) -> str:
    """What the database says index ``name`` is: its definition, without quotes and
    parentheses, or (MySQL/MariaDB) its columns."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [name])
        elif connection.vendor == "sqlite":
            cursor.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = %s", [name]
            )
        else:
            cursor.execute(
                "SELECT GROUP_CONCAT(column_name ORDER BY seq_in_index) "
                "FROM information_schema.statistics "
                "WHERE table_schema = DATABASE() AND index_name = %s",
                [name],
            )
        row = cursor.fetchone()
    assert row is not None and row[0], f"no index {name}"
    return "".join(c for c in row[0] if c not in '"()')


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_a_key_index_leaves_out_the_rows_without_a_key_where_the_database_can(name):
    column, _ = LOOKUPS[name]
    sql = index_sql(name)
    if connection.features.supports_partial_indexes:
        assert sql.endswith(f" WHERE {column} IS NOT NULL"), sql
    else:
        assert sql.split(",")[0] == column, sql  # a plain index, led by the column


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_our_lookups_by_a_key_can_use_its_index(name):
    """With sequential scans priced out, a lookup that the index's condition did not cover
    would still scan the table: the plan names the index only if the planner proved that
    a row it matches has a value."""
    # A holder of "u": on an empty table MySQL/MariaDB read the unique index at once and
    # say only "Impossible WHERE".
    Job.objects.create(task_path="t", unique_key="u", unique_lock="u")
    queryset: QuerySet = LOOKUPS[name][1]()
    if connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            plan = queryset.explain()
    else:
        plan = queryset.explain()
    assert name in plan, plan


@pytest.mark.django_db(databases=["default"])
def test_no_warning_about_index_conditions_on_any_database():
    found = checks.run_checks(databases=["default"], include_deployment_checks=False)
    assert [message for message in found if message.id in ("models.W037", "models.W036")] == []


@pytest.mark.django_db
def test_unique_lock_has_one_index_and_it_still_refuses_a_second_holder_not_a_second_null():
    Job.objects.create(task_path="t")
    Job.objects.create(task_path="t")  # NULLs: never a conflict, partial index or not
    Job.objects.create(task_path="t", unique_key="u", unique_lock="u")
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.create(task_path="t", unique_key="u", unique_lock="u")
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
                [Job._meta.db_table, "%(unique_lock%"],
            )
            assert [row[0] for row in cursor.fetchall()] == ["jobs_job_unique_lock"]
