"""The index of a batch's items, and of a workflow's jobs by status, end with the job's id,
so that a page's first rows (``ORDER BY id LIMIT n``) are an index range.

MySQL, MariaDB and SQLite end every secondary index with the primary key already: there
the indexes are left as they are, and only Django's record of them changes. PostgreSQL
does not: asked for a batch's first 51 items by id, it walked the primary key from the
table's first job, filtering (2.7 s for a 100,000-item batch behind 3,000,000 finished
jobs, 10 times that at 30,000,000). There each index is rebuilt without locking the
table: built ``CONCURRENTLY`` under a new name, the old one dropped ``CONCURRENTLY``, the
new one renamed. Non-atomic, as ``CONCURRENTLY`` must run outside a transaction; run
again after an interruption, it starts by dropping a half-built index.
"""

from django.db import migrations

import django_jobs.db.indexes

TABLE = "django_jobs_job"
# (index, its columns, the column it holds the non-NULL rows of)
REBUILT = [
    ("jobs_job_batch", ["batch_id", "id"], "batch_id"),
    ("jobs_job_workflow_nodes", ["workflow_id", "status", "id"], "workflow_id"),
]


def rebuild_sql(name: str, columns: list[str], not_null: str) -> list[str]:
    building = f"{name}_rebuilt"
    quoted = ", ".join(f'"{column}"' for column in columns)
    return [
        f'DROP INDEX CONCURRENTLY IF EXISTS "{building}"',
        f'CREATE INDEX CONCURRENTLY "{building}" ON "{TABLE}" ({quoted}) '
        f'WHERE "{not_null}" IS NOT NULL',
        f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"',
        f'ALTER INDEX "{building}" RENAME TO "{name}"',
    ]


def rebuild(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, columns, not_null in REBUILT:
        for statement in rebuild_sql(name, columns, not_null):
            schema_editor.execute(statement)


def restore(apps, schema_editor) -> None:
    """Back to the indexes of 0017 (the batch alone; the workflow and status)."""
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, columns, not_null in REBUILT:
        for statement in rebuild_sql(name, columns[:-1], not_null):
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_jobs", "0020_search_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(rebuild, restore, elidable=False)],
            state_operations=[
                migrations.RemoveIndex(model_name="job", name="jobs_job_batch"),
                migrations.AddIndex(
                    model_name="job",
                    index=django_jobs.db.indexes.NotNullIndex(
                        fields=["batch", "id"], name="jobs_job_batch"
                    ),
                ),
                migrations.RemoveIndex(model_name="job", name="jobs_job_workflow_nodes"),
                migrations.AddIndex(
                    model_name="job",
                    index=django_jobs.db.indexes.NotNullIndex(
                        fields=["workflow", "status", "id"], name="jobs_job_workflow_nodes"
                    ),
                ),
            ],
        ),
    ]
