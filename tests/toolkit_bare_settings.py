"""The test project's settings without django_jobs in INSTALLED_APPS: what the test
toolkit says when a project forgot it (tests/test_testing_toolkit.py)."""

from testproject.settings import *  # noqa: F403

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "django_jobs"]  # noqa: F405
