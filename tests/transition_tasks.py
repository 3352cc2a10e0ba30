"""Tasks for the in-process transition tests (claims, recovery, scheduling, admission)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from django_jobs import task
from tests.row_lock_waits import is_waiting_for_a_row_lock


@task
def noop(value=None):
    return value


# Keys are "<group>/<name>": "one/x" for both one-slot tasks (they share the limit).
@task(concurrency_key="{name}", concurrency_group="one", concurrency_limit=1)
def one_at_a_time(name: str, n: int = 0) -> int:
    return n


@task(
    concurrency_key="{name}",
    concurrency_group="one",
    concurrency_limit=1,
    max_attempts=3,
    backoff=0,
)
def one_at_a_time_retried(name: str, n: int = 0) -> int:
    return n


@task(concurrency_key="{name}", concurrency_group="two", concurrency_limit=2)
def two_at_a_time(name: str, n: int = 0) -> int:
    return n


@task(max_attempts=3, backoff=30)
def retried_later() -> None:
    return None


@task(max_attempts=3, backoff=0)
def retried_at_once() -> None:
    return None


# --- Helpers for the two-connection race tests --------------------------------------------
# (Kept here, beside the tasks, so the four transition test modules share one copy.)

DB = "default"
TIMEOUT = 20.0


def vendor() -> str:
    return connections[DB].vendor


def has_row_locks() -> bool:
    """PostgreSQL and MariaDB/MySQL lock rows; SQLite serialises whole write transactions."""
    return vendor() != "sqlite"


class InThread:
    """Run ``fn`` in a thread of its own, hence on a database connection of its own.

    The connection is closed when the thread ends. ``join()`` re-raises whatever the
    thread raised and fails (rather than hangs) if it does not end in time.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def target() -> None:
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as exc:
                self.error = exc
            finally:
                connections[DB].close()
                self.done.set()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def join(self, timeout: float = TIMEOUT) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the thread did not finish in time (blocked?)"
        if self.error is not None:
            raise self.error
        return self.result


def backend_id() -> int:
    """The server-side id of this thread's connection (to watch it from another one)."""
    query = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}
    with connections[DB].cursor() as cursor:
        cursor.execute(query[vendor()])
        return int(cursor.fetchone()[0])


def is_waiting_for_row_lock(server_id: int) -> bool:
    """Whether connection ``server_id`` is blocked waiting for a lock another one holds."""
    return is_waiting_for_a_row_lock(server_id, DB)


def wait_until(condition: Callable[[], bool], timeout: float = TIMEOUT) -> bool:
    """Poll ``condition`` (a database observation, not a timer) until true or ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < deadline:
        if condition():
            return True
        pause.wait(0.05)
    return condition()
