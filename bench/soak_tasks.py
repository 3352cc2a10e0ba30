"""The chaos soak's tasks (bench/soak.py): each body records its own start and end.

Every attempt appends two JSON lines to a file of its worker process in the
directory ``SOAK_AUDIT_DIR`` names: one when the body begins (job id, attempt,
kind, pid, the start the database recorded for the attempt) and one when it
returns or raises. A file, not a table: the soak terminates the workers'
database connections and may restart the server, and a record must neither be
lost with them nor fail the job. One file per process and one ``os.write`` per
line on an ``O_APPEND`` descriptor, so threads never interleave inside a line
and a SIGKILL can cut at most the last line of its own process's file.

No body touches the database: whatever a job's end says comes from the queue,
never from a task's own query failing under the faults.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django_jobs import Snooze, cancel_requested, task

AUDIT_DIR_ENV = "SOAK_AUDIT_DIR"
# Attempts of jobs that must succeed: enough that only the soak's kills landing on one
# job that many times in a row could fail it.
SAFE_ATTEMPTS = 6

_fd: int | None = None
_fd_pid: int | None = None


def write(record: dict[str, Any]) -> None:
    """Append ``record`` as one line of this process's audit file."""
    global _fd, _fd_pid
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:
        path = os.path.join(os.environ[AUDIT_DIR_ENV], f"audit-{pid}.jsonl")
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = pid
    os.write(_fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


@contextmanager
def audited(context: Any, kind: str, **extra: Any) -> Iterator[None]:
    """Record this attempt's start, then its end: ``ok`` True if the body got to its
    return, False if it raised (``Snooze``, an interrupt, a planned failure)."""
    result = context.task_result
    recorded = result.last_attempted_at
    job, attempt = int(result.id), context.attempt
    write(
        {
            "e": "start",
            "job": job,
            "attempt": attempt,
            "kind": kind,
            "pid": os.getpid(),
            "t": time.time(),
            "recorded": recorded.timestamp() if recorded is not None else None,
            **extra,
        }
    )
    ok = False
    try:
        yield
        ok = True
    finally:
        write({"e": "end", "job": job, "attempt": attempt, "t": time.time(), "ok": ok})


def pause(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000)


# --- jobs that must succeed ---------------------------------------------------------------


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def plain(context, ms: float, fail_first: bool = False) -> int:
    with audited(context, "plain"):
        pause(ms)
        if fail_first and context.attempt == 1:
            raise RuntimeError("planned failure of the first attempt")
    return context.attempt


@task(takes_context=True, concurrency_key="soak:{key}", max_attempts=SAFE_ATTEMPTS, backoff=0)
def keyed(context, key: str, limit: int, ms: float, fail_first: bool = False) -> int:
    """Given its limit with ``.using(concurrency_limit=limit)``, the same for every job of
    a key; ``limit`` is an argument too so that the records say what was declared."""
    with audited(context, "keyed", key=key, limit=limit):
        pause(ms)
        if fail_first and context.attempt == 1:
            raise RuntimeError("planned failure of the first attempt")
    return context.attempt


RATE = "4/s"
RATE_LIMIT, RATE_PERIOD = 4, 1.0


@task(
    takes_context=True,
    rate_limit=RATE,
    rate_key="{account}",
    max_attempts=SAFE_ATTEMPTS,
    backoff=0,
)
def rated(context, account: str, ms: float) -> str:
    with audited(context, "rated", key=account):
        pause(ms)
    return account


@task(takes_context=True, unique_key="slot:{slot}", max_attempts=SAFE_ATTEMPTS, backoff=0)
def unique(context, slot: int, ms: float) -> int:
    with audited(context, "unique", key=f"slot:{slot}"):
        pause(ms)
    return slot


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def item(context, ms: float, fail: bool) -> str:
    """A batch item; ``fail`` fails every attempt, so the item fails for good."""
    with audited(context, "item"):
        pause(ms)
        if fail:
            raise RuntimeError("planned failure of a batch item")
    return "done"


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def batch_done(context, batch_id: int, succeeded: int, failed: int) -> int:
    """The batches' on_finish callback: its record carries what it was told."""
    with audited(context, "callback", batch=batch_id, succeeded=succeeded, failed=failed):
        pass
    return batch_id


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def tick(context) -> None:
    """The recurring task (DJANGO_JOBS["recurring"], every second)."""
    with audited(context, "tick"):
        pass


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def snoozer(context, times: int) -> int:
    """Snoozes its first ``times`` starts (each start is an attempt), then succeeds."""
    with audited(context, "snooze"):
        if context.attempt <= times:
            raise Snooze(0.2)
    return context.attempt


# The fair kind (bench/soak.py, "fair"): jobs of a few tenants in a queue the soak's settings
# make fair (``DJANGO_JOBS["fair_queues"]``), each group taking turns by its weight. Declared in
# queue "default", the one every settings module declares (Django checks a task's queue when it
# is declared): the driver sends them to FAIR_QUEUE with ``.using(queue_name=...)`` under the
# soak's settings, which add it to QUEUES.
FAIR_QUEUE = "soak-fair"


@task(takes_context=True, fair_key="{tenant}", max_attempts=SAFE_ATTEMPTS, backoff=0)
def fair_work(context, tenant: str, weight: float, ms: float) -> str:
    """A tenant's job in the fair queue, its group the tenant (its weight given with
    ``.using(fair_weight=weight)``; ``weight`` is an argument too so that the audit knows it)."""
    with audited(context, "fair", key=tenant):
        pause(ms)
    return tenant


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def fifo_work(context, tenant: str, weight: float, ms: float) -> str:
    """The same job without a group, for the share audit's twin (``--unfair``): the queue is
    then not fair and its jobs take their FIFO turns."""
    with audited(context, "fair", key=tenant):
        pause(ms)
    return tenant


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def canary(context, after: int) -> int:
    """Enqueued right after a hostile job: it must succeed."""
    with audited(context, "canary", after=after):
        pass
    return after


# --- jobs that end otherwise --------------------------------------------------------------


@task(takes_context=True, max_attempts=SAFE_ATTEMPTS, backoff=0)
def cancellable(context, seconds: float) -> str:
    """Runs until it is cancelled (the soak always cancels it), checking between steps."""
    with audited(context, "cancel"):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if cancel_requested():
                break
            time.sleep(0.02)
    return "stopped"


TIMEOUT = 0.3


@task(takes_context=True, timeout=TIMEOUT, max_attempts=2, backoff=0)
def overrun(context) -> str:
    """Never ends within its timeout: a Python loop, so ``JobTimeout`` interrupts it."""
    with audited(context, "timeout"):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.02)
    return "not interrupted"


# --- hostile jobs: each must end in a defined state, and the worker go on ---------------


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of this exception raises")


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


HOSTILE_DEPTH = 40
HOSTILE_SIZE = 2 * 1024 * 1024


def hostile_value(name: str) -> Any:
    """What each returning hostile task returns (the audit compares the stored value)."""
    if name == "nul_return":
        return "a\x00b"
    if name == "deep_return":
        return nested(HOSTILE_DEPTH)
    if name == "huge_return":
        return "x" * HOSTILE_SIZE
    raise KeyError(name)


@task(takes_context=True, max_attempts=2, backoff=0)
def nul_return(context) -> str:
    with audited(context, "hostile"):
        value = hostile_value("nul_return")
    return value


@task(takes_context=True, max_attempts=2, backoff=0)
def nul_error(context) -> None:
    with audited(context, "hostile"):
        raise ValueError("bad\x00message")


@task(takes_context=True, max_attempts=2, backoff=0)
def deep_return(context) -> Any:
    with audited(context, "hostile"):
        value = hostile_value("deep_return")
    return value


@task(takes_context=True, max_attempts=2, backoff=0)
def huge_return(context) -> str:
    with audited(context, "hostile"):
        value = hostile_value("huge_return")
    return value


@task(takes_context=True, max_attempts=2, backoff=0)
def str_raises(context) -> None:
    with audited(context, "hostile"):
        raise StrRaises("unprintable")


HOSTILE = {
    "nul_return": nul_return,
    "nul_error": nul_error,
    "deep_return": deep_return,
    "huge_return": huge_return,
    "str_raises": str_raises,
}
