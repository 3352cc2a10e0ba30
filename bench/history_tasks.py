"""The keyed no-op of bench/history.py: one task, so its workers find it by this module's path.

bench/tasks.py's ``noop_keyed`` admits one job per key; issue 37's keyed drain asks for
two, the limit a deployment throttling calls per account would more likely set.
"""

from django_jobs import task

KEYED_LIMIT = 2


@task(concurrency_key="{key}", concurrency_limit=KEYED_LIMIT)
def noop_keyed(key: int) -> None:
    """Nothing, at most ``KEYED_LIMIT`` at a time per ``key``: admission, blocking and
    promotion are the cost."""
