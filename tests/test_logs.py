"""One log line per job event in run_jobs, whatever the project's LOGGING says."""

from __future__ import annotations

import logging

import pytest
from django.tasks import TaskResultStatus
from django.tasks.signals import task_finished, task_started

from django_jobs.runtime.logs import quiet_djangos_task_events
from tests import tasks


@pytest.fixture
def django_tasks_logger():
    logger = logging.getLogger("django.tasks")
    saved = list(logger.filters)
    yield logger
    logger.filters = saved


def send_events(result, status: TaskResultStatus) -> None:
    backend = type(tasks.add.get_backend())
    task_started.send(backend, task_result=result)
    object.__setattr__(result, "status", status)
    task_finished.send(backend, task_result=result)


@pytest.mark.django_db
def test_djangos_start_and_success_lines_are_dropped_failures_kept(
    django_tasks_logger, settings, caplog
):
    settings.LOGGING = {"version": 1, "loggers": {"django": {"level": "INFO"}}}
    result = tasks.add.enqueue(1, 2)
    with caplog.at_level(logging.INFO, logger="django.tasks"):
        send_events(result, TaskResultStatus.SUCCESSFUL)
        assert [r.funcName for r in caplog.records] == ["log_task_started", "log_task_finished"]
        caplog.clear()
        quiet_djangos_task_events()
        quiet_djangos_task_events()  # idempotent: one filter, whoever calls it twice
        assert len(django_tasks_logger.filters) == 1
        send_events(result, TaskResultStatus.SUCCESSFUL)
        assert caplog.records == []
        send_events(result, TaskResultStatus.FAILED)
    # A failure still reaches Django's handlers (mail_admins by default).
    assert [(r.funcName, r.levelno) for r in caplog.records] == [
        ("log_task_finished", logging.ERROR)
    ]


@pytest.mark.django_db
def test_a_project_that_configures_django_tasks_keeps_every_line(
    django_tasks_logger, settings, caplog
):
    settings.LOGGING = {"version": 1, "loggers": {"django.tasks": {"level": "INFO"}}}
    quiet_djangos_task_events()
    assert django_tasks_logger.filters == []
    result = tasks.add.enqueue(1, 2)
    with caplog.at_level(logging.INFO, logger="django.tasks"):
        send_events(result, TaskResultStatus.SUCCESSFUL)
    assert [r.funcName for r in caplog.records] == ["log_task_started", "log_task_finished"]
