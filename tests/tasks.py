"""Tasks the tests enqueue; importable by run_jobs subprocesses as ``tests.tasks``."""

from __future__ import annotations

import time
from pathlib import Path

from django.tasks import task

from django_jobs import task as jobs_task


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=5)
def echo(value):
    return value


@jobs_task(max_attempts=3, backoff=0)
def always_fails(message: str = "boom") -> None:
    raise ValueError(message)


@task
def sleep_then_return(seconds: float, marker: str | None = None) -> float:
    """Sleeps; writes ``marker`` (a file path) when it starts, so a test knows it is running."""
    if marker:
        Path(marker).write_text("started")
    time.sleep(seconds)
    return seconds


@task(takes_context=True)
def report_attempt(context, fail_until: int = 0) -> int:
    if context.attempt <= fail_until:
        raise RuntimeError(f"failing attempt {context.attempt}")
    return context.attempt


@task
def raise_system_exit() -> None:
    raise SystemExit(3)


@task
def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@task
async def async_double(value: int) -> int:
    return value * 2


def not_a_task(path: str) -> str:
    """A plain function: a job naming it must fail without running it (else ``path`` appears)."""
    Path(path).write_text("ran")
    return "ran"


@task
def record_run(log: str, label: str, seconds: float = 0.0, marker: str | None = None) -> str:
    """Appends ``label`` to the file ``log`` each time it runs (order and count of runs),
    touches ``marker`` once running, then sleeps ``seconds``."""
    with open(log, "a") as f:
        f.write(f"{label}\n")
    if marker:
        Path(marker).write_text("started")
    time.sleep(seconds)
    return label


@task(takes_context=True)
def slow_first_attempt(context, log: str, label: str, seconds: float, marker: str) -> int:
    """Like ``record_run``, but only attempt 1 is slow (and touches ``marker``): a test can
    interrupt that one and watch the retry finish at once. Returns the attempt number."""
    with open(log, "a") as f:
        f.write(f"{label}\n")
    if context.attempt == 1:
        Path(marker).write_text("started")
        time.sleep(seconds)
    return context.attempt


@task
def returns_a_set(*args) -> set:
    return {1, 2}
