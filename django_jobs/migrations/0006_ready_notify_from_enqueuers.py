"""PostgreSQL only: drop migration 0004's NOTIFY trigger; enqueuers notify after commit instead.

The trigger sent ``pg_notify`` inside every transaction that made a job ready.
PostgreSQL serialises the commits of notifying transactions (one lock for the
whole server, held through the commit's WAL flush), so concurrent enqueues
committed one after another. ``django_jobs.notify`` now sends the notification
from a connection of its own once the enqueuing transaction has committed (see
docs/running.md). Reversing this migration puts the trigger back, as 0004 made
it. On other databases this migration does nothing.
"""

from django.db import migrations

CHANNEL = "django_jobs_ready"
FUNCTION = "django_jobs_notify_ready"
TRIGGER = "django_jobs_ready_notify"


def table(apps, schema_editor) -> str:
    model = apps.get_model("django_jobs", "ReadyExecution")
    return schema_editor.quote_name(model._meta.db_table)


def drop_trigger(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON {table(apps, schema_editor)}")
    schema_editor.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")


def create_trigger(apps, schema_editor) -> None:
    """Migration 0004's trigger, as it was."""
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


class Migration(migrations.Migration):
    dependencies = [
        ("django_jobs", "0005_ready_claim_order_index"),
    ]

    operations = [
        migrations.RunPython(drop_trigger, create_trigger, elidable=False),
    ]
