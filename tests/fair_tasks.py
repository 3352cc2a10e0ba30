"""Tasks of a fair queue for tests/test_fair_options.py: "reports" is the queue the tests
make fair (``DJANGO_JOBS["fair_queues"]``), "default" one they leave as it is."""

from __future__ import annotations

from typing import Any

from django_jobs import task

# What ``key_from`` gives for a call's ``key``: values no fair key may be.
ODD_KEYS: dict[str, Any] = {
    "empty": "",
    "int": 7,
    "none": None,
    "long": "k" * 256,
    "nul": "acme\x00corp",
}


def key_from(key: str, day: str = "monday") -> Any:
    """A callable fair key: the call's ``key``, or the odd value it names."""
    return ODD_KEYS.get(key, key)


@task(queue_name="reports", fair_key="{tenant_id}")
def tenant_report(tenant_id: Any, day: str = "monday") -> str:
    return f"{tenant_id} {day}"


@task(queue_name="reports", fair_key="tenant-{tenant_id}", fair_weight=2.5)
def weighted_report(tenant_id: int) -> int:
    return tenant_id


@task(queue_name="reports", fair_key=key_from)
def keyed_by_function(key: str, day: str = "monday") -> str:
    return key


@task(queue_name="reports")
def unkeyed_report(n: int = 0) -> int:
    return n


@task
def plain_default(n: int = 0) -> int:
    """A task of the default queue, which the tests leave unfair."""
    return n


@task(queue_name="reports", fair_key="{tenant_id}", concurrency_key="{tenant_id}")
def capped_report(tenant_id: Any) -> Any:
    """A fair key that is also a concurrency key (limit 1)."""
    return tenant_id


@task(queue_name="reports", fair_key="{tenant_id}", unique_key="{tenant_id}-{n}")
def unique_report(tenant_id: Any, n: int) -> int:
    """A fair key with a unique key."""
    return n


@task(queue_name="reports", fair_key="{tenant_id}", rate_limit="1000/s")
def rated_report(tenant_id: Any) -> Any:
    """A fair key with a rate limit (one its jobs never reach)."""
    return tenant_id
