"""Concurrent enqueues of unique tasks never hand the caller a deadlock the library can settle.

On InnoDB two inserts of a unique key that was just let go (or whose holder rolls
back while both wait) deadlock inside their INSERTs (the cycle is described in
``django_jobs.core.uniqueness``). An enqueue in its own transaction is retried; one in
the caller's ``atomic()`` cannot be, and says so. PostgreSQL and SQLite never
deadlock here: the same tests prove they give the same answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from django.db import OperationalError, connection, transaction

from django_jobs import bulk_enqueue
from django_jobs.core.uniqueness import CALLERS_TRANSACTION_NOTE
from django_jobs.models import Job
from tests import tasks
from tests.harness import FAST_ENV, MANAGE, REPO_ROOT, database_url, wait_until
from tests.row_lock_waits import sessions_waiting_for_a_row_lock
from tests.unique_stress_tasks import touch

KEY = 7
PATH = "tests.unique_stress_tasks.touch"

row_locks_only = pytest.mark.skipif(
    "sqlite" in os.environ.get("DATABASE_URL", "sqlite"),
    reason="SQLite serialises write transactions: two enqueues never wait inside one",
)


class Rollback(Exception):
    pass


def wait_for_lock_waits(count: int, what: str) -> None:
    """Until exactly ``count`` sessions of this test database wait for a lock (shown if it
    times out; other test runs may share the server)."""
    waits: dict[int, str] = {}

    def reached() -> bool:
        waits.clear()
        waits.update(sessions_waiting_for_a_row_lock(this_database=True))
        return len(waits) == count

    try:
        wait_until(reached, interval=0.05, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; waiting: {waits}") from None


def in_thread(pool: ThreadPoolExecutor, call) -> Future:
    """Run ``call`` on a connection of its own (a thread's), closed when it is done."""

    def run():
        try:
            return call()
        finally:
            connection.close()

    return pool.submit(run)


def holders_of_the_key() -> list[int]:
    return list(Job.objects.filter(unique_key=f"{PATH}/k:{KEY}").values_list("pk", flat=True))


@row_locks_only
@pytest.mark.django_db(transaction=True)
def test_two_enqueues_waiting_for_a_holder_that_rolls_back_both_get_one_job():
    """The MySQL manual's three-transaction duplicate-key deadlock, forced: two enqueues
    wait for a third's uncommitted insert of the key; it rolls back; on InnoDB both
    then hold a shared lock on the gap and need to insert into it."""
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(Rollback), transaction.atomic():
            touch.enqueue(KEY)
            waiting = [in_thread(pool, lambda: int(touch.enqueue(KEY).id)) for _ in range(2)]
            wait_for_lock_waits(2, "both enqueues waiting for the key")
            raise Rollback
        ids = [future.result(timeout=30) for future in waiting]
    assert ids[0] == ids[1]
    assert holders_of_the_key() == [ids[0]]


@row_locks_only
@pytest.mark.django_db(transaction=True)
def test_a_deadlock_inside_the_callers_atomic_says_to_retry_the_block():
    """The caller's transaction is the lighter one, so InnoDB picks it as the victim
    (when the two waits end close enough together to deadlock at all, which they
    nearly always do): the error reaches the caller, nothing of the block kept, with a
    note; running the block again gives the job the other enqueue made, not a second."""

    def callers_block() -> int:
        with transaction.atomic():
            return int(touch.enqueue(KEY).id)

    def callers_block_once() -> int | OperationalError:
        try:
            return callers_block()
        except OperationalError as exc:
            return exc

    def heavier_enqueue() -> int:
        # Ten keyless jobs first make this transaction the one InnoDB keeps.
        results = bulk_enqueue([(tasks.add, [n, n], {}) for n in range(10)] + [(touch, [KEY], {})])
        return int(results[-1].id)

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(Rollback), transaction.atomic():
            touch.enqueue(KEY)
            heavy = in_thread(pool, heavier_enqueue)
            wait_for_lock_waits(1, "the heavier enqueue waiting")
            caller = in_thread(pool, callers_block_once)
            wait_for_lock_waits(2, "both enqueues waiting")
            raise Rollback
        kept = heavy.result(timeout=30)
        outcome = caller.result(timeout=30)
    if isinstance(outcome, OperationalError):  # InnoDB, nearly always: the deadlock
        assert outcome.args[0] == 1213
        assert CALLERS_TRANSACTION_NOTE in getattr(outcome, "__notes__", [])
        outcome = callers_block()  # what the note says: run the block again
    assert outcome == kept
    assert holders_of_the_key() == [kept]


ENQUEUERS = 4
CALLS = 200
KEYS = 20


def start_enqueuer(index: int) -> subprocess.Popen:
    """One enqueuing process (see ``tests.unique_stress_tasks``) on the test database."""
    env = {**os.environ, **FAST_ENV, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1"}
    env.pop("TEST_DATABASE_NAME", None)
    code = f"from tests.unique_stress_tasks import main; main({index}, {CALLS}, {KEYS})"
    return subprocess.Popen(
        [sys.executable, str(MANAGE), "shell", "-v", "0", "-c", code],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def outcome_of(proc: subprocess.Popen) -> dict:
    """The process's JSON line, its last line of output."""
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.stress
@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_concurrent_unique_enqueues_from_four_processes_raise_nothing(run_jobs):
    """4 processes x 200 enqueues over 20 keys, while a worker starts each job at once
    and so lets go of its key: on MariaDB the old enqueue raised error 1213 to one or
    two of the 800 calls in most runs (the forced tests above fail every time). Every
    call must get a job (new or the holder's) of its own key."""
    worker = run_jobs("--threads", "8", "--polling-interval", "0.01")
    worker.wait_for_output("started")
    enqueuers = [start_enqueuer(index) for index in range(ENQUEUERS)]
    try:
        for proc in enqueuers:
            assert proc.stdout.readline().strip() == "ready"
        for proc in enqueuers:  # all at once
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcomes = [outcome_of(proc) for proc in enqueuers]
    finally:
        for proc in enqueuers:
            proc.kill()
            proc.wait()
    errors = [error for outcome in outcomes for error in outcome["errors"]]
    retries = sum(outcome["retries"] for outcome in outcomes)
    print(f"{retries} enqueue(s) retried after a deadlock")
    assert errors == []
    results = [tuple(pair) for outcome in outcomes for pair in outcome["results"]]
    assert len(results) == ENQUEUERS * CALLS
    keys = dict(Job.objects.filter(task_path=PATH).values_list("pk", "unique_key"))
    assert all(keys[job_id] == f"{PATH}/k:{key}" for key, job_id in results)
