"""No-op tasks for bench/throughput.py: each job costs only what the queue itself costs.

``noop`` and ``noop_keyed`` run on django-jobs (the ``default`` backend);
``peer_noop`` runs on django-tasks-db (the ``peer`` backend of
bench/settings.py). They are separate functions because a task is found again
by its function's dotted path, which must name the ``Task`` of the right backend.
"""

from django.tasks import task as django_task

from django_jobs import task


@task
def noop() -> None:
    """Nothing: a job of ours with no concurrency key."""


@task(concurrency_key="{key}", concurrency_limit=1)
def noop_keyed(key: int) -> None:
    """Nothing, one at a time per ``key``: admission, blocking and promotion are the cost."""


@django_task(backend="peer")
def peer_noop() -> None:
    """Nothing: a job of django-tasks-db."""
