"""The ``jobs`` fixture for pytest-django users: the toolkit's functions on one object.

Registered through the ``pytest11`` entry point, so pytest loads this module in every
run where the package is installed, projects without Django settings included: it
imports nothing of Django's here, only inside the fixture.
"""

from __future__ import annotations

import pytest


class JobsToolkit:
    """What the ``jobs`` fixture gives a test: ``jobs.run_enqueued_jobs()``,
    ``jobs.assert_enqueued(...)``, and the rest of ``django_jobs.testing``'s functions."""

    def __init__(self) -> None:
        from django_jobs import testing

        self.run_enqueued_jobs = testing.run_enqueued_jobs
        self.enqueue_recurring = testing.enqueue_recurring
        self.enqueued_jobs = testing.enqueued_jobs
        self.assert_enqueued = testing.assert_enqueued
        self.assert_not_enqueued = testing.assert_not_enqueued


@pytest.fixture
def jobs(db: None) -> JobsToolkit:
    """django-jobs' test toolkit (``django_jobs.testing``), with database access: in a
    transaction rolled back after the test, or with ``transactional_db`` (or
    ``@pytest.mark.django_db(transaction=True)``) committed as in production."""
    return JobsToolkit()
