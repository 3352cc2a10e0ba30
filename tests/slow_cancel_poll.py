"""Settings for a ``run_jobs`` whose workers look for cancel requests every 30 s only.

Used as ``DJANGO_SETTINGS_MODULE`` by the test of PostgreSQL's cancel NOTIFY: with the
poll that far apart, only the notification can explain a running job that stops within
a second or two of its ``cancel()``. The poll interval is a module attribute of the
watchdog, read at every check, so it is set as the apps are ready: before any worker
starts.
"""

from django.apps import AppConfig

from testproject.settings import *  # noqa: F403

SLOW_CANCEL_POLL = 30.0


class SlowCancelPoll(AppConfig):
    name = "tests"
    label = "slow_cancel_poll"

    def ready(self) -> None:
        from django_jobs.runner import watchdog

        watchdog.CANCEL_POLL_INTERVAL = SLOW_CANCEL_POLL


INSTALLED_APPS = [*INSTALLED_APPS, "tests.slow_cancel_poll.SlowCancelPoll"]  # noqa: F405
