"""A fair queue's single enqueue against a plain one on PostgreSQL, with the connection
preparing statements and without (issue 38, "enqueue one by one with a fair key >= 0.9x").

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/jobs_bench python bench/fair_enqueue.py

bench/throughput.py's phase ``fair`` measures the same calls with ``prepare_threshold=5``
(bench/settings.py: docs/deployment.md's advice for a database reached directly). Django's
default is None, which a transaction-mode pooler before PgBouncer 1.21 needs, and then every
call is parsed and planned. Until migration 0029 the fair statement carried the stamp's work
(the stamp's upsert, the head, the last job) and cost far more to plan than the plain one;
since, it calls the stamp function, whose own statements the server plans once per
connection whatever the client prepares. For each setting this prints, from one connection
opened with it:

- the single enqueue's rate, ``fair_noop(tenant)`` against ``tenant_noop(tenant)`` (the same
  no-op in a queue that is not fair), in alternated rounds over ``--tenants`` tenants whose
  stamps exist, the median round of each and their ratio;
- whether the server kept a generic plan of each statement (``pg_prepared_statements``'
  generic and custom plan counts: none listed when nothing was prepared);
- each statement's planning and execution time, ``EXPLAIN (ANALYZE, SUMMARY)`` of the
  statement as the last enqueue sent it, in a transaction rolled back (medians of 30).

The database's name must contain "bench": django_jobs' tables are emptied first.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/jobs_bench")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.tasks import task_backends  # noqa: E402

from bench.fair_tasks import fair_noop, tenant_noop  # noqa: E402
from bench.tables import empty, refuse_unless_named, tables_of  # noqa: E402

KINDS = {"plain": tenant_noop, "fair": fair_noop}
EXPLAINS = 30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000, help="fair groups (1,000)")
    parser.add_argument("--per-round", type=int, default=200, help="enqueues per round (200)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of each kind (12)")
    return parser.parse_args()


def connect_with(prepare_threshold: int | None) -> None:
    """Close the connection; the next query opens one with ``prepare_threshold``."""
    connection.close()
    connection.settings_dict.setdefault("OPTIONS", {})["prepare_threshold"] = prepare_threshold


def rates(tenants: list[str], per_round: int, rounds: int) -> dict[str, float]:
    """The median round's rate of each kind, in turns (who goes first alternating)."""
    done: dict[str, list[float]] = {kind: [] for kind in KINDS}
    n = 0
    for round_ in range(rounds):
        order = list(KINDS.items())[:: 1 if round_ % 2 else -1]
        for kind, task in order:
            began = time.perf_counter()
            for _ in range(per_round):
                task.enqueue(tenants[n % len(tenants)])
                n += 1
            done[kind].append(per_round / (time.perf_counter() - began))
    return {kind: statistics.median(values) for kind, values in done.items()}


def last_statements() -> dict[str, tuple[str, Any]]:
    """The insert statement each kind's single enqueue sends, with its parameters."""
    sent: dict[str, tuple[str, Any]] = {}
    for kind, task in KINDS.items():

        def keep(
            execute: Any, sql: str, params: Any, many: bool, context: Any, kind: str = kind
        ) -> Any:
            if sql.startswith("WITH new_jobs"):
                sent[kind] = (sql, params)
            return execute(sql, params, many, context)

        with connection.execute_wrapper(keep):
            task.enqueue("tenant-0")
    return sent


def plan_times(sql: str, params: Any) -> tuple[float, float]:
    """Median planning and execution ms of ``sql``, run and rolled back."""
    planning, execution = [], []
    for _ in range(EXPLAINS):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN (ANALYZE, SUMMARY) {sql}", params)
                text = "\n".join(row[0] for row in cursor.fetchall())
            transaction.set_rollback(True)
        planning.append(float(re.search(r"Planning Time: ([\d.]+)", text).group(1)))
        execution.append(float(re.search(r"Execution Time: ([\d.]+)", text).group(1)))
    return statistics.median(planning), statistics.median(execution)


def prepared_plans() -> list[tuple[str, int, int]]:
    """This session's prepared inserts of a job: (kind, generic plans, custom plans)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE 'WITH new_jobs%%'"
        )
        rows = cursor.fetchall()
    return [("fair" if "fair_key" in sql else "plain", g, c) for sql, g, c in rows]


def main() -> int:
    options = parse_args()
    if connection.vendor != "postgresql":
        raise SystemExit(f"PostgreSQL only (its prepared statements), not {connection.vendor}")
    refuse_unless_named()
    call_command("migrate", interactive=False, verbosity=0)
    empty(tables_of("django_jobs"))
    tenants = [f"tenant-{n}" for n in range(options.tenants)]
    backend = task_backends["default"]
    for task in KINDS.values():  # every tenant's stamp made first, not timed
        backend.bulk_enqueue([(task, (tenant,), {}) for tenant in tenants])
    print(
        f"{options.rounds} rounds of {options.per_round} single enqueues of each kind, "
        f"alternated, over {options.tenants:,} tenants"
    )
    for threshold in (None, 5):
        connect_with(threshold)
        got = rates(tenants, options.per_round, options.rounds)
        print(
            f"prepare_threshold={threshold}: plain {got['plain']:,.0f}/s, fair "
            f"{got['fair']:,.0f}/s, fair / plain {got['fair'] / got['plain']:.3f}"
        )
        for kind, generic, custom in prepared_plans():
            print(f"  prepared {kind}: {generic:,} generic plans, {custom:,} custom")
        for kind, (sql, params) in last_statements().items():
            planning, execution = plan_times(sql, params)
            print(f"  {kind}: planning {planning:.3f} ms, execution {execution:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
