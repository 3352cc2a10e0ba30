"""PostgreSQL only: every insert into the ready table sends a NOTIFY that wakes idle workers.

A statement-level AFTER INSERT trigger, so every path that makes a job ready
(enqueue, bulk enqueue, promotion of a scheduled job, retry, hand-back,
promotion of a blocked job) notifies, with no extra round trip from Python.
PostgreSQL delivers a NOTIFY only when its transaction commits, and never if it
rolls back. The payload is a JSON array of the queue names the statement made
ready, so a worker can ignore queues it does not serve; an array too long for a
payload (8000 bytes) is sent as ``[]``, which every worker takes as "any queue".
Identical notifications of one transaction are folded into one by PostgreSQL.

The channel name is fixed (``django_jobs_ready``, ``listener.CHANNEL``):
notifications never cross databases. On other databases this migration does
nothing; workers poll there.
"""

from django.db import migrations

CHANNEL = "django_jobs_ready"
FUNCTION = "django_jobs_notify_ready"
TRIGGER = "django_jobs_ready_notify"


def table(apps, schema_editor) -> str:
    model = apps.get_model("django_jobs", "ReadyExecution")
    return schema_editor.quote_name(model._meta.db_table)


def create_trigger(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"""
        CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            queues text;
        BEGIN
            SELECT to_json(array_agg(DISTINCT queue_name))::text INTO queues FROM new_rows;
            IF queues IS NOT NULL THEN
                IF octet_length(queues) > 7900 THEN
                    queues := '[]';
                END IF;
                PERFORM pg_notify('{CHANNEL}', queues);
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
    schema_editor.execute(
        f"""
        CREATE TRIGGER {TRIGGER} AFTER INSERT ON {table(apps, schema_editor)}
        REFERENCING NEW TABLE AS new_rows
        FOR EACH STATEMENT EXECUTE FUNCTION {FUNCTION}()
        """
    )


def drop_trigger(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON {table(apps, schema_editor)}")
    schema_editor.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0003_batches_unique_recurring"),
    ]

    operations = [
        migrations.RunPython(create_trigger, drop_trigger, elidable=False),
    ]
