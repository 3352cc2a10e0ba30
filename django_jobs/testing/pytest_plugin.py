"""The ``jobs`` fixture for pytest-django users: the toolkit's functions on one object.

Registered through the ``pytest11`` entry point, so pytest loads this module in every
run where the package is installed, projects without Django settings included: it
imports nothing of Django's here, only inside the fixture, and in the collection hook
for the tests that use the fixture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

# The arguments of pytest-django's django_db marker, in their positional order.
DJANGO_DB_ARGUMENTS = (
    "transaction",
    "reset_sequences",
    "databases",
    "serialized_rollback",
    "available_apps",
)


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
        self.clear_dummy_backends = testing.clear_dummy_backends


def jobs_fixture(db: None) -> JobsToolkit:
    """django-jobs' test toolkit (``django_jobs.testing``), with database access: in a
    transaction rolled back after the test, or with ``transactional_db`` (or
    ``@pytest.mark.django_db(transaction=True)``) committed as in production. The jobs
    database (``DJANGO_JOBS["database"]``) is added to the test's databases, and what
    Django's ``DummyBackend`` kept from the tests before is cleared."""
    toolkit = JobsToolkit()
    toolkit.clear_dummy_backends()
    return toolkit


jobs = pytest.fixture(name="jobs")(jobs_fixture)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each test that uses our ``jobs`` fixture access to the jobs database too,
    when it is not ``default`` (``DJANGO_JOBS["database"]`` with ``JobsRouter``):
    pytest-django lets a test reach ``default`` alone unless its ``django_db`` marker
    names more, and the marker must be in place before any database fixture is set up."""
    ours = [item for item in items if uses_our_fixture(item)]
    if not ours:
        return
    alias = jobs_database()
    if alias is None or alias == "default":
        return
    for item in ours:
        marker = item.get_closest_marker("django_db")
        arguments: dict[str, Any] = {}
        if marker is not None:
            arguments = dict(zip(DJANGO_DB_ARGUMENTS, marker.args, strict=False))
            arguments.update(marker.kwargs)
        databases = arguments.get("databases") or ["default"]
        if databases == "__all__" or alias in databases:
            continue
        arguments["databases"] = [*databases, alias]
        item.add_marker(pytest.mark.django_db(**arguments), append=False)


def uses_our_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` asks for the ``jobs`` fixture defined here, not a project's own."""
    info = getattr(item, "_fixtureinfo", None)
    definitions: Sequence[object] = getattr(info, "name2fixturedefs", {}).get("jobs") or ()
    # The last definition is the one the test gets (the closest to it).
    return bool(definitions) and getattr(definitions[-1], "func", None) is jobs_fixture


def jobs_database() -> str | None:
    """``DJANGO_JOBS["database"]``, or None where Django's settings are not configured."""
    from django.conf import settings

    if not settings.configured:
        return None
    from django_jobs.conf import database_alias

    return database_alias()
