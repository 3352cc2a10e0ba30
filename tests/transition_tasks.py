"""Tasks for the in-process transition tests (claims, recovery, scheduling, admission)."""

from __future__ import annotations

from django_jobs import task


@task
def noop(value=None):
    return value


@task(concurrency_key="one:{name}", concurrency_limit=1)
def one_at_a_time(name: str, n: int = 0) -> int:
    return n


@task(concurrency_key="two:{name}", concurrency_limit=2)
def two_at_a_time(name: str, n: int = 0) -> int:
    return n


@task(concurrency_key="one:{name}", concurrency_limit=1, max_attempts=3, backoff=0)
def one_at_a_time_retried(name: str, n: int = 0) -> int:
    return n


@task(max_attempts=3, backoff=30)
def retried_later() -> None:
    return None


@task(max_attempts=3, backoff=0)
def retried_at_once() -> None:
    return None
