"""MySQL/MariaDB's enqueue procedure (migration 0013): which job columns it takes, its SQL, and
the operations that keep it following the job table when a migration changes that table.

``CALL django_jobs_enqueue_ready(...)`` writes a ready job and its ready row in one round trip
(``db/mysql.py``, ``enqueue_ready``). Its parameters are the job's columns, every concrete
column but the primary key (:func:`procedure_columns`), each typed as the table declares it at
the moment the procedure is created. A procedure is not altered by ``ALTER TABLE``: after a
migration adds a job column, the procedure still takes the old ones, and ``db/mysql.py`` sends
every job that sets the new column (a non-NULL default: every job) through the statements' path,
four round trips instead of one, silently. And only MariaDB would notice.

So a migration that adds, removes or renames a job column wraps those operations in
:func:`follow_job_columns`, which creates the procedure again after them, forwards and
backwards. ``tests/test_enqueue_procedure.py`` walks the migrations on any database and fails,
naming the migration and the fix, where the columns the procedure was last created with are
not the model's; it also fails where the ready table gains a column the procedure's second
INSERT does not write (:data:`READY_COLUMNS`).

The SQL here serves every table state since migration 0013 (it reads the job's columns from
the table being migrated): a change to what it writes is a new migration that creates the
procedure again, never an edit alone, which databases already migrated would not see (0025 adds
the stamp's job column and creates it again; the fair branch is built for the table being
migrated, 0024's or 0025's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import migrations
from django.db.migrations.operations.base import Operation

from django_jobs.db.procedures import NOT_ALLOWED, install_procedure, remove_procedure  # noqa: F401
from django_jobs.limits import (
    LARGEST_TURN,
    MAX_FAIR_WEIGHT,
    MAX_TURN_LEAD,
    MIN_FAIR_WEIGHT,
    TURN_SCALE,
)

PROCEDURE = "django_jobs_enqueue_ready"
SAVEPOINT = "django_jobs_enqueue"
# The ready row's columns, as the procedure's second INSERT writes them.
READY_COLUMNS = ("job_id", "queue_name", "priority", "concurrency_key", "created_at")
# Ready columns added since 0013, each written (from the job's parameter of the same name)
# where the ready table being migrated has it: replaying 0013 creates what it always did.
LATER_READY_COLUMNS = ("is_async",)
# Ready columns added since 0013 that the procedure computes (the job it inserts is never of
# a fair queue: db/mysql.py sends those through the statements' path), by the same rule.
COMPUTED_READY_COLUMNS = {"turn": f"LAST_INSERT_ID() * {TURN_SCALE}"}


def procedure_columns(fields: Iterable[Any]) -> frozenset[str]:
    """The columns of ``fields`` (a job model's concrete fields, historical or current) that
    the procedure takes: every concrete column but the primary key."""
    return frozenset(
        field.column
        for field in fields
        if getattr(field, "concrete", False) and not field.primary_key
    )


def columns(apps, schema_editor) -> list[tuple[str, str, str | None]]:
    """(name, type, character set) of each column the procedure takes, in table order, as
    the table declares it (information_schema): a value reaches its column exactly as the
    ORM's INSERT would send it."""
    job = apps.get_model("django_jobs", "Job")
    taken = procedure_columns(job._meta.concrete_fields)
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name, column_type, character_set_name "
            "FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s "
            "ORDER BY ordinal_position",
            [job._meta.db_table],
        )
        return [row for row in cursor.fetchall() if row[0] in taken]


def ready_columns_now(apps, schema_editor) -> set[str]:
    """The columns the ready table being migrated has."""
    ready = apps.get_model("django_jobs", "ReadyExecution")._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s",
            [ready],
        )
        return {name for (name,) in cursor.fetchall()}


def later_ready_columns(apps, schema_editor) -> list[str]:
    """The columns of :data:`LATER_READY_COLUMNS` the ready table has now."""
    present = ready_columns_now(apps, schema_editor)
    return [name for name in LATER_READY_COLUMNS if name in present]


def computed_ready_columns(apps, schema_editor) -> dict[str, str]:
    """The columns of :data:`COMPUTED_READY_COLUMNS` the ready table has now, with their
    values."""
    present = ready_columns_now(apps, schema_editor)
    return {name: value for name, value in COMPUTED_READY_COLUMNS.items() if name in present}


def procedure_sql(apps, schema_editor) -> str:
    quote = schema_editor.quote_name
    job = quote(apps.get_model("django_jobs", "Job")._meta.db_table)
    ready = quote(apps.get_model("django_jobs", "ReadyExecution")._meta.db_table)
    found = columns(apps, schema_editor)
    later = [name for name in later_ready_columns(apps, schema_editor) if name in dict_of(found)]
    params = ",\n  ".join(
        f"IN p_{name} {kind}" + (f" CHARACTER SET {charset}" if charset else "")
        for name, kind, charset in found
    )
    names = ", ".join(quote(name) for name, _, _ in found)
    values = ", ".join(f"p_{name}" for name, _, _ in found)
    computed = computed_ready_columns(apps, schema_editor)
    ready_names = ", ".join([*READY_COLUMNS, *later, *(quote(name) for name in computed)])
    later_values = "".join(f", p_{name}" for name in later)
    if "turn" in computed and "fair_key" in dict_of(found):
        # Since 0024: the job of a fair queue is stamped here too.
        return fair_procedure_sql(apps, schema_editor, params, names, values, ready_names)
    later_values += "".join(f", {value}" for value in computed.values())
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
  INSERT INTO {ready} ({ready_names})
    VALUES (LAST_INSERT_ID(), p_queue_name, p_priority, NULL, p_enqueued_at{later_values});
  IF own_transaction THEN COMMIT; ELSE RELEASE SAVEPOINT {SAVEPOINT}; END IF;
  SELECT LAST_INSERT_ID();
END
"""


def fair_procedure_sql(
    apps, schema_editor, params: str, names: str, values: str, ready_names: str
) -> str:
    """The procedure since migration 0024 (as migration 0025 re-creates it): a job of a fair
    queue (``p_fair_key`` set) is stamped as ``core.fairness.ready_turns`` stamps it; any
    other job takes its FIFO turn. Returns the new id and whether the group's stamp, read
    under its lock, was one no enqueue writes (the caller logs it; the turn is then the FIFO
    one).

    Where the group's last job still waits at the stamp's turn and level, the head is at or
    before it and the rule's ``max(head, last + step)`` is ``last + step``: since 0030 one
    UPDATE of the stamp writes that, its WHERE reading the job's ready row (0028 did it in
    three statements, a locking read of the stamp, the job's row and the write, the head not
    read: its read cost as much as the stamp's write, 0.1 ms a call, bench/fair_floor.py),
    and the ready row's insert reads the turn it wrote (``COALESCE(turn_, (SELECT ...))``,
    ``turn_`` NULL where the UPDATE wrote). Otherwise, for a group that has a
    stamp: a locking read of the stamp (the latest committed version, waiting for an enqueue
    of the group that holds it; at READ COMMITTED the next reads then see that enqueue's
    ready row); the turn of the group's last job's ready row (by the stamp's
    ``last_job_id``); the head, read after the lock, unless that job waits at the stamp's
    turn after all; the new stamp. The last job's row is read by ``SELECT
    ... INTO``, which locks nothing; the ``IF EXISTS`` before 0028 held a shared lock on it to
    the enqueue's commit. A new group's row is made first by an upsert, as 0024's version
    made every one (an upsert that finds the row costs more than the locking read: InnoDB
    inserts, meets the unique key, undoes, updates). Inside an upsert's update clause,
    MariaDB read every ready row of the level for the waiting job (0.6x a plain enqueue);
    in the UPDATE's WHERE it is one read by key (a fair enqueue of a group with a backlog:
    three ``Handler_read_key``, none next, against a plain one's one)."""
    quote = schema_editor.quote_name
    job = quote(apps.get_model("django_jobs", "Job")._meta.db_table)
    ready = quote(apps.get_model("django_jobs", "ReadyExecution")._meta.db_table)
    fair = quote(apps.get_model("django_jobs", "FairTurn")._meta.db_table)
    group = "queue_name = p_queue_name AND priority = p_priority AND fair_key = p_fair_key"
    # A step: TURN_SCALE / the job's weight (bounded), in the UPDATE's expression rather than
    # a statement of its own (each costs the CALL).
    step = (
        f"GREATEST(1, ROUND({TURN_SCALE} / LEAST(GREATEST(COALESCE(p_fair_weight, 1), "
        f"{MIN_FAIR_WEIGHT}), {MAX_FAIR_WEIGHT})))"
    )
    fair_model = apps.get_model("django_jobs", "FairTurn")
    if any(field.name == "last_job_id" for field in fair_model._meta.concrete_fields):
        # Since 0025: the group's last job, by primary key.
        read_job = ", last_job_id"
        into_job = ", prior_job_"
        write_job = ", last_job_id = new_id"
        # The last job's ready row, if it has one, by primary key, after the stamp's lock.
        # SELECT ... INTO, a plain read: the same read as a subquery (SET x = (SELECT ...),
        # IF EXISTS (SELECT ...)) took a shared lock on the row until the enqueue's commit
        # (MariaDB 10.11 reads a row it finds by primary key in a procedure's subquery so;
        # the head's subquery, a range of jobs_ready_poll, locks nothing), which a claim's
        # SKIP LOCKED then passed over. No row: NOT FOUND, whose handler sets missing_,
        # read no more.
        read_last = (
            "SELECT turn, queue_name = p_queue_name AND priority = p_priority "
            f"INTO last_at_, same_level_ FROM {ready} WHERE job_id = prior_job_;"
        )
        waits = "last_at_ IS NOT NULL"
        # It still waits at the stamp's turn, at this level: at or after the head.
        waits_at_turn = f"prior_ BETWEEN 0 AND {LARGEST_TURN} AND same_level_ AND last_at_ = prior_"
        # Since 0030: that case in one statement, the UPDATE of the stamp, whose WHERE reads
        # the last job's ready row (by primary key: locking nothing, as the test of the
        # procedure's reads shows) on the stamp's latest version, waiting for an enqueue of
        # the group that holds it; where the row is not there (or not at the stamp's turn,
        # or the stamp was written since the statement's read view), nothing is updated and
        # the steps below decide. Where it updated, turn_ is NULL and the ready row's insert
        # reads the turn it wrote. (The same with a flag and an insert of each kind under
        # IF cost the CALL 10-15 us of the server's CPU more than 0028's three statements;
        # this, 15-25 less: bench/fair_floor.py, alternated.)
        step_in_one = (
            f"UPDATE {fair} SET last_turn = last_turn + {step}, last_job_id = new_id,\n"
            "        updated_at = p_enqueued_at\n"
            f"      WHERE {group} AND last_turn BETWEEN 0 AND {LARGEST_TURN}\n"
            f"        AND (SELECT w.turn = {fair}.last_turn AND w.queue_name = p_queue_name\n"
            f"          AND w.priority = p_priority FROM {ready} AS w\n"
            f"          WHERE w.job_id = {fair}.last_job_id);\n"
            "    SET turn_ = IF(ROW_COUNT() = 1, NULL, turn_);\n    "
        )
    else:
        # Migration 0024's table: a ready row of the level at the stamp's turn.
        read_job = into_job = write_job = ""
        waits = (
            f"prior_ IS NOT NULL AND EXISTS (SELECT 1 FROM {ready} WHERE queue_name = "
            "p_queue_name AND priority = p_priority AND turn = prior_)"
        )
        read_last = ""
        waits_at_turn = "FALSE"  # no job to read by: the head, always
        step_in_one = ""
    return f"""
CREATE PROCEDURE {PROCEDURE}(
  IN own_transaction BOOLEAN,
  {params}
)
BEGIN
  DECLARE new_id BIGINT;
  DECLARE head_ BIGINT DEFAULT NULL;
  DECLARE prior_ BIGINT DEFAULT NULL;
  DECLARE prior_job_ BIGINT DEFAULT NULL;
  DECLARE missing_ BOOLEAN DEFAULT FALSE;
  DECLARE turn_ BIGINT;
  DECLARE step_ BIGINT;
  DECLARE insane_ BOOLEAN DEFAULT FALSE;
  DECLARE last_at_ BIGINT DEFAULT NULL;
  DECLARE same_level_ BOOLEAN DEFAULT FALSE;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION
  BEGIN
    IF own_transaction THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT {SAVEPOINT}; END IF;
    RESIGNAL;
  END;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET missing_ = TRUE;
  IF own_transaction THEN START TRANSACTION; ELSE SAVEPOINT {SAVEPOINT}; END IF;
  INSERT INTO {job} ({names}) VALUES ({values});
  SET new_id = LAST_INSERT_ID();
  SET turn_ = new_id * {TURN_SCALE};
  IF p_fair_key IS NOT NULL THEN
    {step_in_one}IF turn_ IS NOT NULL THEN
      SET step_ = {step};
      -- A stamp set to NULL by hand reads as -2; a missing row sets missing_.
      SELECT COALESCE(last_turn, -2){read_job} INTO prior_{into_job} FROM {fair}
        WHERE {group} FOR UPDATE;
      IF missing_ THEN
        INSERT INTO {fair} (queue_name, priority, fair_key, last_turn, updated_at)
          VALUES (p_queue_name, p_priority, p_fair_key, -1, p_enqueued_at)
          ON DUPLICATE KEY UPDATE updated_at = VALUES(updated_at);
        SELECT COALESCE(last_turn, -2){read_job} INTO prior_{into_job} FROM {fair}
          WHERE {group} FOR UPDATE;
      END IF;
      -- -1 is the row made just above, a new group; read from a row that was there, it was
      -- set by hand: a broken stamp, as any other negative turn.
      IF missing_ AND prior_ = -1 THEN
        SET prior_ = NULL;
      END IF;
      {read_last}
      IF {waits_at_turn} THEN
        -- Its last job waits at the stamp's turn (since 0030 this is where the UPDATE above
        -- did not see it: the stamp was written since): the head is at or before that turn,
        -- so the next one comes a step after it, the head unread. A stamp edited by hand is
        -- not at its job's turn and goes the other way, to the checks against the head; only
        -- a ready row edited to match it would be trusted, here and above.
        SET turn_ = prior_ + step_;
      ELSE
        -- The head, one row of jobs_ready_poll, read after the stamp's lock. A subquery, not
        -- SELECT ... INTO: an empty level is NULL, not a "no data" condition. The index
        -- named: left to choose, the optimizer took jobs_ready_order, (priority, turn), which
        -- gives the order too, and at times (by the statistics of the moment) walked every
        -- other queue's ready rows of lower turn at that priority: 1,004 rows examined per
        -- call in the slow log, 3.3 ms a call instead of 0.9.
        SET head_ = (SELECT turn FROM {ready} FORCE INDEX (jobs_ready_poll)
          WHERE queue_name = p_queue_name AND priority = p_priority ORDER BY turn LIMIT 1);
        IF prior_ < 0 OR prior_ > {LARGEST_TURN}
            OR prior_ - COALESCE(head_, turn_) > {MAX_TURN_LEAD} THEN
          SET insane_ = TRUE;
        END IF;
        IF head_ IS NOT NULL AND NOT insane_ THEN
          -- A step after the group's last job while that one still waits, else the head.
          IF {waits} THEN
            SET turn_ = GREATEST(head_, prior_ + step_);
          ELSE
            SET turn_ = head_;
          END IF;
        END IF;
      END IF;
      UPDATE {fair} SET last_turn = turn_{write_job}, updated_at = p_enqueued_at
        WHERE {group};
    END IF;
  END IF;
  INSERT INTO {ready} ({ready_names})
    VALUES (new_id, p_queue_name, p_priority, NULL, p_enqueued_at, p_is_async,
      COALESCE(turn_, (SELECT last_turn FROM {fair} WHERE {group})));
  IF own_transaction THEN COMMIT; ELSE RELEASE SAVEPOINT {SAVEPOINT}; END IF;
  SELECT new_id, insane_;
END
"""


def dict_of(found: list[tuple[str, str, str | None]]) -> dict[str, str]:
    return {name: kind for name, kind, _ in found}


def create_procedure(apps, schema_editor) -> None:
    """The procedure (again), for the job table as it stands; MySQL/MariaDB only."""
    install_procedure(
        schema_editor,
        PROCEDURE,
        lambda: procedure_sql(apps, schema_editor),
        migration="0013",
        without_it="single enqueues take four round trips instead of one",
    )


def drop_procedure(apps, schema_editor) -> None:
    remove_procedure(schema_editor, PROCEDURE)


def follow_job_columns(*operations: Operation) -> list[Operation]:
    """``operations``, a migration's changes to the job table's columns, with the procedure
    created again after them both ways: after they are applied, and after they are
    unapplied (the first operation, run last backwards). Use it as the migration's
    ``operations = follow_job_columns(migrations.AddField(...), ...)``. The procedure's
    DDL commits by itself on MySQL: its two steps run outside the migration's transaction
    (``atomic=False``), as Django requires there."""
    return [
        migrations.RunPython(
            migrations.RunPython.noop, create_procedure, atomic=False, elidable=False
        ),
        *operations,
        migrations.RunPython(
            create_procedure, migrations.RunPython.noop, atomic=False, elidable=False
        ),
    ]
