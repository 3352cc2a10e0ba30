"""MySQL/MariaDB's enqueue procedure created again (``db/enqueue_procedure.py``): it reads a
fair group's last job's ready row with ``SELECT ... INTO``, which locks nothing (its ``IF
EXISTS`` subquery held a shared lock on that row to the enqueue's commit, which a claim's SKIP
LOCKED passed over); a job whose group's last job still waits at the stamp's turn takes the
turn a step after it without reading the queue's head (which is at or before that turn); and
the head, where it is needed, is read after the stamp's lock instead of before it. The head's
read cost as much as the stamp's write (bench/fair_floor.py). No table changes; nothing on
PostgreSQL or SQLite.
"""

from django.db import migrations

from django_jobs.db.enqueue_procedure import follow_job_columns


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL (db/enqueue_procedure.py).
    atomic = False

    dependencies = [("django_jobs", "0027_enqueue_procedure_head_index")]

    # Both ways the procedure is made from the code as it stands, for the table as it is.
    operations = follow_job_columns()
