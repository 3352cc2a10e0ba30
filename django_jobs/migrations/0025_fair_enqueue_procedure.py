"""MySQL/MariaDB: the enqueue procedure created again, its fair branch as it now stands
(``db/enqueue_procedure.py``, ``fair_procedure_sql``): a group whose stamp equals another
group's waiting turn is no longer taken for waiting, and the stamp takes three statements
instead of five. No table changes; a no-op elsewhere. Backwards, the procedure is created
again from the same source, which serves migration 0024's tables as well."""

from django.db import migrations

from django_jobs.db.enqueue_procedure import create_procedure


class Migration(migrations.Migration):
    # The procedure's DDL commits by itself on MySQL (db/enqueue_procedure.py).
    atomic = False

    dependencies = [("django_jobs", "0024_fair_turns")]

    operations = [
        migrations.RunPython(create_procedure, create_procedure, atomic=False, elidable=False),
    ]
