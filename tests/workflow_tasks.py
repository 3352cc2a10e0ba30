"""Tasks for the workflow tests; importable by run_jobs subprocesses."""

from __future__ import annotations

from django_jobs import dependency_results
from django_jobs import task as jobs_task


@jobs_task
def step(name: str, fail: bool = False) -> str:
    if fail:
        raise ValueError(f"step {name} failed")
    return name


@jobs_task(max_attempts=3, backoff=0)
def flaky(name: str) -> str:
    raise ValueError(f"{name} always fails")


@jobs_task
def merge(label: str = "merge") -> list:
    """Returns what its dependencies returned, in its after= order."""
    return [result.return_value for result in dependency_results()]


@jobs_task(on_dependency_failure="run")
def cleanup(label: str = "cleanup") -> list:
    return [result.status.value for result in dependency_results()]


@jobs_task(concurrency_key="k", concurrency_limit=1)
def keyed(name: str) -> str:
    return name


@jobs_task(unique_key="{name}")
def unique(name: str) -> str:
    return name
