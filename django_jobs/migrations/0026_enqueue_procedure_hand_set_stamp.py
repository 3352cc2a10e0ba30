"""MySQL/MariaDB's enqueue procedure created again (``db/enqueue_procedure.py``): a fair
group's stamp whose turn was set to -1 by hand is a broken stamp (its job takes its FIFO turn,
with a warning), as on every other path, not a group without a stamp. -1 is what the
procedure writes into a row it has just made; it now tells its own row by having made it.
No table changes; nothing on PostgreSQL or SQLite.
"""

from django.db import migrations

from django_jobs.db.enqueue_procedure import follow_job_columns


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL (db/enqueue_procedure.py).
    atomic = False

    dependencies = [("django_jobs", "0025_fair_turn_last_job")]

    # Both ways the procedure is made from the code as it stands, for the table as it is.
    operations = follow_job_columns()
