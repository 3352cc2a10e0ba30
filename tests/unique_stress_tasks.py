"""The unique task of the concurrent-enqueue tests, and the enqueuing process they start.

``manage.py shell -c "from tests.unique_stress_tasks import main; main(INDEX, COUNT, KEYS)"``
(with ``DATABASE_URL`` naming the test database) prints ``ready``, waits for a line
on stdin so that every process starts at once, enqueues COUNT calls of
:func:`touch` over KEYS keys, and prints one JSON line: the errors it met, the
deadlock retries the backend logged, and ``[key, job id]`` per successful call.
"""

from __future__ import annotations

import json
import logging
import sys

from django_jobs import task


@task(unique_key="k:{key}", unique_until="start")
def touch(key: int) -> int:
    """Lets go of its key as soon as a worker starts it: keys change hands all the time."""
    return key


class Counter(logging.Handler):
    """Counts the backend's "deadlock victim, enqueueing again" records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "deadlock victim" in record.getMessage()


def enqueue_all(index: int, count: int, keys: int) -> dict[str, list]:
    errors: list[str] = []
    results: list[list[int]] = []
    for i in range(count):
        key = (i * 7 + index) % keys
        try:
            results.append([key, int(touch.enqueue(key).id)])
        except Exception as exc:  # every error is the finding: report it, keep going
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"errors": errors, "results": results}


def main(index: int, count: int, keys: int) -> None:
    counter = Counter()
    logging.getLogger("django_jobs.enqueue").addHandler(counter)
    print("ready", flush=True)
    sys.stdin.readline()
    outcome = enqueue_all(index, count, keys)
    print(json.dumps({**outcome, "retries": counter.count}), flush=True)
