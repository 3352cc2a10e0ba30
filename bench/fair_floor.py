"""What a fair single enqueue cannot go below: the fair stamp's least work, piece by piece,
against a plain enqueue (issue 38: "enqueue one by one with a fair key >= 0.9x without").

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/jobs_bench python bench/fair_floor.py
    DATABASE_URL=mysql://root@127.0.0.1:3306/jobs_bench python bench/fair_floor.py

A fair enqueue does what a plain one does and stamps the job (docs/fairness.md): it must at
least write its group's stamp, a row locked to the commit (else two enqueues of one group at
once share a turn), and read either the group's last job (while that one waits at the
stamp's turn, the next turn is a step after it) or the queue's head (else a group that was
idle gets credit). Each floor below is the plain enqueue's own round trip with some of that
added, in the same round trip, and nothing more: no new group, no hand-edited stamp, and the
ready row still takes its FIFO turn (the stamp's turn is not even handed to it), so each is
below what a correct stamp costs on its path: "+ the last job's read" for a group with a
backlog, "+ the head" for one whose last job no longer waits.

- PostgreSQL: the plain single statement (``db/postgresql/insert.py``) with one more CTE:
  "+ the stamp's write" updates the group's row by its key; "+ the last job's read" sets it
  a step after its last job's ready turn; "+ the head" sets it from the head
  (``GREATEST(head, last + step)``). Then the shipped fair statement (since migration 0029
  the job's and ready row's inserts around a call of the stamp function,
  ``db/postgresql/fair_function.py``).
- MariaDB/MySQL: the enqueue procedure (``db/enqueue_procedure.py``) copied under another
  name with its fair branch replaced, each by one UPDATE of the group's row: alone, from the
  last job's ready turn (a subquery), or after a read of the head. Then the shipped branch
  (a locking read of the stamp, the last job's row, the head where needed, the write). Each
  copy is dropped at the end.

Each is timed as the statement (or CALL) alone, fixed values, the tenant the only change,
alongside ``enqueue()`` of the plain and the fair no-op (bench/fair_tasks.py), in rounds, the
order turning each round, over ``--tenants`` tenants whose stamps exist and whose last jobs
wait at their stamps' turns (the case of a tenant with a backlog; bench/throughput.py's
phase ``fair`` measures the same calls); the floors write groups of their own, whose stamps
they leave naming jobs at FIFO turns, which the shipped path would read as a last job let in
at another turn. For each floor, the extra time of a call over the plain statement, and the
ratio ``enqueue()`` of a fair task would reach were that its only cost over a plain one:
``plain enqueue / (plain enqueue + extra)``. Beside it, where the server runs on this
machine, the server's CPU per call and its extra over the plain statement or CALL (the
kernel's count for the connection's backend process or thread): far steadier than the wall
times, run to run. PostgreSQL's connection prepares statements as
bench/settings.py says (``prepare_threshold`` 5); ``--unprepared`` sets Django's default,
None. The database's name must contain "bench": django_jobs' tables are emptied first.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, models  # noqa: E402
from django.tasks import task_backends  # noqa: E402

from bench.fair_tasks import FAIR_QUEUE, fair_noop, tenant_noop  # noqa: E402
from bench.tables import empty, refuse_unless_named, tables_of  # noqa: E402
from django_jobs.core.enqueue import prepare_job  # noqa: E402
from django_jobs.limits import TURN_SCALE  # noqa: E402
from django_jobs.models import FairTurn, ReadyExecution  # noqa: E402

Call = Callable[[str], Any]  # one enqueue of the tenant given


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000, help="fair groups (1,000)")
    parser.add_argument("--calls", type=int, default=200, help="calls per way per round (200)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of every way (12)")
    parser.add_argument(
        "--unprepared",
        action="store_true",
        help="PostgreSQL: prepare_threshold None (Django's default) instead of 5",
    )
    return parser.parse_args()


def floor_group(tenant: str) -> str:
    """The group a floor writes for ``tenant``: one of its own, so that its writes (its own
    job as the last, at a FIFO turn) never touch the stamps the shipped path reads."""
    return f"floor-{tenant}"


def keyed(params: list[Any], key_at: int) -> Callable[[str], list[Any]]:
    """``params`` with the fair key (at ``key_at``) given per call."""

    def params_of(tenant: str) -> list[Any]:
        given = list(params)
        given[key_at] = tenant
        return given

    return params_of


def table(model: type[models.Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


# --- PostgreSQL: the plain statement with one more CTE -----------------------------------


def postgres_ways(tenants: list[str]) -> list[tuple[str, Call]]:
    from django_jobs.db.postgresql.cursors import bound_cursor
    from django_jobs.db.postgresql.insert import set_values, single_statement

    def statement_of(task: Any) -> tuple[str, list[Any], int | None]:
        """The single insert ``task``'s enqueue sends (no notification), its parameters
        and where among them the fair key is."""
        job, _ = prepare_job(task_backends["default"], task, (tenants[0],), {})
        names, params = set_values(job)
        key = names.index("fair_key") if "fair_key" in names else None
        return single_statement("default", names), params, key

    plain_sql, plain_params, _ = statement_of(tenant_noop)
    fair_sql, fair_params, key_at = statement_of(fair_noop)
    ready, stamps = table(ReadyExecution), table(FairTurn)
    returning = " RETURNING id, queue_name, priority, enqueued_at, is_async) "
    assert plain_sql.count(returning) == 1, plain_sql
    head = (
        f"(SELECT r.turn FROM {ready} AS r WHERE r.queue_name = ANY(ARRAY[%s]) "
        f"AND r.priority = 0 ORDER BY r.queue_name, r.turn LIMIT 1)"
    )
    step = f"f.last_turn + {TURN_SCALE}"
    last_job_turn = f"(SELECT w.turn FROM {ready} AS w WHERE w.job_id = f.last_job_id)"
    turns = {
        "+ the stamp's write": (step, 0),
        "+ the last job's read": (f"COALESCE({last_job_turn}, f.last_turn) + {TURN_SCALE}", 0),
        "+ the head": (f"GREATEST({head}, {step})", 1),
    }

    def run(sql: str, params: Callable[[str], list[Any]]) -> Call:
        def call(tenant: str) -> Any:
            with bound_cursor(connection) as cursor:
                cursor.execute(sql, params(tenant))
                return cursor.fetchone()

        return call

    ways = [("statement, plain", run(plain_sql, lambda tenant: plain_params))]
    for name, (turn, heads) in turns.items():
        cte = (
            f"{returning[:-2]}), stamp AS (UPDATE {stamps} AS f SET last_turn = {turn}, "
            "last_job_id = (SELECT id FROM new_jobs), updated_at = now() "
            "WHERE f.queue_name = %s AND f.priority = 0 AND f.fair_key = %s) "
        )
        sql = plain_sql.replace(returning, cte)
        ways.append(
            (
                f"statement {name}",
                run(
                    sql,
                    lambda tenant, heads=heads: [
                        *plain_params,
                        *[FAIR_QUEUE] * heads,
                        FAIR_QUEUE,
                        floor_group(tenant),
                    ],
                ),
            )
        )

    assert key_at is not None
    ways.append(("statement, fair (shipped)", run(fair_sql, keyed(fair_params, key_at))))
    return ways


# --- MariaDB/MySQL: the procedure with its fair branch replaced --------------------------

PROCEDURE = "django_jobs_enqueue_ready"


def procedure_body() -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW CREATE PROCEDURE {PROCEDURE}")
        return cursor.fetchone()[2]


def call_of(task: Any, tenant: str) -> tuple[str, list[Any]]:
    """The CALL ``task``'s single enqueue of ``tenant`` sends, with its parameters."""
    sent: list[tuple[str, list[Any]]] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("CALL"):
            sent.append((sql, list(params)))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        task.enqueue(tenant)
    ((sql, params),) = sent
    return sql, [str(value) if isinstance(value, models.TextChoices) else value for value in params]


@contextmanager
def mysql_ways(tenants: list[str]) -> Iterator[list[tuple[str, Call]]]:
    body = procedure_body()
    start = body.index("IF p_fair_key IS NOT NULL THEN")
    # The fair branch ends where the ready row's insert begins; that insert takes turn_,
    # which a floor leaves at the job's FIFO turn (NULL only where the shipped branch's one
    # UPDATE stepped the stamp: the insert reads the turn it wrote).
    end = body.index(f"INSERT INTO {table(ReadyExecution)}", start)
    ready, stamps = table(ReadyExecution), table(FairTurn)
    group = "queue_name = p_queue_name AND priority = p_priority AND fair_key = p_fair_key"
    write = "last_job_id = new_id, updated_at = p_enqueued_at"
    head = (
        f"SET head_ = (SELECT turn FROM {ready} FORCE INDEX (jobs_ready_poll) "
        "WHERE queue_name = p_queue_name AND priority = p_priority ORDER BY turn LIMIT 1);"
    )
    branches = {
        "+ the stamp's write": (
            f"UPDATE {stamps} SET last_turn = last_turn + {TURN_SCALE}, {write} WHERE {group};"
        ),
        "+ the last job's read": (
            f"UPDATE {stamps} SET last_turn = COALESCE((SELECT turn FROM {ready} WHERE job_id = "
            f"last_job_id), last_turn) + {TURN_SCALE}, {write} WHERE {group};"
        ),
        "+ the head": (
            f"{head} UPDATE {stamps} SET last_turn = GREATEST(head_, last_turn + {TURN_SCALE}), "
            f"{write} WHERE {group};"
        ),
    }
    plain_sql, plain_params = call_of(tenant_noop, tenants[0])
    fair_sql, fair_params = call_of(fair_noop, tenants[0])
    key_at = fair_params.index(tenants[0])

    def run(sql: str, params: Callable[[str], list[Any]]) -> Call:
        def call(tenant: str) -> Any:
            with connection.cursor() as cursor:
                cursor.execute(sql, params(tenant))
                rows = cursor.fetchall()
                while cursor.nextset():  # a procedure's status result
                    pass
                return rows

        return call

    fair_params_of = keyed(fair_params, key_at)

    made: list[str] = []
    try:
        ways = [("CALL, plain", run(plain_sql, lambda tenant: plain_params))]
        for n, (name, branch) in enumerate(branches.items()):
            copy = f"django_jobs_bench_floor_{n}"
            sql = body[:start] + f"IF p_fair_key IS NOT NULL THEN {branch} END IF;\n  "
            sql += body[end:]
            sql = re.sub(
                rf"^CREATE .*?PROCEDURE `?{PROCEDURE}`?",
                f"CREATE PROCEDURE {copy}",
                sql,
                count=1,
                flags=re.S,
            )
            with connection.cursor() as cursor:
                cursor.execute(f"DROP PROCEDURE IF EXISTS {copy}")
                cursor.execute(sql)
            made.append(copy)
            ways.append(
                (
                    f"CALL {name}",
                    run(
                        fair_sql.replace(PROCEDURE, copy),
                        lambda tenant: fair_params_of(floor_group(tenant)),
                    ),
                )
            )
        ways.append(("CALL, fair (shipped)", run(fair_sql, fair_params_of)))
        yield ways
    finally:
        with connection.cursor() as cursor:
            for copy in made:
                cursor.execute(f"DROP PROCEDURE IF EXISTS {copy}")


# --- the run ----------------------------------------------------------------------------


def server_clock() -> Callable[[], float] | None:
    """The CPU time, in microseconds, the server has spent on this connection so far, where
    the server runs on this machine: its backend process (PostgreSQL) or thread
    (MariaDB/MySQL), from the kernel's count (``/proc/<id>/schedstat``). None where it cannot
    be read. Wall time over a round trip of half a millisecond moves by a few hundredths
    from run to run on a shared machine; what the server works per call moves far less, and
    tells where a statement's cost is."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute(
                "SELECT TID FROM information_schema.PROCESSLIST WHERE ID = CONNECTION_ID()"
            )
        row = cursor.fetchone()
    if not row or not row[0]:
        return None
    path = Path(f"/proc/{row[0]}/schedstat")
    try:
        path.read_text()
    except OSError:  # the server on another machine, or in a container of its own
        return None
    return lambda: int(path.read_text().split()[0]) / 1e3


Timings = dict[str, tuple[float, float | None]]  # way: (ms per call, server us per call)


def timed(ways: list[tuple[str, Call]], tenants: list[str], calls: int, rounds: int) -> Timings:
    """The median round's ms per call of each way, and the server's CPU microseconds per
    call (the median round's, None where :func:`server_clock` cannot read it), in turns
    (the first of each round the next one along), each call the next tenant round robin."""
    clock = server_clock()
    ms: dict[str, list[float]] = {name: [] for name, _ in ways}
    server: dict[str, list[float]] = {name: [] for name, _ in ways}
    n = 0
    for round_ in range(rounds):
        for offset in range(len(ways)):
            name, way = ways[(round_ + offset) % len(ways)]
            worked = clock() if clock else 0.0
            began = time.perf_counter()
            for _ in range(calls):
                way(tenants[n % len(tenants)])
                n += 1
            ms[name].append((time.perf_counter() - began) / calls * 1e3)
            if clock:
                server[name].append((clock() - worked) / calls)
    return {
        name: (statistics.median(ms[name]), statistics.median(server[name]) if clock else None)
        for name in ms
    }


def report(timings: Timings, base: str) -> None:
    plain, fair = timings["enqueue(), plain"][0], timings["enqueue(), fair"][0]
    base_server = timings[base][1]
    print(
        f"{'':<40}{'calls/s':>9}{'ms/call':>9}{'extra ms':>10}{'enqueue()':>11}"
        f"{'':<11}{'server us':>10}{'extra':>8}"
    )
    for name, (value, server) in timings.items():
        line = f"{name:<40}{1e3 / value:>9,.0f}{value:>9.3f}"
        if name == "enqueue(), fair":
            line += f"{value - plain:>+10.3f}{plain / value:>10.2f}x measured"
        elif name not in (base, "enqueue(), plain"):
            extra = value - timings[base][0]
            line += f"{extra:>+10.3f}{plain / (plain + extra):>10.2f}x at best"
        else:
            line += " " * 30
        if server is not None and base_server is not None:
            line += f"{server:>10.1f}"
            if name.startswith(("statement", "CALL")) and name != base:
                line += f"{server - base_server:>+8.1f}"
        print(line)
    print(f"fair / plain enqueue(): {plain / fair:.3f}")


def main() -> int:
    options = parse_args()
    refuse_unless_named()
    if connection.vendor not in ("postgresql", "mysql"):
        sys.exit(f"PostgreSQL or MariaDB/MySQL, not {connection.vendor}")
    if connection.vendor == "postgresql":
        connection.close()
        threshold = None if options.unprepared else 5
        connection.settings_dict.setdefault("OPTIONS", {})["prepare_threshold"] = threshold
    call_command("migrate", interactive=False, verbosity=0)
    empty(tables_of("django_jobs"))
    tenants = [f"tenant-{n}" for n in range(options.tenants)]
    # Every group's stamp, and a job of it waiting at the stamp's turn: the tenants' and the
    # floors' own.
    for task, groups in (
        (tenant_noop, tenants),
        (fair_noop, tenants),
        (fair_noop, [floor_group(tenant) for tenant in tenants]),
    ):
        task_backends["default"].bulk_enqueue([(task, (group,), {}) for group in groups])
    enqueues: list[tuple[str, Call]] = [
        ("enqueue(), plain", tenant_noop.enqueue),
        ("enqueue(), fair", fair_noop.enqueue),
    ]
    if connection.vendor == "postgresql":
        ways = enqueues + postgres_ways(tenants)
        for _, way in ways:
            way(tenants[0])  # a warm-up each
        timings = timed(ways, tenants, options.calls, options.rounds)
        setting = connection.settings_dict["OPTIONS"].get("prepare_threshold")
        title, base = f"PostgreSQL, prepare_threshold={setting}", "statement, plain"
    else:
        with mysql_ways(tenants) as statements:
            ways = enqueues + statements
            for _, way in ways:
                way(tenants[0])
            timings = timed(ways, tenants, options.calls, options.rounds)
        title, base = connection.display_name, "CALL, plain"
    print(
        f"{title}: {options.rounds} rounds x {options.calls} calls of each way, in turns, "
        f"over {options.tenants:,} tenants; the median round"
    )
    report(timings, base)
    empty(tables_of("django_jobs"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
