"""Settings of the demo and test project, read from the environment with django-environ.

DATABASE_URL picks the database (default: a SQLite file beside this one), e.g.
``postgres://postgres@127.0.0.1:5432/django_jobs`` or
``mysql://root@127.0.0.1:3306/django_jobs``.
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent
env = environ.Env()

SECRET_KEY = env("SECRET_KEY", default="django-jobs-testproject-not-secret")
DEBUG = env.bool("DEBUG", default=True)
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_jobs",
    "testproject.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "testproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"

SQLITE_PATH = BASE_DIR / "db.sqlite3"
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{SQLITE_PATH}")}
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=600)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # A file, not :memory:, so run_jobs subprocesses share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / "test-db.sqlite3")}
elif DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    DATABASES["default"].setdefault("OPTIONS", {})["charset"] = "utf8mb4"
# Behind PgBouncer in transaction pooling: no server-side cursors (a WITH HOLD cursor is
# session state, which the next transaction may not find on its server connection).
if env.bool("DISABLE_SERVER_SIDE_CURSORS", default=False):
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
# A database to LISTEN through for ready jobs (tests route it through a proxy, or past
# PgBouncer straight to PostgreSQL).
if env.str("JOBS_LISTEN_DATABASE_URL", default=""):
    DATABASES["listen"] = env.db("JOBS_LISTEN_DATABASE_URL")
# An explicit test database name (used by tox to keep parallel runs apart).
if env.str("TEST_DATABASE_NAME", default=""):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = env.str("TEST_DATABASE_NAME")

TASKS = {
    "default": {
        "BACKEND": "django_jobs.backend.JobsBackend",
        "QUEUES": ["default", "emails", "reports", "reports-daily", "slow"],
    }
}

# Django's own test backends instead of ours (tests/test_other_backends.py): "immediate" or
# "dummy" (Django's classes), "jobs-immediate" or "jobs-dummy" (ours, whose task_class takes
# django-jobs options through django.tasks.task).
OTHER_TASK_BACKENDS = {
    "immediate": "django.tasks.backends.immediate.ImmediateBackend",
    "dummy": "django.tasks.backends.dummy.DummyBackend",
    "jobs-immediate": "django_jobs.backend.ImmediateBackend",
    "jobs-dummy": "django_jobs.backend.DummyBackend",
}
if env.str("JOBS_TASKS_BACKEND", default=""):
    TASKS = {
        "default": {**TASKS["default"], "BACKEND": OTHER_TASK_BACKENDS[env("JOBS_TASKS_BACKEND")]}
    }

DJANGO_JOBS = {
    "queues": env.list("JOBS_QUEUES", default=["*"]),
    "threads": env.int("JOBS_THREADS", default=3),
    "processes": env.int("JOBS_PROCESSES", default=1),
    "polling_interval": env.float("JOBS_POLLING_INTERVAL", default=0.2),
    "fallback_polling_interval": env.float("JOBS_FALLBACK_POLLING_INTERVAL", default=2.0),
    # MariaDB/SQLite: the supervisor's check for ready jobs; "none" turns it off.
    "ready_check_interval": (
        None
        if env.str("JOBS_READY_CHECK_INTERVAL", default="") == "none"
        else env.float("JOBS_READY_CHECK_INTERVAL", default=0.025)
    ),
    "dispatcher_interval": env.float("JOBS_DISPATCHER_INTERVAL", default=1.0),
    "heartbeat_interval": env.float("JOBS_HEARTBEAT_INTERVAL", default=60.0),
    "alive_threshold": env.float("JOBS_ALIVE_THRESHOLD", default=300.0),
    "shutdown_timeout": env.float("JOBS_SHUTDOWN_TIMEOUT", default=5.0),
    "interrupt_grace": env.float("JOBS_INTERRUPT_GRACE", default=5.0),
    "cancel_poll_interval": env.float("JOBS_CANCEL_POLL_INTERVAL", default=1.0),
    # Seconds an async job may hold its worker's event loop before a stall is counted.
    "event_loop_block_threshold": env.float("JOBS_EVENT_LOOP_BLOCK_THRESHOLD", default=0.5),
    "max_error_size": env.int("JOBS_MAX_ERROR_SIZE", default=64 * 1024),
    # "queue=N,other=M": queue-wide caps across all workers.
    "max_concurrency": {
        queue: int(cap) for queue, cap in env.dict("JOBS_MAX_CONCURRENCY", default={}).items()
    },
    # LISTEN/NOTIFY on PostgreSQL: on unless JOBS_LISTEN_NOTIFY=false; through the
    # "listen" database when JOBS_LISTEN_DATABASE_URL names one.
    "listen_notify": "listen" if "listen" in DATABASES else env.bool("JOBS_LISTEN_NOTIFY", True),
    # Rates tasks share by name (@task(rate_limit="partner-api")), as JSON.
    "rate_limits": env.json("JOBS_RATE_LIMITS", default={"partner-api": "5/s"}),
    # Recurring tasks as JSON: {"key": {"task": "...", "schedule": "every 1 second"}}.
    "recurring": env.json("JOBS_RECURRING", default={}),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"}
    },
    "handlers": {
        # Lines written in batches by a thread of their own (docs/running.md, "Logs").
        "console": {
            "class": "django_jobs.runtime.logs.BufferedStreamHandler",
            "formatter": "plain",
        },
        "null": {"class": "logging.NullHandler"},
    },
    "loggers": {
        "django_jobs": {"handlers": ["console"], "level": env("JOBS_LOG_LEVEL", default="INFO")},
        "testproject": {"handlers": ["console"], "level": "INFO"},
        # Django logs every task start and finish on "django.tasks" (through its own console
        # handler while DEBUG is on), and django_jobs.worker logs the same events with the
        # attempt, duration and error: without this each job event printed twice. A
        # NullHandler, not just no handler: records of a logger with none that does not
        # propagate would still reach logging's last-resort handler from WARNING up. At
        # WARNING, the dropped start/finish lines are not even made (two records per job).
        "django.tasks": {"handlers": ["null"], "level": "WARNING", "propagate": False},
    },
}
