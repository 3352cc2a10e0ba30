"""One Procrastinate worker process for bench/throughput.py, set up as its documentation advises.

    python bench/procrastinate_worker.py --concurrency N [--pool M]

Procrastinate's Django how-to gives two ways to run a worker: ``manage.py
procrastinate worker`` and a script of one's own that swaps the Django
connector for a worker connector ("Running custom Django scripts"). The
command's connector keeps psycopg_pool's default of 4 connections whatever the
concurrency, and its docs say a pool smaller than the concurrency (plus one)
leaves sub-workers waiting for a connection, which short jobs feel most
("Mind the size of your PostgreSQL pool"). So this is the script: the same
database settings, a pool of ``concurrency + 1`` connections, ``concurrency``
sub-workers, LISTEN/NOTIFY on (its default), every other option at its default.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
os.environ["JOBS_BENCH_PROCRASTINATE"] = "true"

import django


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, required=True, help="sub-workers")
    parser.add_argument("--pool", type=int, help="connections in the pool (concurrency + 1)")
    options = parser.parse_args()
    django.setup()
    from procrastinate import PsycopgConnector
    from procrastinate.contrib.django import app
    from procrastinate.contrib.django.utils import connector_params

    size = options.pool or options.concurrency + 1
    connector = PsycopgConnector(kwargs=connector_params(), min_size=size, max_size=size)
    with app.replace_connector(connector):
        app.run_worker(concurrency=options.concurrency, queues=["default"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
