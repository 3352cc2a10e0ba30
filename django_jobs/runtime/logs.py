"""Visible output for ``run_jobs`` when the project has not configured our loggers."""

from __future__ import annotations

import logging
import sys

from django.conf import settings

LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


class WithoutDjangosTaskEvents(logging.Filter):
    """Drops ``django.tasks``' own "Task id=… state=…" lines for starts and successes.

    Django logs every task start and finish from its signal receivers; a worker
    of ours logs the same event with more in it (attempt, duration, error,
    retry), so each event showed twice. Failures (ERROR) stay: Django's default
    LOGGING mails them to ADMINS, and a project may rely on that.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.funcName not in (
            "log_task_started",
            "log_task_finished",
        )


def quiet_djangos_task_events() -> None:
    """In worker processes only, unless the project's LOGGING configures ``django.tasks``."""
    configured = (getattr(settings, "LOGGING", None) or {}).get("loggers", {})
    tasks_logger = logging.getLogger("django.tasks")
    if "django.tasks" in configured:
        return
    if not any(isinstance(f, WithoutDjangosTaskEvents) for f in tasks_logger.filters):
        tasks_logger.addFilter(WithoutDjangosTaskEvents())
    if tasks_logger.level == logging.NOTSET:
        # The filter runs once a record is made (the caller's frame found, the message
        # kept): two records per job that are dropped, 15% of a no-op job's CPU in a
        # worker. Below WARNING nothing of django.tasks' would pass anyway (its
        # enqueue line is DEBUG), so none is made; its failures (ERROR) still are.
        tasks_logger.setLevel(logging.WARNING)


def configure_logging(verbosity: int) -> None:
    """Attach a stream handler to ``django_jobs`` unless the project's LOGGING already did,
    and leave one log line per job event (see :class:`WithoutDjangosTaskEvents`)."""
    quiet_djangos_task_events()
    logger = logging.getLogger("django_jobs")
    if logger.handlers or logging.getLogger().handlers:
        return
    logger.setLevel(LEVELS.get(verbosity, logging.INFO))
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.propagate = False
