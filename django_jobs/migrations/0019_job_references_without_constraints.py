"""No table points at a job with a database foreign key any more (``Job``'s docstring says
why: PostgreSQL's per-row checks were nine tenths of the prune's cost).

Dropping a constraint reads no row, but takes a short exclusive lock on each execution
table and on the job table: behind a long query on one of them it would queue the
workers. On PostgreSQL the migration therefore gives up after 5 seconds of waiting
(``lock_timeout``) and can simply be run again (docs/deployment.md, "Upgrading").
"""

import django.db.models.deletion
from django.db import migrations, models

LOCK_TIMEOUT = "5s"


def limit_lock_waits(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")


def reference(related_name: str) -> models.OneToOneField:
    return models.OneToOneField(
        db_constraint=False,
        on_delete=django.db.models.deletion.CASCADE,
        primary_key=True,
        related_name=related_name,
        serialize=False,
        to="django_jobs.job",
    )


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0018_mysql_binary_queue_names"),
    ]

    operations = [
        migrations.RunPython(limit_lock_waits, migrations.RunPython.noop, elidable=True),
        *(
            migrations.AlterField(
                model_name=f"{state}execution", name="job", field=reference(f"{state}_execution")
            )
            for state in ("awaiting", "blocked", "claimed", "ready", "scheduled")
        ),
        migrations.AlterField(
            model_name="failedexecution",
            name="job",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="failures",
                to="django_jobs.job",
            ),
        ),
    ]
