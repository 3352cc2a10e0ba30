"""Where one enqueue's time goes on PostgreSQL: ours against Procrastinate's, and two floors.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/jobs_bench python bench/enqueue_floor.py

Four ways to write one ready no-op job, timed in turns (each round runs every way once, the
first of the round the next one along, so that a burst of load from elsewhere weighs on all
alike), the median round of each printed with Procrastinate's time over it (> 1: faster than
Procrastinate):

- ``enqueue()``: ours, as a project calls it (``django.tasks``' ``Task.enqueue``).
- ``defer()``: Procrastinate's, through its Django integration on the same connection.
- "every check, nothing else": ``core.enqueue.prepare_job`` (every check the design asks of
  an enqueue: the arguments' JSON round trip, their binding to the signature, the options,
  the lengths; then the ``Job``), our one insert statement on a bare psycopg cursor, and the
  ``TaskResult``. No ``Task.enqueue``/backend layers, no Django cursor wrapper, no signal, no
  notification. What a leaner path that keeps the checks could reach at best.
- "the statement alone": that insert with fixed values, no Python work around it: what the
  database and the round trip cost.

Issue 24 asked for ``enqueue()`` at 1.2x Procrastinate's; the third line bounds what cutting
our own layers could give without dropping a check. Needs Procrastinate (the ``bench`` extra)
and a database whose name contains "bench" (its tables are emptied first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ["JOBS_BENCH_PROCRASTINATE"] = "true"  # bench/settings.py installs its app

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.tasks import task_backends  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.tables import empty, refuse_unless_named, tables_of  # noqa: E402
from bench.tasks import noop  # noqa: E402
from django_jobs.core.enqueue import prepare_job  # noqa: E402
from django_jobs.db.postgresql.cursors import ServerBindingCursor  # noqa: E402
from django_jobs.db.postgresql.insert import set_values, single_statement  # noqa: E402
from django_jobs.tasks.results import build_result  # noqa: E402

# The columns a plain no-op job sets, in the order the insert takes them.
PLAIN_COLUMNS = (
    "backend",
    "task_path",
    "queue_name",
    "priority",
    "args",
    "kwargs",
    "status",
    "enqueued_at",
    "attempts",
    "max_attempts",
    "worker_ids",
    "on_conflict",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=14, help="rounds of every way (14)")
    parser.add_argument("--calls", type=int, default=300, help="calls per way per round (300)")
    return parser.parse_args()


def check_database() -> None:
    if connection.vendor != "postgresql":
        sys.exit(
            f"PostgreSQL only (our insert and Procrastinate's schema), not {connection.vendor}"
        )
    refuse_unless_named()


def empty_tables() -> None:
    empty(tables_of("django_jobs", "procrastinate"))


def every_check_nothing_else() -> Callable[[], Any]:
    backend = task_backends["default"]

    def enqueue() -> Any:
        job, task = prepare_job(backend, noop, (), {})
        names, params = set_values(job)
        cursor = ServerBindingCursor(connection.connection)
        cursor.execute(single_statement("default", names), params)
        job.pk = cursor.fetchone()[0]
        cursor.close()
        return build_result(job, task=task)

    return enqueue


def the_statement_alone() -> Callable[[], Any]:
    sql = single_statement("default", PLAIN_COLUMNS)

    def insert() -> Any:
        params = ["default", noop.module_path, "default", 0, "[]", "{}", "ready"]
        params += [timezone.now(), 0, 1, "[]", "block"]
        cursor = ServerBindingCursor(connection.connection)
        cursor.execute(sql, params)
        row = cursor.fetchone()
        cursor.close()
        return row

    return insert


def main() -> int:
    options = parse_args()
    check_database()
    call_command("migrate", verbosity=0)
    from bench import procrastinate_tasks

    empty_tables()
    ways: list[tuple[str, Callable[[], Any]]] = [
        ("ours, enqueue()", noop.enqueue),
        ("procrastinate, defer()", procrastinate_tasks.noop_async.defer),
        ("every check, nothing else", every_check_nothing_else()),
        ("the statement alone", the_statement_alone()),
    ]
    for _, way in ways:
        way()  # a warm-up each: connections, first plans, imports
    micros: dict[str, list[float]] = {name: [] for name, _ in ways}
    for turn in range(options.rounds):
        for offset in range(len(ways)):
            name, way = ways[(turn + offset) % len(ways)]
            began = time.perf_counter()
            for _ in range(options.calls):
                way()
            micros[name].append((time.perf_counter() - began) / options.calls * 1e6)
    empty_tables()
    medians = {name: statistics.median(values) for name, values in micros.items()}
    theirs = medians["procrastinate, defer()"]
    print(f"{options.rounds} rounds x {options.calls} calls of each, in turns; median round")
    for name, value in medians.items():
        print(f"  {name:<28}{value:8.0f} us   procrastinate / this {theirs / value:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
