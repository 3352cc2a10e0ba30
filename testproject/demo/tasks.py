"""The demo's tasks, one per feature the tour shows (``manage.py demo``).

Every outcome is deterministic, so each run of the demo tells the same story: the retry
fails exactly once, the failing job always fails, the keyed pair always takes turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from urllib.parse import urlsplit

from django.tasks import TaskContext, task

from django_jobs import cancel_requested, dependency_results, set_progress
from django_jobs import task as jobs_task

logger = logging.getLogger("testproject.demo")

# Long enough for the log to show the second job of the key waiting for the first.
KEYED_JOB_SECONDS = 1.0
# The retry's backoff: attempt 2 is scheduled this long after attempt 1 failed.
RETRY_BACKOFF_SECONDS = 1.0


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=10)
def send_welcome_email(user_id: int) -> str:
    time.sleep(0.2)
    return f"sent to user {user_id}"


@task(queue_name="emails")
def send_reminder(user_id: int) -> str:
    """Enqueued with ``run_after``: scheduled until then, run soon after."""
    return f"reminded user {user_id}"


@jobs_task(queue_name="reports", max_attempts=3, backoff=RETRY_BACKOFF_SECONDS, takes_context=True)
def flaky_report(context: TaskContext, report_id: int) -> str:
    """Fails on its first attempt, every time, so the demo always shows one retry."""
    if context.attempt == 1:
        raise ConnectionError(f"report service unavailable for report {report_id}")
    return f"report {report_id} ready on attempt {context.attempt}"


@task(queue_name="reports")
def parse_upload(name: str) -> None:
    """Always fails, with no retry: a FAILED job whose traceback the admin shows."""
    raise ValueError(f"{name} is not a CSV file")


@jobs_task(concurrency_key="account:{account_id}", concurrency_limit=1)
def sync_account(account_id: int) -> int:
    """At most one runs per account: a second one waits, blocked, for the first to end."""
    time.sleep(KEYED_JOB_SECONDS)
    return account_id


@task
async def fetch_status(url: str) -> dict:
    await asyncio.sleep(0.05)
    return {"url": url, "status": 200}


@jobs_task(unique_key="rebuild:{account_id}")
def rebuild_index(account_id: int) -> int:
    """Unique: enqueueing it again while one waits or runs returns the existing job."""
    time.sleep(0.2)
    return account_id


@task
def import_row(row: int) -> int:
    time.sleep(0.05)
    return row


@task
def import_done(batch_id: int, succeeded: int, failed: int) -> str:
    """The batch's on_finish callback: runs once, after the last row."""
    logger.info("batch %s done: %s imported, %s failed", batch_id, succeeded, failed)
    return f"{succeeded} imported, {failed} failed"


# A workflow (docs/workflows.md): a fan-out of quotes, then a fan-in that compares them.

# The shops the workflow asks for a quote, and what each answers.
QUOTES = {"north": 12.5, "south": 11.0}


@task
def fetch_quote(shop: str) -> dict:
    """One of the workflow's fan-out: the quotes are fetched side by side."""
    time.sleep(0.2)
    return {"shop": shop, "price": QUOTES[shop]}


@task
def pick_cheapest() -> str:
    """The workflow's fan-in: runs once every quote has been fetched, and reads what each
    fetch returned with ``dependency_results()`` (in its ``after=`` order)."""
    quotes = [result.return_value for result in dependency_results()]
    best = min(quotes, key=lambda quote: quote["price"])
    logger.info("cheapest of %s quotes: %s at %.2f", len(quotes), best["shop"], best["price"])
    return f"{best['shop']} at {best['price']:.2f}, of {len(quotes)} quotes"


# Job control (docs/control.md): progress, a timeout, a cancel.

# The export's steps, each reported as it begins. A little over a second apart, so each
# report is written at once (a job's progress is written at most once a second).
EXPORT_STEPS = ("reading the orders", "totalling", "writing the CSV", "done")
EXPORT_STEP_SECONDS = 1.2
# The slow sync's timeout: past it, its thread is interrupted (JobTimeout).
SYNC_TIMEOUT_SECONDS = 1.0


@task
def export_orders(month: str) -> str:
    """Reports its progress, step by step: the job list, its page and
    ``django_jobs.progress()`` show how far it has got."""
    for done, step in enumerate(EXPORT_STEPS):
        set_progress(done, len(EXPORT_STEPS) - 1, step)
        if done < len(EXPORT_STEPS) - 1:
            time.sleep(EXPORT_STEP_SECONDS)
    return f"orders-{month}.csv"


@jobs_task(timeout=SYNC_TIMEOUT_SECONDS)
def sync_catalogue(supplier: str) -> None:
    """Takes far longer than its timeout allows: interrupted, recorded as JobTimeout."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)


@task
def import_products(supplier: str) -> int:
    """Runs until it is cancelled, checking ``cancel_requested()`` between rows; reports
    the rows it has imported (no total: it does not know how many there are)."""
    rows = 0
    while not cancel_requested():
        rows += 1
        set_progress(rows, message=f"products from {supplier}")
        time.sleep(0.05)
    logger.info("import_products stopped after %s rows: cancel requested", rows)
    return rows


# Async jobs (docs/tasks.md, "Async jobs"): a fan-out of fetches that spend their time
# waiting on the network, each an ``async def`` job on the worker's event loop.

# The fan-out's size, and how long the demo's stub server waits before each answer.
FETCHES = 200
FETCH_DELAY_SECONDS = 1.0
# A fetch still waiting after this is cut short (JobTimeout): the tour never hangs on one.
FETCH_TIMEOUT_SECONDS = 30.0


@jobs_task(timeout=FETCH_TIMEOUT_SECONDS)
async def fetch_page(url: str) -> dict:
    """GET ``url`` with a plain HTTP/1.1 request over ``asyncio.open_connection``: the
    standard library's non-blocking streams, no HTTP client to install. Each ``await``
    hands the loop to the other fetches, so all of them wait for their answers at once,
    on one thread; a blocking call here (``urllib``, ``time.sleep``) would hold them all."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"fetch_page takes a plain http:// URL, not {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += f"?{parts.query}"
    request = f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n"
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        writer.write(request.encode("ascii"))
        await writer.drain()
        response = await reader.read()  # the whole answer: the server closes after it
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):  # the answer, if any, is already read
            await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[1].isdigit():
        raise ConnectionError(f"{url} answered {status_line!r}, not an HTTP status line")
    status = int(fields[1])
    if status != 200:
        raise ConnectionError(f"{url} answered {status_line!r}")
    return {"url": url, "status": status, "bytes": len(body)}
