"""The indexes of the mostly-NULL columns hold only the rows with a value, where the database
has partial indexes (PostgreSQL, SQLite; see ``django_jobs.db.indexes.NotNullIndex``); so
does ``unique_lock``'s unique index (``NotNullUniqueConstraint``), which also loses the LIKE
index that ``unique=True`` gave it on PostgreSQL.

Each new index, and the new unique constraint, is built before the one it replaces is
dropped: MySQL/MariaDB's DDL is not transactional, so the key is never unguarded there, and
Django does not add an index of its own for a foreign key column left without one.
"""

import django.db.models.deletion
from django.db import migrations, models

import django_jobs.db.indexes

# (model, old index, new index, its fields)
REPLACED = [
    ("job", "jobs_job_concurrency_key", "jobs_job_concurrency_keyed", ["concurrency_key"]),
    ("job", "jobs_job_unique_key", "jobs_job_unique_keyed", ["unique_key"]),
    ("job", "jobs_job_workflow", "jobs_job_workflow_nodes", ["workflow", "status"]),
    ("readyexecution", "jobs_ready_key", "jobs_ready_keyed", ["concurrency_key"]),
    ("claimedexecution", "jobs_claimed_key", "jobs_claimed_keyed", ["concurrency_key"]),
]


def replaced(
    model: str, old: str, new: str, fields: list[str]
) -> list[migrations.operations.base.Operation]:
    return [
        migrations.AddIndex(
            model_name=model,
            index=django_jobs.db.indexes.NotNullIndex(fields=fields, name=new),
        ),
        migrations.RemoveIndex(model_name=model, name=old),
    ]


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0016_mysql_binary_keys"),
    ]

    operations = [
        migrations.AddConstraint(
            model_name="job",
            constraint=django_jobs.db.indexes.NotNullUniqueConstraint(
                fields=("unique_lock",), name="jobs_job_unique_lock"
            ),
        ),
        migrations.AlterField(
            model_name="job",
            name="unique_lock",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddIndex(
            model_name="job",
            index=django_jobs.db.indexes.NotNullIndex(fields=["batch"], name="jobs_job_batch"),
        ),
        migrations.AlterField(
            model_name="job",
            name="batch",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="jobs",
                to="django_jobs.batch",
            ),
        ),
        *(operation for replacement in REPLACED for operation in replaced(*replacement)),
    ]
