"""Settings for a ``run_jobs`` whose workers look for cancel requests every 30 s only.

Used as ``DJANGO_SETTINGS_MODULE`` by the test of PostgreSQL's cancel NOTIFY: with the
poll that far apart, only the notification can explain a running job that stops within
a second or two of its ``cancel()``. (``JOBS_CANCEL_POLL_INTERVAL=30`` in the
environment does the same with ``testproject.settings``.)
"""

from testproject.settings import *  # noqa: F403

DJANGO_JOBS = {**DJANGO_JOBS, "cancel_poll_interval": 30.0}  # noqa: F405
