"""What the test toolkit raises when it cannot do what a test asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django_jobs.testing.report import RunReport


class JobsNotReady(ImproperlyConfigured):
    """The database the toolkit was pointed at cannot hold jobs: ``django_jobs`` is not
    installed, or its tables are missing (migrations not applied), or no task backend
    writes jobs there. The message names the fix."""


class RunawayJobs(AssertionError):
    """``run_enqueued_jobs()`` ran ``max_runs`` jobs and more were still due: most
    likely a job that enqueues another like it, forever. An ``AssertionError``, so that
    a test runner reports it as the test's failure. ``report`` holds what ran."""

    def __init__(self, message: str, report: RunReport) -> None:
        super().__init__(message)
        self.report = report
