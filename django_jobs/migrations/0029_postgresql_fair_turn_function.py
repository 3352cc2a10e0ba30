"""PostgreSQL's fair stamp function (``db/postgresql/fair_function.py``): a fair queue's
single enqueue calls it from its one statement instead of carrying the stamp's work in that
statement, which was planned on every call without prepared statements (Django's default).
No table changes; nothing on MariaDB/MySQL or SQLite.
"""

from django.db import migrations

from django_jobs.db.postgresql.fair_function import create_function, drop_function


class Migration(migrations.Migration):
    dependencies = [("django_jobs", "0028_enqueue_procedure_head_when_needed")]

    operations = [migrations.RunPython(create_function, drop_function, elidable=False)]
