"""The job list's state filter, newest first, on every database (``jobs_job_status_newest``,
status then id descending), and the indexes of the admin's search
(django_jobs/admin/search.py), on PostgreSQL only: a
``varchar_pattern_ops`` index of the task path (``task:`` prefixes) and GIN indexes of the
arguments (``name=value``, ``arg:``). Built ``CONCURRENTLY``, so enqueues and workers go on
while a big table is indexed (django_jobs/db/online_index.py); on MySQL/MariaDB online DDL
(``ALGORITHM=INPLACE, LOCK=NONE``), on SQLite as usual. MySQL/MariaDB and SQLite get the
state index only: their search uses ``jobs_job_task_path`` and a bounded scan.
"""

from django.db import migrations, models

import django_jobs.db.indexes
import django_jobs.db.online_index


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY cannot run inside a transaction.
    atomic = False

    dependencies = [
        ("django_jobs", "0019_job_references_without_constraints"),
    ]

    operations = [
        django_jobs.db.online_index.AddIndexOnline(
            model_name="job",
            index=models.Index(fields=["status", "-id"], name="jobs_job_status_newest"),
        ),
        django_jobs.db.online_index.AddIndexOnline(
            model_name="job",
            index=django_jobs.db.indexes.PostgresIndex(
                fields=["task_path"],
                name="jobs_job_task_prefix",
                opclasses=["varchar_pattern_ops"],
            ),
        ),
        django_jobs.db.online_index.AddIndexOnline(
            model_name="job",
            index=django_jobs.db.indexes.PostgresIndex(
                fields=["kwargs"], name="jobs_job_kwargs_gin", method="gin"
            ),
        ),
        django_jobs.db.online_index.AddIndexOnline(
            model_name="job",
            index=django_jobs.db.indexes.PostgresIndex(
                fields=["args"], name="jobs_job_args_gin", method="gin"
            ),
        ),
    ]
