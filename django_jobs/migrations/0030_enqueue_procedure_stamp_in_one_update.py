"""MySQL/MariaDB's enqueue procedure created again (``db/enqueue_procedure.py``): a job of a
fair group whose last job waits at its stamp's turn is stamped by one UPDATE of the stamp,
whose WHERE reads that job's ready row, instead of a locking read, a read of the job's row and
the write; the ready row's insert reads the turn it wrote. No table changes; nothing on
PostgreSQL or SQLite.
"""

from django.db import migrations

from django_jobs.db.enqueue_procedure import follow_job_columns


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL (db/enqueue_procedure.py).
    atomic = False

    dependencies = [("django_jobs", "0029_postgresql_fair_turn_function")]

    # Both ways the procedure is made from the code as it stands, for the table as it is.
    operations = follow_job_columns()
