"""MySQL/MariaDB only: a stored procedure that enqueues one ready job in one round trip.

A job ready at once needs its job row and its ready row, written together. Through
statements that is START TRANSACTION, two INSERTs and COMMIT: four round trips where
a plain ``Model.objects.create`` takes one, so a single enqueue in a web request cost
twice the time of django-tasks-db's. ``CALL django_jobs_enqueue_ready(...)`` writes
both in one: in a transaction of its own when the caller is in autocommit, else under
a savepoint of the caller's transaction, rolled back on any error (``db/mysql.py``,
``enqueue_ready``). On PostgreSQL one statement already does it (a data-modifying
CTE); SQLite is in-process. Elsewhere this migration does nothing.

The parameters are the job table's columns, in order, typed and with the character
set of each column as it stands at this migration (read from information_schema),
so a value reaches its column exactly as the ORM's INSERT would send it. A migration
that adds a job column replaces the procedure (tests/test_db_conformance.py fails
until it does); until then the code takes the statements' path for a job that sets
the new column (``db/mysql.py`` checks).
"""

import logging

from django.db import DatabaseError, migrations

PROCEDURE = "django_jobs_enqueue_ready"
SAVEPOINT = "django_jobs_enqueue"
# The server's refusals for want of a privilege (access denied to the database, command
# denied, privilege needed, SUPER needed with binary logging): the migration goes on.
NOT_ALLOWED = (1044, 1142, 1227, 1419)


def columns(apps, schema_editor) -> list[tuple[str, str, str | None]]:
    """(name, type, character set) of each job column but the id, in table order."""
    table = apps.get_model("django_jobs", "Job")._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name, column_type, character_set_name "
            "FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s AND column_name <> 'id' "
            "ORDER BY ordinal_position",
            [table],
        )
        return list(cursor.fetchall())


def procedure_sql(apps, schema_editor) -> str:
    quote = schema_editor.quote_name
    job = quote(apps.get_model("django_jobs", "Job")._meta.db_table)
    ready = quote(apps.get_model("django_jobs", "ReadyExecution")._meta.db_table)
    found = columns(apps, schema_editor)
    params = ",\n  ".join(
        f"IN p_{name} {kind}" + (f" CHARACTER SET {charset}" if charset else "")
        for name, kind, charset in found
    )
    names = ", ".join(quote(name) for name, _, _ in found)
    values = ", ".join(f"p_{name}" for name, _, _ in found)
    return f"""
CREATE PROCEDURE {PROCEDURE}(
  IN own_transaction BOOLEAN,
  {params}
)
BEGIN
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    IF own_transaction THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT {SAVEPOINT}; END IF;
    RESIGNAL;
  END;
  IF own_transaction THEN START TRANSACTION; ELSE SAVEPOINT {SAVEPOINT}; END IF;
  INSERT INTO {job} ({names}) VALUES ({values});
  INSERT INTO {ready} (job_id, queue_name, priority, concurrency_key, created_at)
    VALUES (LAST_INSERT_ID(), p_queue_name, p_priority, NULL, p_enqueued_at);
  IF own_transaction THEN COMMIT; ELSE RELEASE SAVEPOINT {SAVEPOINT}; END IF;
  SELECT LAST_INSERT_ID();
END
"""


def create_procedure(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    try:
        schema_editor.execute(f"DROP PROCEDURE IF EXISTS {PROCEDURE}")
        schema_editor.execute(procedure_sql(apps, schema_editor))
    except DatabaseError as exc:
        if not exc.args or exc.args[0] not in NOT_ALLOWED:
            raise
        # The enqueue works without it, in four round trips instead of one.
        logging.getLogger("django_jobs").warning(
            "migration 0013: the database user may not create the procedure %s (%s); "
            "single enqueues take four round trips instead of one (docs/deployment.md)",
            PROCEDURE,
            exc,
        )


def drop_procedure(apps, schema_editor) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    schema_editor.execute(f"DROP PROCEDURE IF EXISTS {PROCEDURE}")


class Migration(migrations.Migration):
    # MySQL commits around DDL by itself; Django refuses DDL inside its transaction there.
    atomic = False
    dependencies = [("django_jobs", "0012_workflows")]

    operations = [migrations.RunPython(create_procedure, drop_procedure, elidable=False)]
