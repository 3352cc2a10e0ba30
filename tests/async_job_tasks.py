"""``async def`` tasks for tests/test_async_jobs.py: every feature a job can use, from a
body that runs as an asyncio task on the worker's event loop.

Each one can say where it ran (``here()``: the loop's thread is ``django-jobs-async``),
so a test proves the lane ran it, not a worker thread through ``async_to_sync``. They
record their runs in the demo app's ``AuditEvent`` table through Django's async ORM
(``acreate``, ``aupdate``), as a user's async job would.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
import time
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction

from django_jobs import (
    Exponential,
    Snooze,
    dependency_results,
    enqueue_batch,
    enqueue_on_commit,
    set_progress,
    task,
)
from testproject.demo.models import AuditEvent
from tests.hostile_tasks import decoded

# The name of the event loop's thread (runtime/async_lane.py).
LOOP_THREAD = "django-jobs-async"


def here() -> str:
    """The thread this code runs in (the loop's, for an async body on the lane)."""
    return threading.current_thread().name


async def audit(context, key: str = "async", limit: int = 1) -> AuditEvent:
    """This attempt's start, written through the async ORM."""
    return await AuditEvent.objects.acreate(
        job_id=int(context.task_result.id),
        key=key,
        limit=limit,
        attempt=context.attempt,
        pid=os.getpid(),
        started=time.time(),
    )


async def stamp_end(event: AuditEvent) -> None:
    await AuditEvent.objects.filter(pk=event.pk).aupdate(ended=time.time())


async def until_exists(flag: str, limit: float = 60.0) -> bool:
    """Await (never block) until the test creates ``flag``; False after ``limit`` s."""
    deadline = time.monotonic() + limit
    while not Path(flag).exists():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# --- results and dependencies -----------------------------------------------------------------


@task(takes_context=True)
async def doubled(context, n: int) -> dict:
    await asyncio.sleep(0.01)
    return {"value": 2 * n, "thread": here(), "attempt": context.attempt}


@task
async def collects(label: str = "collect") -> dict:
    """What the jobs it waited for returned, read through ``sync_to_async`` (the call
    reads the database: from the loop itself Django refuses it)."""
    results = await sync_to_async(dependency_results)()
    return {"values": [result.return_value for result in results], "thread": here()}


@task
async def collects_on_the_loop() -> list:
    """The mistake: ``dependency_results()`` called on the loop, where Django refuses a
    synchronous query (SynchronousOnlyOperation)."""
    return [result.return_value for result in dependency_results()]


@task(on_dependency_failure="run")
async def sees_statuses() -> dict:
    results = await sync_to_async(dependency_results)()
    return {"statuses": [result.status.value for result in results], "thread": here()}


@task
async def step(name: str, fail: bool = False) -> str:
    await asyncio.sleep(0.01)
    if fail:
        raise ValueError(f"async step {name} failed")
    return name


# --- failures, retries, snoozes, progress -----------------------------------------------------


@task(takes_context=True, max_attempts=3, backoff=Exponential(base=0.5, factor=2, jitter=0))
async def fails_until(context, succeed_at: int) -> dict:
    """Raises on each attempt before ``succeed_at``, its start and end audited."""
    event = await audit(context, "retry")
    await asyncio.sleep(0.01)
    await stamp_end(event)
    if context.attempt < succeed_at:
        raise ValueError(f"async attempt {context.attempt} failed")
    return {"attempt": context.attempt, "thread": here()}


@task(takes_context=True, max_attempts=1)
async def snoozes_first(context, seconds: float) -> dict:
    """Asks to run later on its first start (no attempt used up), returns on its second."""
    await audit(context, "snooze")
    if context.attempt == 1:
        raise Snooze(seconds)
    return {"attempt": context.attempt, "thread": here()}


@task
async def reports_progress(flag: str) -> str:
    """Half done, then waits (awaiting) for the test's go, then done."""
    set_progress(1, 2, f"half, on {here()}")
    if not await until_exists(flag):
        return "never told to go on"
    set_progress(2, 2, "done")
    return "reported"


# --- cancel, timeout, waiting siblings --------------------------------------------------------


@task(takes_context=True, max_attempts=3)
async def sleeps(context, seconds: float = 60.0) -> str:
    """One long await; records when its CancelledError came (its cleanup ran)."""
    event = await audit(context, "sleeps")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await stamp_end(event)
        raise
    return "slept"


@task(takes_context=True, max_attempts=2, backoff=0, timeout=1)
async def past_its_timeout(context) -> str:
    event = await audit(context, "timeout")
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await stamp_end(event)
        raise
    return "never"


@task(takes_context=True)
async def waits_for(context, flag: str) -> str:
    """A sibling on the same loop: runs until the test says go, then returns."""
    await audit(context, "sibling")
    if not await until_exists(flag):
        return "never told to go on"
    return here()


# --- keys and rates ---------------------------------------------------------------------------


async def keyed_body(context, key: str, limit: int, seconds: float) -> str:
    event = await audit(context, key, limit)
    await asyncio.sleep(seconds)
    await stamp_end(event)
    return here()


@task(takes_context=True, concurrency_key="one:{key}", concurrency_limit=1)
async def keyed_one(context, key: str, seconds: float) -> str:
    return await keyed_body(context, f"one:{key}", 1, seconds)


@task(takes_context=True, concurrency_key="three:{key}", concurrency_limit=3)
async def keyed_three(context, key: str, seconds: float) -> str:
    return await keyed_body(context, f"three:{key}", 3, seconds)


@task(takes_context=True, rate_limit="5/s", rate_key="{account}")
async def rated(context, account: str) -> str:
    await audit(context, f"rate:{account}")
    return here()


@task(takes_context=True, unique_key="report:{account}")
async def unique_report(context, account: int, flag: str) -> str:
    await audit(context, f"unique:{account}")
    await until_exists(flag)
    return here()


# --- batches, workflows, enqueue on commit ----------------------------------------------------


@task(max_attempts=1)
async def item(n: int, fail: bool = False) -> dict:
    await asyncio.sleep(0.005 * (n % 4))
    if fail:
        raise ValueError(f"async item {n} failed")
    return {"n": n, "thread": here()}


@task
async def batch_done(batch_id: int, succeeded: int, failed: int) -> dict:
    return {"batch_id": batch_id, "succeeded": succeeded, "failed": failed, "thread": here()}


@task
async def next_stage(batch_id: int, succeeded: int, failed: int) -> int:
    """A batch callback that enqueues a batch of its own (it nests under this job)."""
    child = await sync_to_async(enqueue_batch)(
        [(item, [n], {}) for n in range(3)], on_finish=batch_done, description="async child"
    )
    return child.id


def write_and_enqueue(label: str, commit: bool) -> None:
    """A row and a job that needs it, in one transaction: the job is enqueued only if the
    transaction commits."""
    try:
        with transaction.atomic():
            AuditEvent.objects.create(
                job_id=0, key=f"commit:{label}", limit=1, attempt=1, pid=os.getpid(), started=0
            )
            enqueue_on_commit(reads_its_row, label)
            if not commit:
                raise RuntimeError("rolled back on purpose")
    except RuntimeError:
        pass


@task
async def enqueues_on_commit(label: str, commit: bool) -> str:
    await sync_to_async(write_and_enqueue)(label, commit)
    return here()


@task
async def reads_its_row(label: str) -> dict:
    row = await AuditEvent.objects.aget(key=f"commit:{label}")
    return {"row": row.key, "thread": here()}


# --- the ORM: async queries, sync_to_async, connections ---------------------------------------


def stamp_in_a_thread(pk: int) -> int:
    return AuditEvent.objects.filter(pk=pk).update(ended=time.time())


@task(takes_context=True)
async def uses_the_orm(context, mode: str) -> int:
    """A write, an ``aget``, an ``async for``, and a sync call through ``sync_to_async``
    (``mode`` ``"default"``: thread-sensitive, as it is by default; ``"unsensitive"``:
    ``thread_sensitive=False``)."""
    event = await audit(context, "orm")
    set_progress(1, 2, "written")
    again = await AuditEvent.objects.aget(pk=event.pk)
    seen = 0
    async for _row in AuditEvent.objects.filter(key="orm").order_by("-pk")[:5]:
        seen += 1
    await asyncio.sleep(0.02)
    sensitive = mode != "unsensitive"
    await sync_to_async(stamp_in_a_thread, thread_sensitive=sensitive)(again.pk)
    return seen


@task
def sync_uses_the_orm(n: int) -> int:
    """A sync job's queries, on its worker thread (that thread's connection)."""
    AuditEvent.objects.create(
        job_id=n, key="orm-sync", limit=1, attempt=1, pid=os.getpid(), started=time.time()
    )
    time.sleep(0.02)
    return AuditEvent.objects.filter(key="orm-sync").count()


# --- the SIGKILL test's jobs ------------------------------------------------------------------


@task(takes_context=True, max_attempts=2, backoff=0)
async def audited_wait(context, seconds: float) -> str:
    """Its start and its end written by the body itself: what ran, whatever the queue says."""
    event = await audit(context, "kill")
    await asyncio.sleep(seconds)
    await stamp_end(event)
    return here()


# --- blocking the loop ------------------------------------------------------------------------


@task
async def blocks_the_loop(seconds: float, flag: str) -> dict:
    """The mistake the loop monitor finds: ``time.sleep`` in an async body. It creates
    ``flag`` as its stall begins (a sync job waits for it)."""
    began = time.time()
    Path(flag).touch()
    time.sleep(seconds)
    return {"began": began, "ended": time.time(), "thread": here()}


async def hold_the_loop(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@task
async def blocks_in_a_gathered_task(seconds: float) -> list:
    """The same mistake in a fan-out: ``gather`` runs each coroutine in a task of its own,
    not the body's."""
    return list(await asyncio.gather(hold_the_loop(seconds), asyncio.sleep(0.01)))


@task
def sync_step(label: str) -> dict:
    """A sync job (a worker thread runs it)."""
    time.sleep(0.05)
    return {"label": label, "at": time.time(), "thread": here()}


@task
def sync_when(flag: str) -> dict:
    """A sync job that waits (on its thread) for ``flag``, then returns when it saw it."""
    deadline = time.monotonic() + 30
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"saw": time.time(), "thread": here()}


# --- bad input --------------------------------------------------------------------------------


@task
async def cancels_itself() -> str:
    own = asyncio.current_task()
    assert own is not None
    own.cancel()
    await asyncio.sleep(1)
    return "not cancelled"


@task(takes_context=True)
async def cancels_its_job(context) -> str:
    """Asks django-jobs to cancel its own job, then goes on awaiting."""
    from django_jobs import acancel

    await acancel(context.task_result.id)
    await asyncio.sleep(30)
    return "not cancelled"


@task
async def closes_the_loop() -> str:
    asyncio.get_running_loop().close()
    return "closed"


@task
async def stops_the_loop() -> str:
    asyncio.get_running_loop().stop()
    await asyncio.sleep(0.05)
    return here()


@task
async def replaces_the_loop() -> str:
    asyncio.set_event_loop(asyncio.new_event_loop())
    await asyncio.sleep(0.05)
    return here()


@task
async def returns_encoded(encoded: str) -> object:
    """Returns the value ``encoded`` decodes to (tests/hostile_tasks.py's ``decoded``)."""
    await asyncio.sleep(0)
    return decoded(encoded)


@task(max_attempts=1)
async def raises_encoded(encoded: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(decoded(encoded))


@task
async def returns_a_coroutine() -> object:
    async def inner() -> int:
        return 1

    return inner()


@task
async def canary() -> str:
    await asyncio.sleep(0)
    return here()


@task
def slows_the_completer(seconds: float) -> str:
    """Fault injection: a database that takes ``seconds`` to write each batch of successes.
    It wraps the function the completer thread writes with, in the worker process that
    runs it (a sync job: a worker thread), so that successes pile up unwritten."""
    from django_jobs.runtime import completer

    real = completer.write_isolated

    def slow(ctx: object, batch: list) -> None:
        time.sleep(seconds)
        real(ctx, batch)  # type: ignore[arg-type]

    completer.write_isolated = slow  # type: ignore[assignment]
    return "slowed"


@task(takes_context=True, max_attempts=2)
async def ignores_cancellation(context, seconds: float = 30.0) -> str:
    """Catches its CancelledError and awaits on: only its process's exit ends it."""
    await audit(context, "ignores")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(deadline - time.monotonic())
        except asyncio.CancelledError:
            pass
    return "ran to the end"


async def yields():
    """An async generator function where a task's function was: not a coroutine function."""
    yield 1


def function_swapped(declared: Any, func: Any) -> Any:
    """``declared`` with ``func`` as its function, past the declaration's checks: what a
    worker holds where a task's module was edited and reloaded under it. The only way a
    worker meets a generator, which a declaration refuses (``refuse_generator``)."""
    swapped = copy.copy(declared)
    object.__setattr__(swapped, "func", func)
    return swapped


yields = function_swapped(canary, yields)


def sleep_after_flag(seconds: float, flag: str) -> None:
    Path(flag).touch()
    time.sleep(seconds)


@task
async def blocks_an_orm_thread(seconds: float, flag: str) -> float:
    """Blocking work done as the loop monitor's log line advises: through sync_to_async
    (thread-sensitive, the default: on the job's ORM thread). ``flag`` is created as the
    blocking call begins."""
    await sync_to_async(sleep_after_flag)(seconds, flag)
    return seconds
