"""MySQL/MariaDB only: a stored procedure that claims (and starts) ready jobs in one round trip.

A worker's claim through statements is START TRANSACTION, the locking pick of the ready
rows, the jobs' locking read, the claims' INSERT, the ready rows' DELETE, the starts'
UPDATE and COMMIT: seven round trips per batch, every batch of every worker, with the
workers' CPU and the server's spent on each. ``CALL django_jobs_claim_ready(...)`` does
the same in one, with the same locks in the same order (docs/design.md section 4): the
ready rows with ``SKIP LOCKED`` in claim order (each queue of the list in turn, priority
then age, the paused ones left out), then the jobs ascending by id (their UPDATE, which
counts the attempts of the jobs that start at claim, ``core/ready.starts_at_claim``),
then the claimed rows' INSERT and the ready rows' DELETE, each row reached by its primary
key. It returns the claimed jobs' rows, as written, in claim order. In a transaction of
its own when the caller is in autocommit, else under a savepoint of the caller's
transaction; rolled back on any error (``db/mysql.py``, ``claim_ready``). On PostgreSQL
one statement already does it (``db/postgresql/claims.py``); SQLite is in-process.
Elsewhere this migration does nothing.

Ids travel between the statements as a JSON array (JSON_TABLE, MariaDB 10.6+ / MySQL 8),
and every join to a table by id forces its primary key: on a small table (the tail of a
drained ready table) the optimizer would otherwise scan it, and a DELETE that scans
waits for the rows other workers hold (``db/mysql.py``, ``delete_statement``). For the
same reason the pick of every queue reads the ready rows by their claim-order index:
the statements' pick, on a table of a few rows, reads them all through another index
and sorts them, which locks every ready row until its commit. The jobs
are updated one statement each: MariaDB 10.11 runs no handler for a CHECK constraint's
error in a multi-table UPDATE, so such an error left the procedure's transaction open,
its earlier writes in it (``db/mysql.py`` rolls back after any error of a CALL too).

Queue caps (``max_concurrency``) and ``prefix*`` patterns keep the statements' path,
as does a database user without CREATE ROUTINE (the migration warns and goes on).
"""

from django.db import migrations

from django_jobs.db.procedures import install_procedure, remove_procedure

PROCEDURE = "django_jobs_claim_ready"
SAVEPOINT = "django_jobs_claim"
# ReadyExecution's index in claim order (priority descending, then job id).
CLAIM_ORDER_INDEX = "jobs_ready_order"
# limits.MAX_SECONDS as it stands at this migration: the longest lease a row can ask for.
MAX_SECONDS = 100 * 366 * 86400


def column_type(schema_editor, table: str, name: str) -> tuple[str, str, str]:
    """A column's type, its character set clause and its collation clause, as the server
    declares them: a value reaches the procedure in the column's own encoding, and a
    variable compared with the column compares as the column does (two collations of
    one character set, both implicit, are an "illegal mix": a table whose collation is
    not its character set's default would fail every claim of a named queue)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_type, character_set_name, collation_name "
            "FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
            [table, name],
        )
        kind, charset, collation = cursor.fetchone()
    return (
        kind,
        f" CHARACTER SET {charset}" if charset else "",
        f" COLLATE {collation}" if collation else "",
    )


def procedure_sql(apps, schema_editor) -> str:
    quote = schema_editor.quote_name
    tables = {
        name: apps.get_model("django_jobs", name)._meta.db_table
        for name in ("Job", "ReadyExecution", "ClaimedExecution", "Pause")
    }
    job, ready, claimed, pause = (
        quote(tables[name]) for name in ("Job", "ReadyExecution", "ClaimedExecution", "Pause")
    )
    queue_kind, queue_charset, queue_collation = column_type(
        schema_editor, tables["ReadyExecution"], "queue_name"
    )
    queue = queue_kind + queue_charset + queue_collation
    _, text_charset, _ = column_type(schema_editor, tables["Job"], "worker_ids")
    picked = (
        f"JSON_TABLE(picked, '$[*]' COLUMNS (ord FOR ORDINALITY, id_ BIGINT PATH '$[0]', "
        f"queue_ {queue} PATH '$[1]')) AS ids_"
    )
    ascending = "JSON_TABLE(ascending, '$[*]' COLUMNS (id_ BIGINT PATH '$')) AS ids_"
    # core/ready.starts_at_claim: no rate limit, and not unique only until it starts.
    starts = (
        "(p_worker_id IS NOT NULL AND j.rate_key IS NULL "
        "AND NOT (BINARY j.unique_until <=> 'start'))"
    )
    # The same SELECT as core/ready.plain_pick's, for every queue or for one; one queue's is
    # read in claim order by its own index (queue_name, priority descending, job id).
    unpaused = f"NOT (r.queue_name IN (SELECT p.queue_name FROM {pause} p))"
    order = "ORDER BY r.priority DESC, r.job_id ASC LIMIT want FOR UPDATE SKIP LOCKED"
    return f"""
CREATE PROCEDURE {PROCEDURE}(
  IN own_transaction BOOLEAN,
  IN p_process_id BIGINT,
  IN p_queues LONGTEXT{queue_charset},
  IN p_limit INT,
  IN p_worker_id TEXT{text_charset},
  IN p_now DATETIME(6)
)
BEGIN
  -- [[job id, queue], ...] in claim order; the same ids ascending.
  DECLARE picked LONGTEXT DEFAULT '[]';
  DECLARE ascending LONGTEXT DEFAULT '[]';
  DECLARE want INT DEFAULT 0;
  DECLARE next_queue INT DEFAULT 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    IF own_transaction THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT {SAVEPOINT}; END IF;
    RESIGNAL;
  END;
  IF own_transaction THEN START TRANSACTION; ELSE SAVEPOINT {SAVEPOINT}; END IF;
  SET want = p_limit;
  -- The ready rows: every queue (p_queues NULL), or each queue of the list in turn.
  pick: LOOP
    IF want <= 0 OR (p_queues IS NOT NULL AND next_queue >= JSON_LENGTH(p_queues)) THEN
      LEAVE pick;
    END IF;
    BEGIN
      DECLARE done BOOLEAN DEFAULT FALSE;
      DECLARE found_id BIGINT;
      DECLARE found_queue {queue};
      DECLARE wanted {queue}
        DEFAULT JSON_UNQUOTE(JSON_EXTRACT(p_queues, CONCAT('$[', next_queue, ']')));
      -- Read in claim order by its index: left to choose, on a table of a few rows (the
      -- tail of a drain, a queue that keeps up) the optimizer read them all through
      -- another index and sorted them, locking every one until the commit, so that a
      -- second claimer meanwhile found none free.
      DECLARE every_queue CURSOR FOR
        SELECT r.job_id, r.queue_name FROM {ready} r FORCE INDEX ({CLAIM_ORDER_INDEX})
        WHERE {unpaused} {order};
      DECLARE one_queue CURSOR FOR
        SELECT r.job_id, r.queue_name FROM {ready} r
        WHERE (r.queue_name = wanted AND {unpaused}) {order};
      DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
      IF p_queues IS NULL THEN OPEN every_queue; ELSE OPEN one_queue; END IF;
      read_rows: LOOP
        IF p_queues IS NULL THEN
          FETCH every_queue INTO found_id, found_queue;
        ELSE
          FETCH one_queue INTO found_id, found_queue;
        END IF;
        IF done THEN LEAVE read_rows; END IF;
        SET picked = JSON_ARRAY_APPEND(picked, '$', JSON_ARRAY(found_id, found_queue));
        SET want = want - 1;
      END LOOP;
      IF p_queues IS NULL THEN CLOSE every_queue; ELSE CLOSE one_queue; END IF;
    END;
    IF p_queues IS NULL THEN LEAVE pick; END IF;
    SET next_queue = next_queue + 1;
  END LOOP;
  IF JSON_LENGTH(picked) > 0 THEN
    -- The jobs, locked ascending by id (as the statements' locking read takes them, before
    -- the claims' INSERT checks its foreign key on them): started, or only claimed. One
    -- UPDATE per job, by primary key: MariaDB (10.11) runs no handler for a CHECK
    -- constraint's error in a multi-table UPDATE, and the rollback above must run.
    BEGIN
      DECLARE done BOOLEAN DEFAULT FALSE;
      DECLARE found_id BIGINT;
      DECLARE by_id CURSOR FOR
        SELECT id_ FROM JSON_TABLE(picked, '$[*]' COLUMNS (id_ BIGINT PATH '$[0]')) AS ids_
        ORDER BY id_;
      DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
      OPEN by_id;
      write_jobs: LOOP
        FETCH by_id INTO found_id;
        IF done THEN LEAVE write_jobs; END IF;
        UPDATE {job} j
          SET j.status = IF({starts}, 'running', 'claimed'),
            j.attempts = j.attempts + IF({starts}, 1, 0),
            j.worker_ids = IF({starts},
              IF(JSON_TYPE(j.worker_ids) = 'ARRAY',
                JSON_ARRAY_APPEND(j.worker_ids, '$', p_worker_id), JSON_ARRAY(p_worker_id)),
              j.worker_ids),
            j.started_at = IF({starts}, COALESCE(j.started_at, p_now), j.started_at),
            j.last_attempted_at = IF({starts}, p_now, j.last_attempted_at)
          WHERE j.id = found_id;
        SET ascending = JSON_ARRAY_APPEND(ascending, '$', found_id);
      END LOOP;
      CLOSE by_id;
    END;
    -- Their claims, ascending by job id (db/base.py, insert_claims, says why); a keyed claim
    -- with a duration holds a lease (db/base.py, lease_end, bounded as limits.later bounds it).
    INSERT INTO {claimed} (job_id, process_id, queue_name, concurrency_key, lease_expires_at,
        batch_id, created_at)
      SELECT j.id, p_process_id, ids_.queue_, j.concurrency_key,
        IF(CHAR_LENGTH(j.concurrency_key) > 0 AND j.concurrency_duration <> 0,
          p_now + INTERVAL ROUND(GREATEST(0, LEAST(j.concurrency_duration, {MAX_SECONDS}))
            * 1000000) MICROSECOND,
          NULL),
        j.batch_id, p_now
      FROM {picked} STRAIGHT_JOIN {job} j FORCE INDEX (PRIMARY) ON j.id = ids_.id_
      ORDER BY ids_.id_;
    DELETE r FROM {ascending} STRAIGHT_JOIN {ready} r FORCE INDEX (PRIMARY)
      ON r.job_id = ids_.id_;
  END IF;
  -- The jobs as written, in claim order, read before the commit under the claim's locks.
  SELECT j.* FROM {picked} STRAIGHT_JOIN {job} j FORCE INDEX (PRIMARY) ON j.id = ids_.id_
    ORDER BY ids_.ord;
  IF own_transaction THEN COMMIT; ELSE RELEASE SAVEPOINT {SAVEPOINT}; END IF;
END
"""


def create_procedure(apps, schema_editor) -> None:
    install_procedure(
        schema_editor,
        PROCEDURE,
        lambda: procedure_sql(apps, schema_editor),
        migration="0014",
        without_it="claims take seven round trips instead of one",
    )


def drop_procedure(apps, schema_editor) -> None:
    remove_procedure(schema_editor, PROCEDURE)


class Migration(migrations.Migration):
    # MySQL commits around DDL by itself; Django refuses DDL inside its transaction there.
    atomic = False
    dependencies = [("django_jobs", "0013_mysql_enqueue_procedure")]

    operations = [migrations.RunPython(create_procedure, drop_procedure, elidable=False)]
