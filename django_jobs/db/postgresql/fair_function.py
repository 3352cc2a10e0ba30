"""PostgreSQL's fair stamp function (migration 0029): a fair queue's single enqueue stamps
its job by calling it from the one statement that inserts the job and its ready row
(``insert.with_fair_ready_row``).

Why a function and not more of that statement: the statement is parsed and planned on every
call unless the connection prepares statements, and Django's default (``prepare_threshold``
None, which keeps transaction-mode poolers working) does not. The stamp's work written into
the statement (an upsert, the stamp as the snapshot saw it, the last job's and the head's
reads) made it about 0.4 ms of planning a call, and a fair single enqueue ran at 0.6x a
plain one. A PL/pgSQL function's statements are planned once per connection and kept,
whatever the client prepares, and the statement that calls it is as short to plan as a
plain enqueue's: measured on the server's CPU (bench/fair_floor.py), a fair enqueue's extra
over a plain one went from about 400 microseconds to 48-68 unprepared, and from 64-75 to
54-57 prepared (its one-UPDATE path, below, and the turn returned as a scalar).

It also reads what it must after the stamp's lock, not in a snapshot taken before it: a
VOLATILE function's every statement takes a snapshot of its own at READ COMMITTED, so once
the locking read of the stamp has waited for another enqueue of the group, the next read
sees that enqueue's job. The statement had to compare the stamp it locked with the one its
snapshot held to know. The steps are those of MariaDB/MySQL's enqueue procedure
(``db/enqueue_procedure.py``), with the same fast path: where the group's last job waits at
the stamp's turn, the head is at or before it and is not read.

The SQL here is the function as migration 0029 creates it: a change to it is a new
migration that creates the function again, never an edit alone, which databases already
migrated would not see.
"""

from __future__ import annotations

from typing import Any

from django_jobs.limits import (
    LARGEST_TURN,
    MAX_FAIR_WEIGHT,
    MAX_TURN_LEAD,
    MIN_FAIR_WEIGHT,
    TURN_SCALE,
)

FUNCTION = "django_jobs_fair_turn"
# Where the function leaves the id of a job whose group's stamp was broken (one no enqueue
# writes), for the statement that called it to return: a setting local to the transaction,
# set only then. The function returns the turn alone, a scalar in the ready row's insert:
# returning the flag beside it took a LATERAL call and a CTE, 12 microseconds of the
# server's CPU a call more (bench/fair_floor.py's way of measuring).
BROKEN = "django_jobs.broken_stamp_job"


def head_sql(ready: str) -> str:
    """The head of a level, ``(p_queue_name, p_priority)``: the first row of
    ``jobs_ready_poll`` there, whatever the statistics say. Written ``queue_name =
    p_queue_name``, a plan made while the ready table had no statistics (new, or emptied),
    which the function keeps, could read ``jobs_ready_order``, ``(priority, turn)``, which
    gives the order asked for once the name is a constant, and walk every other queue's
    ready rows at that priority (0.73x a plain enqueue's rate with 3,000 of them, seen with
    the statement before this function). ``= ANY(ARRAY[...])`` is an equality the index
    searches as one but the planner does not fold, so only ``jobs_ready_poll``, led by the
    name, gives ``ORDER BY queue_name, turn``. (A range of one name does that too, but
    leaves the priority as a filter: at a level with nothing ready it walked the queue's
    lower priorities.)"""
    return (
        f"SELECT r.turn FROM {ready} AS r WHERE r.queue_name = ANY(ARRAY[p_queue_name]) "
        "AND r.priority = p_priority ORDER BY r.queue_name, r.turn LIMIT 1"
    )


def function_sql(fair: str, ready: str) -> str:
    """``CREATE OR REPLACE FUNCTION``: the turn of a job of a fair queue, its group's stamp
    (``fair``, the ``FairTurn`` table) locked and written, as ``core.fairness.ready_turns``
    stamps one (docs/fairness.md). Where the stamp it found was one no enqueue writes, the
    turn is the job's FIFO one and the setting :data:`BROKEN` names the job (the caller
    logs it)."""
    group = "queue_name = p_queue_name AND priority = p_priority AND fair_key = p_fair_key"
    head = head_sql(ready)
    return f"""
CREATE OR REPLACE FUNCTION {FUNCTION}(
  p_queue_name varchar, p_priority smallint, p_fair_key varchar,
  p_fair_weight double precision, p_job_id bigint, p_enqueued_at timestamptz
) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $function$
DECLARE
  turn bigint;
  step_ bigint := GREATEST(1, round({TURN_SCALE} / LEAST(GREATEST(
    COALESCE(p_fair_weight, 1), {MIN_FAIR_WEIGHT}), {MAX_FAIR_WEIGHT})))::bigint;
  stamp_ bigint;
  prior_ bigint;
  prior_job_ bigint;
  last_at_ bigint;
  same_level_ boolean;
  head_ bigint;
BEGIN
  -- A group whose last job waits at its stamp's turn, at this level: the head is at or
  -- before that turn, so the next comes a step after it, the head unread; one statement.
  -- The UPDATE locks the stamp, waiting for an enqueue of the group that holds it, and
  -- then checks its conditions again on the version that enqueue wrote, but reads ready
  -- rows in its own snapshot, taken before the wait: that enqueue's job is not there, the
  -- row is left alone, and the steps below, each in a snapshot of its own, decide. The
  -- ready row is read by its primary key alone (with the other columns in the WHERE, a
  -- plan made on an empty table read it through jobs_ready_order).
  UPDATE {fair} AS f SET last_turn = f.last_turn + step_, last_job_id = p_job_id,
      updated_at = p_enqueued_at
    WHERE f.{group.replace(" AND ", " AND f.")}
      AND f.last_turn BETWEEN 0 AND {LARGEST_TURN}
      AND (SELECT w.turn = f.last_turn AND w.queue_name = p_queue_name
        AND w.priority = p_priority FROM {ready} AS w WHERE w.job_id = f.last_job_id)
    RETURNING f.last_turn INTO turn;
  IF FOUND THEN
    RETURN turn;
  END IF;
  turn := p_job_id * {TURN_SCALE};
  -- The stamp's latest version, locked to the commit: an enqueue of the group that holds
  -- it is waited for. A stamp set to NULL by hand reads as -2, a broken one.
  SELECT id, COALESCE(last_turn, -2), last_job_id INTO stamp_, prior_, prior_job_
    FROM {fair} WHERE {group} FOR UPDATE;
  IF NOT FOUND THEN
    -- A new group starts at the head (or, the level idle, at its FIFO turn). Its row
    -- locks as it is inserted; a first enqueue of the group at the same moment makes
    -- this one wait for its commit and insert nothing, and then its stamp is locked as
    -- any other.
    turn := COALESCE(({head}), turn);
    INSERT INTO {fair} (queue_name, priority, fair_key, last_turn, last_job_id, updated_at)
      VALUES (p_queue_name, p_priority, p_fair_key, turn, p_job_id, p_enqueued_at)
      ON CONFLICT (queue_name, priority, fair_key) DO NOTHING;
    IF FOUND THEN
      RETURN turn;
    END IF;
    turn := p_job_id * {TURN_SCALE};
    SELECT id, COALESCE(last_turn, -2), last_job_id INTO stamp_, prior_, prior_job_
      FROM {fair} WHERE {group} FOR UPDATE;
  END IF;
  -- The group's last job's ready row, if it has one, by primary key, in a snapshot taken
  -- after the lock: the job of an enqueue that held the stamp is seen. No row: NULLs.
  SELECT w.turn, w.queue_name = p_queue_name AND w.priority = p_priority
    INTO last_at_, same_level_ FROM {ready} AS w WHERE w.job_id = prior_job_;
  IF prior_ BETWEEN 0 AND {LARGEST_TURN} AND same_level_ AND last_at_ = prior_ THEN
    -- It waits at the stamp's turn after all (the stamp was written after the UPDATE's
    -- snapshot): a step after it. A stamp edited by hand is not at its job's turn and goes
    -- the other way, to the checks against the head; only a ready row edited to match it
    -- would be trusted, here and above.
    turn := prior_ + step_;
  ELSE
    head_ := ({head});
    IF prior_ < 0 OR prior_ > {LARGEST_TURN}
        OR prior_ - COALESCE(head_, turn) > {MAX_TURN_LEAD} THEN
      -- A broken stamp: the job keeps its FIFO turn, and the caller is told (BROKEN).
      PERFORM set_config('{BROKEN}', p_job_id::text, true);
    ELSIF head_ IS NOT NULL THEN
      -- A step after the group's last job while that one still waits, else the head.
      IF last_at_ IS NOT NULL THEN
        turn := GREATEST(head_, prior_ + step_);
      ELSE
        turn := head_;
      END IF;
    END IF;
  END IF;
  UPDATE {fair} SET last_turn = turn, last_job_id = p_job_id, updated_at = p_enqueued_at
    WHERE id = stamp_;
  RETURN turn;
END
$function$
"""


def create_function(apps: Any, schema_editor: Any) -> None:
    """The function, on PostgreSQL only, for the tables as migration 0029 finds them."""
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    fair, ready = (
        quote(apps.get_model("django_jobs", name)._meta.db_table)
        for name in ("FairTurn", "ReadyExecution")
    )
    schema_editor.execute(function_sql(fair, ready))


def drop_function(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        f"DROP FUNCTION IF EXISTS {FUNCTION}(varchar, smallint, varchar, double precision, "
        "bigint, timestamptz)"
    )
