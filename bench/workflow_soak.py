"""Workflows at full size: random graphs on real processes, busy workers SIGKILLed, audited.

    python bench/workflow_soak.py --db postgres|mariadb|sqlite
                                  [--graphs 1000] [--nodes 20000] [--processes 2]
                                  [--threads 8] [--kills 2] [--seed N] [--backlog 500]
                                  [--timeout 3600] [--json PATH] [--keep-logs]

Run from the repository root (Linux: worker processes are found in /proc). The
database is ``--db``'s (``jobs_wf_soak`` on 127.0.0.1, or /tmp/jobs_wf_soak.sqlite3),
else ``DATABASE_URL``'s; it is created if missing and migrated, and its name must
contain "soak": the run empties django_jobs' tables first.

At least ``--graphs`` random graphs and ``--nodes`` nodes in all (chains, diamonds, wide
fan-ins, random DAGs, some waiting for a node of an earlier graph; planned failures with
retries, some for good; policies cancel/run/fail; a few keys, priorities and queues) are
enqueued while one ``run_jobs`` runs them, keeping at most ``--backlog`` jobs unended;
``--kills`` busy worker processes are SIGKILLed along the way (the k-th once k/(kills+1)
of the nodes have ended). Once every job has ended, the audit made from the node bodies'
own records and the rows is printed, one figure a line with its bound (the machinery and
the figures are tests/workflow_stress_tasks.py's, which tests/test_workflow_stress.py runs
at CI size). Exit status 1 if a figure is over its bound, 2 if the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATABASE_URLS = {
    "postgres": "postgres://postgres@127.0.0.1:5432/jobs_wf_soak",
    "mariadb": "mysql://root@127.0.0.1:3306/jobs_wf_soak",
    "sqlite": "sqlite:////tmp/jobs_wf_soak.sqlite3",
}
SAFE_NAME_PART = "soak"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=sorted(DATABASE_URLS), help="default: DATABASE_URL")
    parser.add_argument("--graphs", type=int, default=1000, help="at least this many (1000)")
    parser.add_argument("--nodes", type=int, default=20000, help="at least this many (20000)")
    parser.add_argument("--processes", type=int, default=2, help="run_jobs --processes (2)")
    parser.add_argument("--threads", type=int, default=8, help="run_jobs --threads (8)")
    parser.add_argument("--kills", type=int, default=2, help="busy workers SIGKILLed (2)")
    parser.add_argument("--seed", type=int, help="random seed (default: from the clock)")
    parser.add_argument("--backlog", type=int, default=500, help="most jobs unended (500)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs and records")
    return parser.parse_args(argv)


if __name__ == "__main__":
    OPTIONS = parse_args()
    # Settings are read at django.setup(): the environment must be ready before it.
    sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ.setdefault("DEBUG", "false")  # no connection.queries piling up
    if OPTIONS.db:
        os.environ["DATABASE_URL"] = DATABASE_URLS[OPTIONS.db]
    os.environ.setdefault("DATABASE_URL", DATABASE_URLS["postgres"])
    os.environ.pop("TEST_DATABASE_NAME", None)
    import django

    django.setup()

from django.db import connection  # noqa: E402

from tests import workflow_stress_tasks as ws  # noqa: E402
from tests.harness import RunJobs, prepare_soak_database  # noqa: E402


def progress(message: str) -> None:
    print(f"- {message}", file=sys.stderr, flush=True)


def main(options: argparse.Namespace) -> int:
    prepare_soak_database(SAFE_NAME_PART)
    seed = options.seed if options.seed is not None else time.time_ns() % 1_000_000
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-wf-soak-"))
    config = ws.Config(
        graphs=options.graphs,
        nodes=options.nodes,
        processes=options.processes,
        threads=options.threads,
        kills=options.kills,
        seed=seed,
        work_dir=work_dir,
        backlog=options.backlog,
        timeout=options.timeout,
        progress=progress,
    )
    started: list[RunJobs] = []

    def start(args: list[str], env: dict[str, str]) -> RunJobs:
        proc = RunJobs(
            args,
            database_url=os.environ["DATABASE_URL"],
            log_path=work_dir / f"run_jobs-{len(started)}.log",
            extra_env=env,
        )
        proc.start()
        started.append(proc)
        return proc

    progress(f"workflow soak on {connection.vendor}: records and logs in {work_dir}")
    try:
        report = ws.WorkflowStress(config, start).run()
    except Exception:
        progress(f"the run failed; logs kept in {work_dir}")
        raise
    finally:
        for proc in started:
            proc.close()
    print(f"workflow soak on {connection.vendor}")
    print(report.table())
    if options.json:
        document: dict[str, Any] = {
            "vendor": connection.vendor,
            "info": report.info,
            "figures": [
                {"name": f.name, "value": f.value, "bound": f.bound, "ok": f.ok}
                for f in report.figures
            ],
            "ok": not report.over(),
        }
        options.json.write_text(json.dumps(document, indent=2, default=str))
    if options.keep_logs or report.over():
        progress(f"logs and records kept in {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 1 if report.over() else 0


if __name__ == "__main__":
    try:
        sys.exit(main(OPTIONS))
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(2)
