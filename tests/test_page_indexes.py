"""A batch's and a workflow's first rows by id are an index range on every database
(migration 0021): the indexes end with the job's id (explicitly on PostgreSQL, by the
primary key every secondary index ends with elsewhere), and the workflow page reads its
first jobs per status, from the ``(workflow, status, id)`` range of each."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_jobs.admin import workflows as workflows_admin
from django_jobs.models import Job, JobStatus, Workflow
from tests.factories import FinishedJobFactory, JobFactory

pytestmark = pytest.mark.django_db

DB = "default"


def index_columns(name: str) -> list[str]:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, Job._meta.db_table)
    return constraints[name]["columns"]


@pytest.mark.parametrize(
    ("name", "leading"),
    [("jobs_job_batch", ["batch_id"]), ("jobs_job_workflow_nodes", ["workflow_id", "status"])],
)
def test_the_batch_and_workflow_indexes_order_their_rows_by_id(name, leading):
    columns = index_columns(name)
    if connection.vendor == "postgresql":
        assert columns == [*leading, "id"]
    else:  # the primary key ends the index already; 0021 leaves it as it was
        assert columns[: len(leading)] == leading and columns[len(leading) :] in ([], ["id"])


def test_a_workflows_first_jobs_by_id_are_read_per_status_and_merged():
    workflow = Workflow.objects.create(name="mixed")
    statuses = [JobStatus.SUCCEEDED, JobStatus.READY, JobStatus.FAILED, JobStatus.AWAITING]
    ids = []
    for n in range(12):
        status = statuses[n % len(statuses)]
        factory = (
            FinishedJobFactory if status in (JobStatus.SUCCEEDED, JobStatus.FAILED) else JobFactory
        )
        ids.append(factory(workflow=workflow, status=status).pk)
    FinishedJobFactory(workflow=Workflow.objects.create(name="other"))
    with CaptureQueriesContext(connection) as captured:
        first = workflows_admin.first_jobs(DB, workflow.pk, [*statuses, JobStatus.RUNNING], 5)
    assert [job.pk for job in first] == sorted(ids)[:5]
    assert len(captured.captured_queries) == 5
    for query in captured.captured_queries:
        sql = query["sql"]
        assert '"status" = ' in sql.replace("`", '"') and "LIMIT 5" in sql, sql
