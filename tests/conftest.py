"""Shared fixtures: the database under test, and real ``run_jobs`` subprocesses."""

from __future__ import annotations

import pytest

from tests.harness import RunJobs, database_url


@pytest.fixture
def jobs_db(settings) -> str:
    """The alias the backend writes to (``default`` in the test project)."""
    return "default"


@pytest.fixture
def run_jobs(transactional_db, tmp_path):
    """Start real ``manage.py run_jobs`` processes against the test database.

    Every process started is stopped (SIGKILL if need be) at teardown.
    """
    started: list[RunJobs] = []

    def start(*args: str, env: dict[str, str] | None = None) -> RunJobs:
        proc = RunJobs(
            list(args),
            database_url=database_url(),
            log_path=tmp_path / f"run_jobs-{len(started)}.log",
            extra_env=env or {},
        )
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()
