"""No-op tasks of bench/throughput.py's phase "fair" (issue 38): one in the fair queue of
bench/settings.py (``DJANGO_JOBS["fair_queues"]``), grouped by tenant, and its twin in a
queue that is not fair, taking the same argument, so that the two differ by fairness alone.
"""

from django_jobs import task

FAIR_QUEUE = "fair"  # declared in bench/settings.py's QUEUES and fair_queues


@task(queue_name=FAIR_QUEUE, fair_key="{tenant}")
def fair_noop(tenant: str) -> None:
    """Nothing, in the fair queue: its tenant's group takes turns with the others'."""


@task
def tenant_noop(tenant: str) -> None:
    """Nothing, in queue "default", which is not fair: the jobs run in the order of their ids."""
