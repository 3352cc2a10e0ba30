"""Settings of the throughput benchmark: the test project plus django-tasks-db, the peer.

Both backends store their rows in the ``default`` database (``DATABASE_URL``),
so the worker processes of each talk to the same server through the same
driver with the same persistent connections (``CONN_MAX_AGE=600``, also on
SQLite, where the test project turns it off for its test suite).

``DEBUG`` is off unless ``DEBUG=true`` is in the environment: with it on,
every query of a worker is kept in ``connection.queries`` (time and memory
that production never pays) and ``db_worker`` runs under the autoreloader,
one more process polling the file system.
"""

from testproject.settings import *  # noqa: F403
from testproject.settings import DATABASES, INSTALLED_APPS, TASKS, env

DEBUG = env.bool("DEBUG", default=False)

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]

TASKS = {
    **TASKS,
    # The peer, under its own alias: its worker takes only rows whose backend_name is "peer".
    "peer": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]},
}

DATABASES["default"]["CONN_MAX_AGE"] = 600
