"""A fair group's stamp names the job it was given to (``FairTurn.last_job_id``), and
MySQL/MariaDB's enqueue procedure is created again to write it and to read the group's waiting
job by it (``db/enqueue_procedure.py``, ``fair_procedure_sql``).

Whether a group's last job still waits was read from the ready rows of its turn: another
group's job of the same turn (groups that arrive together share the head's turn) was taken
for the group's own, and the group stepped a turn past its due; telling them apart by each
row's job read every tie, a thousand rows for a thousand tenants. A stamp written before
this migration has no job: its group is taken as not waiting, once (it starts at the head).
"""

from django.db import migrations, models

from django_jobs.db.enqueue_procedure import follow_job_columns


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL (db/enqueue_procedure.py).
    atomic = False

    dependencies = [("django_jobs", "0024_fair_turns")]

    # The procedure created again after the column, both ways: backwards, after the column
    # is gone, as 0024's table has it (a procedure naming a missing column fails every call).
    operations = follow_job_columns(
        migrations.AddField(
            model_name="fairturn",
            name="last_job_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
    )
