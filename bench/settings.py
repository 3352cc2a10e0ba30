"""Settings of the throughput benchmark: the test project plus django-tasks-db, the peer.

Both backends store their rows in the ``default`` database (``DATABASE_URL``),
so the worker processes of each talk to the same server through the same
driver with the same persistent connections (``CONN_MAX_AGE=600``, also on
SQLite, where the test project turns it off for its test suite).

``DEBUG`` is off unless ``DEBUG=true`` is in the environment: with it on,
every query of a worker is kept in ``connection.queries`` (time and memory
that production never pays) and ``db_worker`` runs under the autoreloader,
one more process polling the file system.

Procrastinate, the second peer, is installed only when the environment has
``JOBS_BENCH_PROCRASTINATE=true`` and the database is PostgreSQL (its schema
is PostgreSQL's alone): the harness sets it for itself and for Procrastinate's
workers when its phase runs, never for the other workers, whose startup and
memory would otherwise include an app they never use.
"""

from importlib.util import find_spec

from testproject.settings import *  # noqa: F403
from testproject.settings import DATABASES, DJANGO_JOBS, INSTALLED_APPS, TASKS, env

DEBUG = env.bool("DEBUG", default=False)

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]

# Phase "fair" of bench/throughput.py (issue 38): a queue whose ready jobs take turns by
# tenant (bench/fair_tasks.py). No other phase enqueues into it, and a fair queue changes
# nothing for the others' jobs.
FAIR_QUEUE = "fair"
DJANGO_JOBS = {**DJANGO_JOBS, "fair_queues": [FAIR_QUEUE]}

TASKS = {
    **TASKS,
    "default": {**TASKS["default"], "QUEUES": [*TASKS["default"]["QUEUES"], FAIR_QUEUE]},
    # The peer, under its own alias: its worker takes only rows whose backend_name is "peer".
    "peer": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]},
}

DATABASES["default"]["CONN_MAX_AGE"] = 600
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # docs/deployment.md's advice for a database reached directly (no pooler): psycopg
    # prepares a statement after its fifth use. Django's own queries bind on the client
    # and are not prepared, so the peer's writes are what they are by default; ours (the
    # enqueue's insert, the worker's claim, start and finish) bind on the server and are.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("prepare_threshold", 5)

BENCH_PROCRASTINATE = (
    env.bool("JOBS_BENCH_PROCRASTINATE", default=False)
    and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"
    and find_spec("procrastinate") is not None
)
if BENCH_PROCRASTINATE:
    INSTALLED_APPS = [*INSTALLED_APPS, "procrastinate.contrib.django"]
    # Only the bench's tasks: no autodiscovery of every app's "tasks" module.
    PROCRASTINATE_AUTODISCOVER_MODULE_NAME = ""
    PROCRASTINATE_IMPORT_PATHS = ["bench.procrastinate_tasks"]
