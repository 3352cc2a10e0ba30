"""MySQL/MariaDB's enqueue procedure created again (``db/enqueue_procedure.py``): its read of
a fair queue's head names the index it reads, ``jobs_ready_poll``. Left to choose, MariaDB
took ``jobs_ready_order`` and walked the ready rows of every other queue at that priority
with a lower turn, per fair enqueue. No table changes; nothing on PostgreSQL or SQLite.
"""

from django.db import migrations

from django_jobs.db.enqueue_procedure import follow_job_columns


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL (db/enqueue_procedure.py).
    atomic = False

    dependencies = [("django_jobs", "0026_enqueue_procedure_hand_set_stamp")]

    # Both ways the procedure is made from the code as it stands, for the table as it is.
    operations = follow_job_columns()
