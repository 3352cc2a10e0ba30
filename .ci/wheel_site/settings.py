"""Settings of the wheel check: SQLite in the temporary directory, the app and the admin.

DEBUG is on so the staticfiles app serves the wheel's CSS to the test client: a missing
static file is then a 404 the check sees, not a blank stylesheet in production.
"""

import os
from pathlib import Path

BASE_DIR = Path(os.environ.get("WHEEL_SITE_DIR", Path(__file__).resolve().parent.parent))

SECRET_KEY = "wheel-check-not-secret"
DEBUG = True
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
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "wheel_site.urls"
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
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "wheel.sqlite3",
        "OPTIONS": {"transaction_mode": "IMMEDIATE"},  # check E002: what the app requires
    }
}
# The admin tests' reason: Django's default hasher spends half a second per password.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

TASKS = {
    "default": {
        "BACKEND": "django_jobs.backend.JobsBackend",
        "QUEUES": ["default", "emails"],
    }
}
DJANGO_JOBS = {
    "threads": 2,
    "recurring": {
        "hourly-ping": {"task": "wheel_site.tasks.ping", "schedule": "every 1 hour"},
        "nightly-ping": {"task": "wheel_site.tasks.ping", "schedule": "0 3 * * *", "args": [9]},
    },
}

# Quiet: the refusals the check expects (403) would each print a traceback, and the jobs'
# runs (one fails on purpose) their lines; a 500 is reported anyway, and drive.py checks
# the jobs' states.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {
        "django.request": {"level": "ERROR"},
        "django.tasks": {"handlers": ["null"], "propagate": False},
        # A handler here keeps run_jobs from attaching its own console handler.
        "django_jobs": {"handlers": ["null"], "propagate": False},
    },
}
