"""Rate-limited tasks for tests/test_rate_limits.py: each records its own start."""

from __future__ import annotations

from django_jobs import task
from tests.control_tasks import audit


@task(takes_context=True, rate_limit="3/s", rate_key="{account}")
def call_api(context, account: str) -> str:
    audit(context, f"rate:{account}")
    return account


@task(rate_limit="1/m")
def once_a_minute(value: int) -> int:
    return value


@task(rate_limit="2/s", concurrency_key="{account}", concurrency_limit=1)
def keyed_and_rated(account: str) -> str:
    return account


@task(rate_limit="partner-api", rate_key="{account}")
def partner_call(account: str) -> str:
    return account


@task(rate_limit="partner-api")
def partner_report() -> None:
    return None
