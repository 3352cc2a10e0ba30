"""Fair queues (docs/fairness.md): the jobs' fair key and weight, the ready rows' turn, and
the groups' stamps.

Claims now take ready rows by priority, then ``turn``, then id: the three claim-order
indexes of the ready table are built again with ``turn`` before the id, and the ready rows
already there take ``id * 65536`` (``core.fairness.fifo_turn``), the order they had. The
ready table holds the jobs waiting now, not the history: rebuilding its indexes is quick.

On MySQL/MariaDB: the job's ``fair_key`` is added with the binary collation of the other key
columns (migration 0016; adding it first and changing its collation after would copy the job
table), the new table's queue name and key get it too, the enqueue procedure is created again
for the job's new columns and to write the turn, and the claim procedure (0014, 0023's) to
read in the new order.
"""

import importlib

import django.utils.timezone
from django.db import migrations, models

import django_jobs.db.indexes
from django_jobs.db.enqueue_procedure import follow_job_columns
from django_jobs.db.procedures import install_procedure

binary_keys = importlib.import_module("django_jobs.migrations.0016_mysql_binary_keys")
claim_procedure = importlib.import_module("django_jobs.migrations.0014_mysql_claim_procedure")
process_read = importlib.import_module("django_jobs.migrations.0023_claims_lock_their_process_row")

FAIR_KEY = models.CharField(blank=True, max_length=255, null=True)

# The new table's columns that hold a queue name or a key: binary on MySQL/MariaDB, as 0016
# and 0018 made every other such column.
FAIR_TURN_COLUMNS = {"FairTurn": ("queue_name", "fair_key")}

OLD_ORDER = "ORDER BY r.priority DESC, r.job_id ASC"
NEW_ORDER = "ORDER BY r.priority DESC, r.turn ASC, r.job_id ASC"


def add_fair_key(apps, schema_editor) -> None:
    job = apps.get_model("django_jobs", "Job")
    field = FAIR_KEY.clone()
    field.set_attributes_from_name("fair_key")
    if schema_editor.connection.vendor != "mysql":
        schema_editor.add_field(job, field)
        return
    table = job._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT character_set_name, collation_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s "
            "AND column_name = 'concurrency_key'",
            [table],
        )
        charset, collation = cursor.fetchone()
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"ALTER TABLE {quote(table)} ADD COLUMN {quote('fair_key')} varchar(255) "
        f"CHARACTER SET {charset} COLLATE {collation} NULL"
    )


def remove_fair_key(apps, schema_editor) -> None:
    # By name: going back, the state this runs in no longer has the field.
    quote = schema_editor.quote_name
    table = apps.get_model("django_jobs", "Job")._meta.db_table
    schema_editor.execute(f"ALTER TABLE {quote(table)} DROP COLUMN {quote('fair_key')}")


def fifo_turns(apps, schema_editor) -> None:
    ready = apps.get_model("django_jobs", "ReadyExecution")
    ready.objects.using(schema_editor.connection.alias).update(turn=models.F("job_id") * 65536)


def binary_fair_columns(apps, schema_editor) -> None:
    binary_keys.binary_keys(apps, schema_editor, FAIR_TURN_COLUMNS)


def claim_sql(apps, schema_editor) -> str:
    sql = process_read.procedure_sql(apps, schema_editor)
    assert sql.count(OLD_ORDER) == 2, "0014's claim order changed"
    return sql.replace(OLD_ORDER, NEW_ORDER)


def create_claim_procedure(apps, schema_editor) -> None:
    install_procedure(
        schema_editor,
        claim_procedure.PROCEDURE,
        lambda: claim_sql(apps, schema_editor),
        migration="0024",
        without_it="claims take seven round trips instead of one",
    )


# The claim procedure as this migration creates it, by the names tests and later migrations use.
create_procedure = create_claim_procedure
drop_procedure = process_read.drop_procedure


class Migration(migrations.Migration):
    # MySQL commits around DDL by itself; Django refuses DDL inside its transaction there.
    atomic = False
    dependencies = [("django_jobs", "0023_claims_lock_their_process_row")]

    operations = [
        migrations.CreateModel(
            name="FairTurn",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue_name", models.CharField(max_length=128)),
                ("priority", models.SmallIntegerField(default=0)),
                ("fair_key", models.CharField(blank=True, max_length=255)),
                ("last_turn", models.BigIntegerField(blank=True, null=True)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
        ),
        migrations.RunPython(binary_fair_columns, migrations.RunPython.noop, elidable=False),
        migrations.AddConstraint(
            model_name="fairturn",
            constraint=models.UniqueConstraint(
                fields=("queue_name", "priority", "fair_key"), name="jobs_fair_turn_group"
            ),
        ),
        migrations.RemoveIndex(model_name="readyexecution", name="jobs_ready_poll"),
        migrations.RemoveIndex(model_name="readyexecution", name="jobs_ready_order"),
        migrations.RemoveIndex(model_name="readyexecution", name="jobs_ready_async"),
        *follow_job_columns(
            migrations.SeparateDatabaseAndState(
                database_operations=[
                    migrations.RunPython(add_fair_key, remove_fair_key, elidable=False)
                ],
                state_operations=[
                    migrations.AddField(model_name="job", name="fair_key", field=FAIR_KEY),
                ],
            ),
            migrations.AddField(
                model_name="job",
                name="fair_weight",
                field=models.FloatField(blank=True, null=True),
            ),
            migrations.AddField(
                model_name="readyexecution",
                name="turn",
                field=models.BigIntegerField(db_default=0, default=0),
            ),
        ),
        migrations.RunPython(fifo_turns, migrations.RunPython.noop, elidable=False),
        migrations.AddIndex(
            model_name="readyexecution",
            index=models.Index(
                fields=["queue_name", "-priority", "turn", "job"], name="jobs_ready_poll"
            ),
        ),
        migrations.AddIndex(
            model_name="readyexecution",
            index=models.Index(fields=["-priority", "turn", "job"], name="jobs_ready_order"),
        ),
        migrations.AddIndex(
            model_name="readyexecution",
            index=django_jobs.db.indexes.FlagIndex(
                fields=["-priority", "turn", "job"], flag="is_async", name="jobs_ready_async"
            ),
        ),
        migrations.RunPython(create_claim_procedure, process_read.create_procedure, elidable=False),
    ]
