"""A job says whether its task is ``async def`` (``Job.is_async``, copied to its ready row), so
that a worker with room on its event loop alone claims async jobs only (core/lanes.py).

Both columns have a database default (false), so adding them rewrites no table on
PostgreSQL (11 and later) or MariaDB (10.3 and later): existing jobs read as sync ones and
run as they always did. The async ready rows' index (``jobs_ready_async``) is partial,
built on PostgreSQL (concurrently) and SQLite only. MySQL/MariaDB's enqueue procedure takes
the job's columns: it is created again after the change, both ways (``follow_job_columns``),
and writes the ready row's copy once the ready table has the column
(``db/enqueue_procedure.py``).
"""

from django.db import migrations, models

import django_jobs.db.indexes
import django_jobs.db.online_index
from django_jobs.db.enqueue_procedure import follow_job_columns


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL/MariaDB.
    atomic = False

    dependencies = [("django_jobs", "0021_page_indexes")]

    operations = follow_job_columns(
        migrations.AddField(
            model_name="job",
            name="is_async",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddField(
            model_name="readyexecution",
            name="is_async",
            field=models.BooleanField(db_default=False, default=False),
        ),
        django_jobs.db.online_index.AddIndexOnline(
            model_name="readyexecution",
            index=django_jobs.db.indexes.TrueOnlyIndex(
                fields=["-priority", "job"], name="jobs_ready_async", flag="is_async"
            ),
        ),
    )
