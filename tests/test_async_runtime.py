"""The worker process around ``async def`` jobs (issue 39, items 2 to 4 and its bad input),
with real ``run_jobs`` processes and real signals: a SIGKILL with 500 async jobs in
flight, a graceful stop, the fault-isolation invariant, the connections the async ORM
holds, a body that blocks the loop, and jobs that attack the loop itself.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from django.db import connection
from hypothesis import given
from hypothesis import strategies as st

from django_jobs import bulk_enqueue
from django_jobs.models import (
    FINISHED_STATUSES,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
    ReadyExecution,
)
from django_jobs.runtime.worker import unrecorded_bound
from testproject.demo.models import AuditEvent
from tests import async_job_tasks as at
from tests.async_job_tasks import LOOP_THREAD
from tests.harness import error_paths, job_row, wait_until
from tests.test_fault_isolation import (
    PROPERTY,
    assert_return_value_recorded,
    encode,
    hostile_values,
    last_failure,
)

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

PROCESS_DIED = "django_jobs.exceptions.ProcessDied"
CANCELLED = "django_jobs.exceptions.JobCancelled"
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED}


def settled(ids: list[int], timeout: float = 30.0) -> dict[int, Job]:
    """Wait until every job of ``ids`` has ended; their rows."""

    def ended() -> dict[int, Job] | None:
        jobs = {job.pk: job for job in Job.objects.filter(pk__in=ids)}
        done = len(jobs) == len(ids) and all(job.status in TERMINAL for job in jobs.values())
        return jobs if done else None

    return wait_until(ended, timeout, what=f"jobs {ids[:10]}... to end")


def stop(proc) -> None:
    """A graceful stop that leaves nothing claimed and no process row."""
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


# --- a SIGKILL with 500 async jobs in flight --------------------------------------------------

KILL_JOBS, IN_FLIGHT, THREADS = 1500, 500, 2


def test_a_sigkill_with_500_async_jobs_in_flight_loses_none(run_jobs, figure):
    """1,500 async jobs of 1 to 4 s on one worker process with room for 500 at once
    (``--async-jobs 500``); the process is SIGKILLed while it holds 450 claims or more, at
    least 400 bodies in their await (each wrote its start and not its end), and some tens
    have ended. Its supervisor recovers the claims and starts another worker: every job
    ends SUCCEEDED (max_attempts=2: a body the kill cut short ran again, its first
    attempt recorded ProcessDied), and a body that completed before the kill ran again
    only within the documented window (docs/running.md, "How much a crash can cost":
    ``2 x threads + async_jobs``), counted from the bodies' own start and end stamps."""
    bulk_enqueue([(at.audited_wait, [1.0 + (i % 60) * 0.05], {}) for i in range(KILL_JOBS)])
    began = time.monotonic()
    proc = run_jobs("--processes", "1", "--threads", str(THREADS), "--async-jobs", str(IN_FLIGHT))
    first_run = AuditEvent.objects.filter(key="kill", attempt=1)

    def loaded() -> tuple[int, int, int] | None:
        claims = ClaimedExecution.objects.count()
        awaiting = first_run.filter(ended__isnull=True).count()
        ended = first_run.filter(ended__isnull=False).count()
        # Under load (a busy 2-core machine, MariaDB writing every audit row) the loop
        # seldom holds 450 bodies while 200 have ended: some hundreds in their await and
        # some tens ended prove the same (a kill with bodies both cut short and completed).
        full = claims >= IN_FLIGHT * 0.9 and awaiting >= IN_FLIGHT * 0.8 and ended >= 50
        return (claims, awaiting, ended) if full else None

    claims, awaiting, ended = wait_until(
        loaded, 240, interval=0.02, what="450 jobs in flight and 50 ended"
    )
    os.kill(Process.objects.get(kind="worker").pid, signal.SIGKILL)
    wait_until(
        lambda: not Job.objects.exclude(status__in=FINISHED_STATUSES).exists(),
        240,
        interval=0.2,
        what="every job finished",
    )
    elapsed = time.monotonic() - began
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]

    assert Job.objects.count() == KILL_JOBS
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
    paths = set(FailedExecution.objects.values_list("exception_class_path", flat=True))
    assert paths <= {PROCESS_DIED}
    runs: dict[int, list[AuditEvent]] = {}
    for event in AuditEvent.objects.filter(key="kill").order_by("attempt", "pk"):
        runs.setdefault(event.job_id, []).append(event)
    assert len(runs) == KILL_JOBS  # none lost: every job's body ran
    cut_short = {pk for pk, events in runs.items() if events[0].ended is None}
    completed_twice = {
        pk for pk, events in runs.items() if len(events) > 1 and events[0].ended is not None
    }
    died = set(
        FailedExecution.objects.filter(exception_class_path=PROCESS_DIED).values_list(
            "job_id", flat=True
        )
    )
    # Each body the kill cut short was recorded as a failed attempt and ran again, to its
    # end; no body ran a third time.
    assert cut_short <= died
    assert all(len(runs[pk]) == 2 and runs[pk][1].ended is not None for pk in cut_short)
    assert max(len(events) for events in runs.values()) <= 2
    bound = unrecorded_bound(THREADS, IN_FLIGHT)
    figure(
        f"async sigkill[{connection.vendor}] jobs={KILL_JOBS} at the kill: claims={claims} "
        f"bodies awaiting={awaiting} ended={ended}; cut short={len(cut_short)} "
        f"ProcessDied={len(died)} completed but run again={len(completed_twice)} "
        f"(bound {bound}) elapsed={elapsed:.1f}s"
    )
    # The bodies awaiting when the kill was decided, less the few that ended in the
    # milliseconds before it: the kill's own condition, not a stricter one it did not wait
    # for (it asked 0.9 here: under load the count landed between, 446 of 449 awaiting).
    assert len(cut_short) >= IN_FLIGHT * 0.75
    assert len(completed_twice) <= bound, sorted(completed_twice)[:20]


def test_successes_the_completer_has_not_written_hold_their_slots_on_the_loop(run_jobs, figure):
    """The lane's part of the window: a body that has returned holds its slot until its
    success is written, so a SIGKILL can cost at most ``async_jobs`` completed async jobs
    (plus the threads' ``2 x threads``). The completer is slowed to one batch a second
    (a database that takes that long to commit); 400 async jobs of 0.05 s; the worker is
    killed once 60 bodies have ended. Before, a slot was free again as soon as its success
    was handed to the completer: the loop ran ahead of the writes, and the kill cost 63
    completed jobs with 20 slots (PostgreSQL)."""
    slots = 20
    proc = run_jobs("--processes", "1", "--threads", str(THREADS), "--async-jobs", str(slots))
    slowed = at.slows_the_completer.enqueue(1.0)
    wait_until(lambda: job_row(slowed).status == JobStatus.SUCCEEDED, 30, what="slowed")
    bulk_enqueue([(at.audited_wait, [0.05], {}) for _ in range(400)])
    wait_until(
        lambda: AuditEvent.objects.filter(ended__isnull=False).count() >= 60,
        60,
        what="60 bodies ended",
    )
    os.kill(Process.objects.get(kind="worker").pid, signal.SIGKILL)
    wait_until(
        lambda: not Job.objects.exclude(status__in=FINISHED_STATUSES).exists(),
        120,
        interval=0.2,
        what="every job finished",
    )
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
    first_runs = AuditEvent.objects.filter(key="kill", attempt=1, ended__isnull=False)
    again = set(AuditEvent.objects.filter(key="kill", attempt=2).values_list("job_id", flat=True))
    completed_twice = set(first_runs.values_list("job_id", flat=True)) & again
    bound = unrecorded_bound(THREADS, slots)
    figure(
        f"async window, slowed completer[{connection.vendor}]: completed but run again="
        f"{len(completed_twice)} (bound {bound})"
    )
    assert len(completed_twice) <= bound, sorted(completed_twice)


# --- a graceful stop ----------------------------------------------------------------------------

WORKER_SHUTDOWN = "django_jobs.exceptions.WorkerShutdown"


def test_a_graceful_stop_lets_async_jobs_finish_and_interrupts_the_rest_in_time(run_jobs, tmp_path):
    """60 slots, all taken: 40 jobs that finish once told to (the test tells them just
    after SIGTERM), 19 that await 60 s, one that ignores its CancelledError; 30 more wait
    in the queue. shutdown_timeout 2 s, interrupt_grace 3 s. The 40 succeed (the stop let
    them finish), the 19 are interrupted at the deadline (WorkerShutdown, to be retried),
    the waiting 30 were never claimed, and the one that ignores its cancellation is left
    to recovery when its process exits, shutdown_timeout + interrupt_grace after the
    signal: the process does not wait for it any longer, nor stop sooner."""
    flag = tmp_path / "go"
    finishing = [at.waits_for.using(priority=10).enqueue(str(flag)) for _ in range(40)]
    interrupted = [at.sleeps.using(priority=10).enqueue(60) for _ in range(19)]
    stubborn = at.ignores_cancellation.using(priority=10).enqueue()
    waiting = [at.canary.using(priority=-10).enqueue() for _ in range(30)]
    timeout, grace = 2.0, 3.0
    proc = run_jobs(
        "--processes",
        "1",
        "--threads",
        "2",
        "--async-jobs",
        "60",
        env={"JOBS_SHUTDOWN_TIMEOUT": str(timeout), "JOBS_INTERRUPT_GRACE": str(grace)},
    )
    wait_until(lambda: AuditEvent.objects.count() == 60, 30, what="60 bodies started")
    began = time.monotonic()
    proc.send(signal.SIGTERM)
    # The worker child has stopped claiming (its supervisor asked it to): the 40 end now,
    # and the slots they free take none of the waiting 30.
    proc.wait_for_output("asked by the supervisor")
    flag.touch()
    assert proc.wait(30) == 0, proc.output()[-3000:]
    took = time.monotonic() - began

    jobs = {job.pk: job for job in Job.objects.all()}
    for result in finishing:
        job = jobs[int(result.id)]
        assert (job.status, job.attempts, job.return_value) == (JobStatus.SUCCEEDED, 1, LOOP_THREAD)
    for result in interrupted:
        job = jobs[int(result.id)]
        assert job.status in {JobStatus.READY, JobStatus.SCHEDULED} and job.attempts == 1
        assert error_paths(result) == [WORKER_SHUTDOWN]
        message = FailedExecution.objects.get(job_id=job.pk).message
        assert message.startswith("interrupted: still running after the 2s shutdown timeout")
    for result in waiting:
        assert (jobs[int(result.id)].status, jobs[int(result.id)].attempts) == (JobStatus.READY, 0)
    left = jobs[int(stubborn.id)]
    assert left.attempts == 1 and left.status in {JobStatus.READY, JobStatus.SCHEDULED}
    assert error_paths(stubborn) == [PROCESS_DIED]
    message = FailedExecution.objects.get(job_id=left.pk).message
    assert "exited: the job could not be interrupted" in message, message
    assert timeout + grace <= took < timeout + grace + 4, took
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


# --- bad input: jobs that attack the loop ---------------------------------------------------------

ASYNC_CANCELLED = "asyncio.exceptions.CancelledError"
# What a worker's output shows when a thread of it died or it gave up on itself.
DEAD_THREAD_SIGNS = ("Exception in thread", "cannot go on", "the completer stopped")


def assert_still_serving(proc) -> None:
    """An async job and a sync job enqueued now succeed, on the loop and on a thread; the
    process is alive and no thread of it died."""
    on_loop, on_thread = at.canary.enqueue(), at.sync_step.enqueue("after")
    jobs = settled([int(on_loop.id), int(on_thread.id)])
    assert jobs[int(on_loop.id)].return_value == LOOP_THREAD
    assert jobs[int(on_thread.id)].return_value["thread"].startswith("django-jobs-worker")
    assert proc.proc.poll() is None
    output = proc.output()
    for sign in DEAD_THREAD_SIGNS:
        assert sign not in output, output[-3000:]


def test_jobs_that_attack_the_loop_end_with_a_clear_error_and_the_process_serves_on(
    run_jobs, tmp_path
):
    """Among 20 siblings awaiting on the same loop: a job that cancels its own asyncio
    task, one that cancels its own job, one that closes the loop, one that stops it, one
    that sets another loop as its thread's, one that returns a coroutine (unstorable), an
    async generator given as a task, and two jobs whose rows say the other lane. Each
    ends alone, saying why; the siblings succeed; the process serves on.

    Before: the self-cancel was recorded as a bare CancelledError with an empty message,
    the stop succeeded (the loop halted every async job until the lane ran it again), and
    the async generator failed as an unstorable return value."""
    flag = tmp_path / "go"
    siblings = [at.waits_for.enqueue(str(flag)) for _ in range(20)]
    wait_until_running = [int(r.id) for r in siblings]
    proc = run_jobs("--processes", "1", "--threads", "2")
    wait_until(
        lambda: AuditEvent.objects.filter(job_id__in=wait_until_running).count() == 20,
        30,
        what="the siblings awaiting",
    )
    bad = {
        name: getattr(at, name).enqueue()
        for name in (
            "cancels_itself",
            "cancels_its_job",
            "closes_the_loop",
            "stops_the_loop",
            "replaces_the_loop",
            "returns_a_coroutine",
            "yields",
        )
    }
    # A deploy changed the task's kind between enqueue and run: the row says the other lane.
    bad["says_async"] = at.sync_step.enqueue("says async")
    bad["says_sync"] = at.canary.enqueue()
    for name, is_async in (("says_async", True), ("says_sync", False)):
        Job.objects.filter(pk=bad[name].id).update(is_async=is_async)
        ReadyExecution.objects.filter(job_id=bad[name].id).update(is_async=is_async)
    jobs = settled([int(result.id) for result in bad.values()])

    def failure(name: str) -> tuple[str, str]:
        job = jobs[int(bad[name].id)]
        assert (job.status, job.attempts) == (JobStatus.FAILED, 1), name
        row = FailedExecution.objects.get(job_id=job.pk)
        return row.exception_class_path, row.message

    assert failure("cancels_itself") == (
        ASYNC_CANCELLED,
        "the job's asyncio task was cancelled by the job itself or code it called, not by "
        "django-jobs (no cancel(), timeout or shutdown)",
    )
    path, message = failure("cancels_its_job")
    assert path == CANCELLED and message.startswith("cancelled (ran "), message
    assert failure("closes_the_loop") == (
        "builtins.RuntimeError",
        "Cannot close a running event loop",
    )
    assert failure("stops_the_loop") == (
        "builtins.RuntimeError",
        "a job must not stop the event loop of async jobs: it runs every async job of this "
        "worker process",
    )
    assert jobs[int(bad["replaces_the_loop"].id)].return_value == LOOP_THREAD
    path, message = failure("returns_a_coroutine")
    assert path == "django_jobs.exceptions.ResultNotStored" and "coroutine" in message
    assert failure("yields") == (
        "builtins.TypeError",
        "tests.async_job_tasks.yields is an async generator function: a task must be a "
        "coroutine function (async def ... return), not one that yields",
    )
    says_async = jobs[int(bad["says_async"].id)].return_value
    assert says_async["thread"].startswith("django-jobs-worker")
    assert jobs[int(bad["says_sync"].id)].return_value == LOOP_THREAD

    # The loop went on under all of it: the siblings still await, then succeed.
    assert Job.objects.filter(pk__in=wait_until_running, status=JobStatus.RUNNING).count() == 20
    flag.touch()
    assert {job.return_value for job in settled(wait_until_running).values()} == {LOOP_THREAD}
    assert "a job stopped the event loop" not in proc.output()
    assert_still_serving(proc)
    stop(proc)


# --- a body that blocks the loop ------------------------------------------------------------------


def test_a_body_that_blocks_the_loop_is_named_counted_and_stalls_nothing_else(run_jobs, tmp_path):
    """An async body calls ``time.sleep(2)``. The worker logs the stall naming the job's id
    and task path as it happens, and again when the loop runs again; the process row's
    metadata counts it. Meanwhile a sync job on a thread finishes (its success recorded
    during the stall) and the heartbeat goes on (0.5 s here): only the loop was held."""
    flag = tmp_path / "stalled"
    waiting = at.sync_when.enqueue(str(flag))
    proc = run_jobs("--processes", "1", "--threads", "2")
    wait_until(lambda: job_row(waiting).status == JobStatus.RUNNING, 20, what="the sync job")
    blocker = at.blocks_the_loop.enqueue(2.0, str(flag))
    beats: set = set()

    def blocker_done() -> bool:
        beat = Process.objects.filter(kind="worker").values_list("last_heartbeat_at", flat=True)
        beats.update(beat)
        return job_row(blocker).status == JobStatus.SUCCEEDED

    wait_until(blocker_done, 30, interval=0.05, what="the blocking job to end")
    stall = job_row(blocker).return_value
    assert stall["thread"] == LOOP_THREAD
    began, ended = stall["began"], stall["ended"]
    assert ended - began >= 2.0

    sync = job_row(waiting)
    assert sync.status == JobStatus.SUCCEEDED
    assert sync.return_value["thread"].startswith("django-jobs-worker")
    assert began <= sync.return_value["saw"] < ended
    assert began < sync.finished_at.timestamp() < ended, "its success waited for the loop"
    during = sorted(beat.timestamp() for beat in beats if began < beat.timestamp() < ended)
    assert len(during) >= 2, (began, ended, sorted(beat.timestamp() for beat in beats))

    where = f"job {blocker.id} (tests.async_job_tasks.blocks_the_loop)"
    proc.wait_for_output("runs again after ")
    output = proc.output()
    assert "has been blocked for " in output and f"s by {where}: every other async job" in output
    assert f"blocked by {where}" in output
    metadata = wait_until(
        lambda: (row := Process.objects.get(kind="worker").metadata).get("loop_stalls") and row,
        10,
        what="the stall counted in the process row",
    )
    assert metadata["loop_stalls"] == 1
    assert 1.5 <= metadata["loop_stalled_seconds"] <= ended - began + 0.5
    stop(proc)


def test_a_task_a_body_made_that_blocks_the_loop_is_named_as_that_job(run_jobs):
    """``asyncio.gather`` runs its coroutines as tasks of their own: the one holding the
    loop is not the body's task, yet the stall is the job's, named in the log. Before, it
    was "blocked for 1.0s by no job (the worker's own code)"."""
    proc = run_jobs("--processes", "1", "--threads", "2")
    result = at.blocks_in_a_gathered_task.enqueue(1.5)
    settled([int(result.id)])
    assert job_row(result).return_value == [1.5, None]
    where = f"job {result.id} (tests.async_job_tasks.blocks_in_a_gathered_task)"
    proc.wait_for_output("runs again after ")
    output = proc.output()
    assert f"s by {where}: every other async job" in output, output[-3000:]
    assert f"blocked by {where}" in output
    assert "the worker's own code" not in output
    stop(proc)


def test_a_job_holding_an_orm_thread_holds_up_no_other_job(run_jobs, tmp_path):
    """A job blocks in ``sync_to_async(time.sleep)(8)``, thread-sensitive as by default:
    one of the 4 ORM threads is held. 100 async jobs enqueued then, each querying through
    the async ORM and sync_to_async, start, run and are recorded while it is still held:
    their steps and calls go to the threads not held. Before, a job's thread was chosen
    at its start by how many jobs each had, and every job given the held one waited for
    it (200 such jobs: 0.45 s at the 90th percentile without the blocker, 4.6 s with)."""
    flag = tmp_path / "holding"
    proc = run_jobs("--processes", "1", "--threads", "2")
    blocker = at.blocks_an_orm_thread.enqueue(8.0, str(flag))
    wait_until(flag.exists, 20, what="the blocking call begun")
    quick = bulk_enqueue([(at.uses_the_orm, ["default"], {}) for _ in range(100)])
    settled([int(result.id) for result in quick], 20)
    assert job_row(blocker).status == JobStatus.RUNNING, "the quick jobs waited for it"
    assert settled([int(blocker.id)])[int(blocker.id)].return_value == 8.0
    stop(proc)


# --- the ORM inside async jobs: connections ------------------------------------------------------

ORM_JOBS, ORM_THREADS_DEFAULT, SYNC_THREADS = 1000, 4, 3


def db_connections(pid: int, port: int) -> int:
    """The TCP connections process ``pid`` holds open to the database's ``port``: its
    socket descriptors matched against the kernel's table of its network namespace."""
    inodes = set()
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return 0
    for descriptor in descriptors:
        try:
            target = os.readlink(descriptor)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            established = state == "01"
            if established and inode in inodes and int(remote.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def server_connections() -> int:
    """Connections to the test database, this test's own aside (pg_stat_activity)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


# The worker process's own connections besides its threads' and its ORM threads': the claim
# loop, the completer, the watchdog, the heartbeat, LISTEN (PostgreSQL), the progress writer
# and the loop monitor (each on first use).
RUNTIME_CONNECTIONS = 7
# asyncio's default executor size, which the lane's ClosingPool keeps.
POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)


@pytest.mark.parametrize("mode", ["default", "unsensitive"])
def test_1000_async_jobs_using_the_orm_leave_no_connection_behind(run_jobs, figure, tmp_path, mode):
    """1,000 async jobs, each an ``acreate``, a ``set_progress``, an ``aget``, an ``async
    for`` and a write through ``sync_to_async`` (``mode``: thread-sensitive as by
    default, or ``thread_sensitive=False``), one that stalls the loop for 0.8 s (the
    monitor records it), and 50 sync jobs querying on the threads, through one
    worker process (3 threads, 4 ORM threads, 200 slots). Its connections are counted
    from its own sockets 50 times a second; pg_stat_activity counts every connection to
    the test database. The worker never holds more than threads + async_orm_threads + 7
    (its runtime threads'); with ``thread_sensitive=False``, calls in flight on the loop's
    pool may add one each, and none stays open once they have returned. Once it stops,
    the server has the connections it had before it started.

    Before the lane's ClosingPool, asyncio's default executor kept a connection open in
    each of its threads that had run a query: 18 for the worker after the jobs (bound 14)
    on 2 CPUs, up to 32 more on a large machine."""
    if connection.vendor != "postgresql":
        pytest.skip("pg_stat_activity: PostgreSQL's")
    port = int(connection.settings_dict.get("PORT") or 5432)
    before = server_connections()
    proc = run_jobs("--processes", "1", "--threads", str(SYNC_THREADS))
    worker = wait_until(lambda: Process.objects.filter(kind="worker").first(), 20, what="worker")
    wait_until(lambda: db_connections(worker.pid, port) > 0, 20, what="the worker connected")
    idle = db_connections(worker.pid, port)
    calls = [(at.uses_the_orm, [mode], {}) for _ in range(ORM_JOBS)]
    for n in range(50):
        calls.insert(n * 20, (at.sync_uses_the_orm, [n], {}))
    # One stall of the loop, for the monitor's connection to be counted too.
    calls.insert(500, (at.blocks_the_loop, [0.8, str(tmp_path / "stalled")], {}))
    bulk_enqueue(calls)
    samples: list[int] = []

    def done() -> bool:
        samples.append(db_connections(worker.pid, port))
        return Job.objects.filter(status=JobStatus.SUCCEEDED).count() == len(calls)

    began = time.monotonic()
    wait_until(done, 180, interval=0.02, what="the 1,051 jobs to succeed")
    took = time.monotonic() - began
    after = db_connections(worker.pid, port)
    tree = sum(db_connections(pid, port) for pid in [proc.pid, *proc.tree()])
    server = server_connections() - before
    assert AuditEvent.objects.filter(key="orm", ended__isnull=False).count() == ORM_JOBS
    assert AuditEvent.objects.filter(key="orm-sync").count() == 50
    assert Process.objects.get(pk=worker.pk).metadata["loop_stalls"] >= 1
    stop(proc)
    wait_until(lambda: server_connections() == before, 10, what="every connection closed")
    budget = SYNC_THREADS + ORM_THREADS_DEFAULT + RUNTIME_CONNECTIONS
    figure(
        f"async ORM connections[{mode}] 1,001 async + 50 sync jobs in {took:.1f}s, worker "
        f"--threads {SYNC_THREADS}, async_orm_threads {ORM_THREADS_DEFAULT}: idle={idle} "
        f"peak={max(samples)} after the jobs={after} (budget {budget}"
        f"{f' + pool {POOL_THREADS} in flight' if mode == 'unsensitive' else ''}; "
        f"{len(samples)} samples); whole run_jobs tree={tree}, pg_stat_activity={server}; "
        f"after stop: {server_connections() - before}"
    )
    # The sockets counted are the server's connections: the method is sound.
    assert tree == server
    assert after <= budget
    in_flight = POOL_THREADS if mode == "unsensitive" else 0
    assert max(samples) <= budget + in_flight, samples


# --- fault isolation: whatever an async job returns or raises ends that job only ------------------


@pytest.fixture
def one_worker(run_jobs):
    """One worker for every example of a property test: started at the first call."""
    started: list = []

    def start():
        if not started:
            started.append(run_jobs("--processes", "1", "--threads", "2"))
        return started[0]

    return start


@PROPERTY
@given(values=st.lists(hostile_values, min_size=1, max_size=5))
def test_any_return_value_of_an_async_job_ends_it_in_a_defined_state(one_worker, values):
    """tests/test_fault_isolation.py's values, returned by an async body: stored as
    returned, or the job failed with ResultNotStored for a cause that is real; an async
    and a sync job enqueued after succeed."""
    worker = one_worker()
    results = [at.returns_encoded.enqueue(encode(value)) for value in values]
    jobs = settled([int(result.id) for result in results])
    for value, result in zip(values, results, strict=True):
        assert_return_value_recorded(jobs[int(result.id)], value)
    assert_still_serving(worker)


@PROPERTY
@given(values=st.lists(hostile_values, min_size=1, max_size=4))
def test_any_exception_of_an_async_job_is_recorded_and_ends_it(one_worker, values):
    worker = one_worker()
    results = [at.raises_encoded.enqueue(encode(value)) for value in values]
    jobs = settled([int(result.id) for result in results])
    for job in jobs.values():
        assert job.status == JobStatus.FAILED
        failure = last_failure(job.pk)
        assert failure.exception_class_path == "builtins.ValueError"
        assert "\x00" not in failure.message and len(failure.message) <= 2000
    assert_still_serving(worker)
