"""A job says whether its task is ``async def`` (``Job.is_async``, copied to its ready row), so
that a worker with room on its event loop alone claims async jobs only (core/lanes.py).

Both columns have a database default (false), so adding them rewrites no table on
PostgreSQL (11 and later) or MariaDB (10.3 and later): existing jobs read as sync ones and
run as they always did. MySQL/MariaDB's enqueue procedure takes the job's columns: it is
created again after the change, both ways (``follow_job_columns``), and writes the ready
row's copy once the ready table has the column (``db/enqueue_procedure.py``).

The async lane's index (``jobs_ready_async``, ``db/indexes.FlagIndex``) holds the async ready
rows where the database has partial indexes; on MySQL/MariaDB every ready row, led by
``is_async``. It is built without blocking writes (``AddIndexOnline``: concurrently on
PostgreSQL, ``ALGORITHM=INPLACE, LOCK=NONE`` on MariaDB/MySQL).
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
            index=django_jobs.db.indexes.FlagIndex(
                fields=["-priority", "job"], flag="is_async", name="jobs_ready_async"
            ),
        ),
    )
