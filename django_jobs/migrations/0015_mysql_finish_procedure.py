"""MySQL/MariaDB only: a stored procedure that records plain successes in one round trip.

The completer's finish of jobs with no concurrency key, no batch and no workflow is, through
statements, START TRANSACTION, the claims' locking read (``lock_held_claims``), their
DELETE, the jobs' UPDATE and COMMIT: five round trips per batch. ``CALL
django_jobs_finish_plain(...)`` does the same in one, with the same locks in the same order
(docs/design.md section 4): this process's claims of these jobs, ascending by job id, each
with its job's row (whose workflow mark is read under that lock, as an enqueue that waits
for the job last wrote it), then their DELETE and the jobs' UPDATE, each row reached by its
primary key, one statement each (MariaDB 10.11 runs no handler for a CHECK constraint's
error in a multi-table UPDATE, which left the transaction open). It finishes only the
claims it finds plain once locked (no key, no batch, no workflow) and returns their ids;
the caller finishes the others on the general path
(``core/claimed.finish_locked``), which frees slots, settles dependents and counts batches.
In a transaction of its own when the caller is in autocommit, else under a savepoint of
the caller's transaction; rolled back on any error (``db/mysql.py``, ``finish_plain``).
Elsewhere this migration does nothing.

The outcomes arrive as one JSON array of ``[job id, return value as JSON text or null]``,
ascending by id (the order the claims are locked in); every join to a table by id forces
its primary key, as in migration 0014.
"""

from django.db import migrations

from django_jobs.db.procedures import install_procedure, remove_procedure

PROCEDURE = "django_jobs_finish_plain"
SAVEPOINT = "django_jobs_finish"


def charset_of(schema_editor, table: str, name: str) -> str:
    """A column's character set clause, so a value reaches the procedure in the column's
    own encoding."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT character_set_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
            [table, name],
        )
        (charset,) = cursor.fetchone()
    return f" CHARACTER SET {charset}" if charset else ""


def procedure_sql(apps, schema_editor) -> str:
    quote = schema_editor.quote_name
    job_table = apps.get_model("django_jobs", "Job")._meta.db_table
    job = quote(job_table)
    claimed = quote(apps.get_model("django_jobs", "ClaimedExecution")._meta.db_table)
    charset = charset_of(schema_editor, job_table, "return_value")
    outcomes = (
        f"JSON_TABLE(p_outcomes, '$[*]' COLUMNS (id_ BIGINT PATH '$[0]', "
        f"value_ LONGTEXT{charset} PATH '$[1]')) AS ids_"
    )
    finished_ids = "JSON_TABLE(finished, '$[*]' COLUMNS (id_ BIGINT PATH '$')) AS done_"
    return f"""
CREATE PROCEDURE {PROCEDURE}(
  IN own_transaction BOOLEAN,
  IN p_process_id BIGINT,
  IN p_outcomes LONGTEXT{charset},
  IN p_now DATETIME(6)
)
BEGIN
  -- The ids of the claims found plain once locked, ascending.
  DECLARE finished LONGTEXT DEFAULT '[]';
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    IF own_transaction THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT {SAVEPOINT}; END IF;
    RESIGNAL;
  END;
  IF own_transaction THEN START TRANSACTION; ELSE SAVEPOINT {SAVEPOINT}; END IF;
  BEGIN
    DECLARE done BOOLEAN DEFAULT FALSE;
    DECLARE found_id BIGINT;
    DECLARE plain BOOLEAN;
    DECLARE found_value LONGTEXT{charset};
    -- This process's claims of these jobs, and their jobs, locked ascending by job id (the
    -- outcomes' order) as the cursor opens: core/claimed.finish_locked's first statement.
    DECLARE held CURSOR FOR
      SELECT c.job_id,
        COALESCE(CHAR_LENGTH(c.concurrency_key), 0) = 0 AND c.batch_id IS NULL
          AND j.workflow_id IS NULL,
        ids_.value_
      FROM {outcomes}
        STRAIGHT_JOIN {claimed} c FORCE INDEX (PRIMARY) ON c.job_id = ids_.id_
        STRAIGHT_JOIN {job} j FORCE INDEX (PRIMARY) ON j.id = c.job_id
      WHERE c.process_id = p_process_id
      FOR UPDATE;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
    OPEN held;
    -- Each plain one's claim deleted, its job succeeded with its return value (NULL for
    -- None), by primary key, one statement each: MariaDB (10.11) runs no handler for a
    -- CHECK constraint's error in a multi-table UPDATE.
    read_rows: LOOP
      FETCH held INTO found_id, plain, found_value;
      IF done THEN LEAVE read_rows; END IF;
      IF plain THEN
        DELETE FROM {claimed} WHERE job_id = found_id;
        UPDATE {job} SET status = 'succeeded', finished_at = p_now, unique_lock = NULL,
          return_value = found_value
          WHERE id = found_id;
        SET finished = JSON_ARRAY_APPEND(finished, '$', found_id);
      END IF;
    END LOOP;
    CLOSE held;
  END;
  IF own_transaction THEN COMMIT; ELSE RELEASE SAVEPOINT {SAVEPOINT}; END IF;
  SELECT done_.id_ FROM {finished_ids};
END
"""


def create_procedure(apps, schema_editor) -> None:
    install_procedure(
        schema_editor,
        PROCEDURE,
        lambda: procedure_sql(apps, schema_editor),
        migration="0015",
        without_it="finishes take five round trips instead of one",
    )


def drop_procedure(apps, schema_editor) -> None:
    remove_procedure(schema_editor, PROCEDURE)


class Migration(migrations.Migration):
    # MySQL commits around DDL by itself; Django refuses DDL inside its transaction there.
    atomic = False
    dependencies = [("django_jobs", "0014_mysql_claim_procedure")]

    operations = [migrations.RunPython(create_procedure, drop_procedure, elidable=False)]
