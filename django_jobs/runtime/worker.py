"""The worker loop: claim as many jobs as there are idle threads, run them, repeat."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from inspect import isasyncgenfunction

from django.db import close_old_connections
from django.db.models import Q

from django_jobs.conf import JobsSettings
from django_jobs.core.claimed import release_job
from django_jobs.core.lanes import Lane
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.db.retry import DB_ERRORS, Backoff, reset_connection
from django_jobs.exceptions import TaskNotFound
from django_jobs.models import ClaimedExecution, Job, JobStatus, Pause, ReadyExecution
from django_jobs.runtime.async_lane import AsyncLane
from django_jobs.runtime.completer import Completer
from django_jobs.runtime.context import ExecutionContext, persist
from django_jobs.runtime.executor import execute_job, is_async, start_claimed
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.listener import start_listener
from django_jobs.runtime.recycling import RecyclePolicy
from django_jobs.runtime.wakeup import WakeFeed
from django_jobs.runtime.watchdog import Watchdog
from django_jobs.tasks.loading import load_task
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.worker")


def importable(job: Job) -> bool:
    try:
        load_task(job.task_path)
    except TaskNotFound:
        return False
    return True


# Whether each task path this process has run is async: a task's function does not change
# in a running process (a reload starts new ones), and importing the task again for every
# job, twice, cost the sync drain a few percent of its CPU.
TASK_IS_ASYNC: dict[str, bool] = {}


def runs_async(job: Job) -> bool:
    """An ``async def`` task's job; one whose task cannot be imported goes to a thread,
    which fails it. An async generator function's job goes to the lane too, which fails
    it saying so (a thread failed it for returning an unstorable ``async_generator``)."""
    known = TASK_IS_ASYNC.get(job.task_path)
    if known is not None:
        return known
    try:
        task = load_task(job.task_path)
    except TaskNotFound:
        return False
    TASK_IS_ASYNC[job.task_path] = kind = is_async(task) or isasyncgenfunction(task.func)
    return kind


class Worker:
    """One pool of threads fed from ``ReadyExecution``.

    It never claims more jobs than it has idle threads, so a claimed job starts
    at once; nothing sits claimed behind a busy thread, invisible to others.
    """

    def __init__(
        self,
        conf: JobsSettings,
        process_id: int,
        worker_id: str,
        lifecycle: Lifecycle,
        *,
        once: bool = False,
        recycle: bool = False,
        wake_feed: WakeFeed | None = None,
    ) -> None:
        self.conf = conf
        self.db = conf.database
        self.process_id = process_id
        self.selector = QueueSelector(conf.queues)
        self.lifecycle = lifecycle
        self.once = once
        # On MariaDB/MySQL and SQLite, the supervisor's check for ready jobs (wakeup.py).
        self.wake_feed = wake_feed
        self.ctx = ExecutionContext(
            db=self.db,
            process_id=process_id,
            worker_id=worker_id,
            lifecycle=lifecycle,
            db_retry_max_delay=conf.db_retry_max_delay,
            max_result_size=conf.max_result_size,
            max_error_size=conf.max_error_size,
        )
        self.completer = Completer(self.ctx, on_written=lifecycle.wake.set)
        self.ctx.completer = self.completer
        self.watchdog = Watchdog(
            self.db,
            conf.interrupt_grace,
            lifecycle.request_abandon,
            poll_interval=conf.cancel_poll_interval,
        )
        self.ctx.watchdog = self.watchdog
        self.lock = threading.Lock()
        self.running: dict[int, Job] = {}
        self.pool = ThreadPoolExecutor(conf.threads, thread_name_prefix="django-jobs-worker")
        # ``async def`` jobs run here, on an event loop, when async_jobs > 0; else on the
        # threads, through async_to_sync, as sync ones do.
        self.lane = (
            AsyncLane(
                self.ctx,
                conf.async_jobs,
                conf.async_orm_threads,
                block_threshold=conf.event_loop_block_threshold,
            )
            if conf.async_jobs > 0
            else None
        )
        # The jobs of ``running`` that run on the lane.
        self.on_lane: set[int] = set()
        # Jobs handed to the lane whose success the completer may not have written yet:
        # each holds its slot until it is (``lane_room``). Added and pruned by the claim
        # loop's thread only.
        self.lane_jobs: set[int] = set()
        # The last claim of either kind was full of async jobs only: the next claims async
        # jobs alone, as many as the loop has room for (then either kind again).
        self.async_next = False
        # Lanes whose last claim came back short: no ready job of that kind was left for
        # this process. A claim of that lane alone waits for news that jobs may be ready
        # (a notification, the supervisor's check, a job of its kind ending) or the next
        # poll: without this, a process whose threads were all busy claimed async jobs
        # after every job it finished, finding none (MariaDB's sync drain ran at 0.75 of
        # its rate before the lane).
        self.dry: set[Lane] = set()
        self.dry_since = 0.0
        # Jobs still running when shutdown gave up on them (an immediate stop, a body
        # the interrupt did not end): their threads cannot be killed, so the process
        # must exit without joining them.
        self.abandoned = 0
        # A claim whose COMMIT lost its connection may have gone through anyway.
        self.claims_in_doubt = False
        # Only a supervisor's worker process is recycled: it has someone to replace it.
        self.recycle = (
            RecyclePolicy(conf.max_jobs_per_child, conf.max_memory_per_child) if recycle else None
        )

    def idle_threads(self) -> int:
        """How many jobs to claim now: free threads, within the bound on unwritten successes.

        A thread hands its success to the completer and is free at once. Claiming
        for it with no limit let the completer's backlog grow without bound under
        load (156 completed jobs failed by one SIGKILL in 3,000), holding the
        backlog's keys' slots. So running jobs plus unwritten successes never
        exceed :func:`unrecorded_bound`: ``threads`` more successes may wait for
        the completer while the threads run new jobs, one batch in flight while
        the next one runs. Without that slack (a thread waiting for its own
        success's commit) the claim, start and finish of a batch ran one after
        another: 0.29 of the unlimited drain with 1,000 keys instead of 0.55, and
        4.4x django-tasks-db's drain instead of 5.0x (bench/throughput.py, same run).
        """
        lane: set[int] = set()
        with self.lock:
            running = set(self.running)
            if self.lane_jobs:  # else nothing of the lane's, running or unwritten
                running -= self.on_lane
                lane = self.on_lane | self.lane_jobs
        # The lane's unwritten successes are counted against its own slots (lane_room).
        unwritten = self.completer.pending_ids()
        if lane:
            unwritten -= lane
        busy = len(running - unwritten)
        threads = self.conf.threads
        return min(threads - busy, unrecorded_bound(threads) - busy - len(unwritten))

    def lane_room(self, lane: AsyncLane) -> int:
        """How many more async jobs to claim: free slots, less the successes of async jobs
        that the completer has not written yet.

        A body that has returned keeps its slot until its success commits, as a thread's
        job counts against ``2 x threads`` until its own does: in flight and unwritten
        together, the lane never holds more than ``async_jobs`` jobs whose bodies may
        have completed unrecorded, the most a SIGKILL can turn into failed attempts
        (:func:`unrecorded_bound`). Freed at the hand-off instead, the loop ran ahead of
        a completer that fell behind: 63 completed jobs failed by one kill with 20 slots
        (tests/test_async_runtime.py, the completer slowed to a batch a second).
        """
        if not self.lane_jobs:
            # Nothing on the lane nor unwritten from it (``lane_jobs`` holds every job of
            # ``on_lane``, and only this thread changes it): a process of sync jobs pays
            # no lock and no copy of the completer's ids here, once per job that ends.
            return lane.free()
        # On the lane first, then pending: a job leaves the lane only after its success
        # has gone to the completer, so it is seen in one or the other.
        with self.lock:
            on_lane = set(self.on_lane)
        pending = self.completer.pending_ids()
        self.lane_jobs &= on_lane | pending
        return lane.free() - len(self.lane_jobs - on_lane)

    def capacity(self) -> tuple[int, Lane | None]:
        """How many jobs to claim now, and of which lane (None: of either).

        With both a free thread and a free slot on the event loop, any job has room: the
        claim takes jobs of either kind, as many as the scarcer of the two can take, so
        that none waits claimed for room of its kind. With room of one kind only, the
        claim takes jobs of that kind only (``Job.is_async``): a process whose threads
        are busy never claims a sync job away from a process with a free thread, nor
        one with a full event loop an async job (docs/running.md, "How a worker claims").

        A claim of either kind takes no more than the free threads (a few), where the loop
        has room for hundreds: when one comes back full of async jobs only, the next
        claims async jobs alone, as many as the loop can take, and the one after that
        either kind again, so that sync jobs behind a flood of async ones still start.
        """
        threads = self.idle_threads()
        if self.lane is None:
            return threads, None
        slots = self.lane_room(self.lane)
        if slots > 0 and (threads <= 0 or self.async_next):
            if self.async_next or Lane.ASYNC not in self.dry:
                self.async_next = False
                return slots, Lane.ASYNC
            return 0, Lane.ASYNC
        if threads > 0 and slots > 0:
            return min(threads, slots), None
        if Lane.SYNC in self.dry:
            return 0, Lane.SYNC
        return max(threads, 0), Lane.SYNC

    def note_claim(self, lane: Lane | None, limit: int, claimed: int) -> None:
        """A claim that came back short leaves its lane dry (either kind's, both), until
        :meth:`refresh_dry` sees news or the next poll is due."""
        logger.debug("claimed %d of %d (%s)", claimed, limit, lane or "either kind")
        if claimed >= limit:
            return
        self.dry.update((lane,) if lane is not None else (Lane.SYNC, Lane.ASYNC))
        self.dry_since = time.monotonic()

    def refresh_dry(self) -> None:
        """Forget which lanes were dry once jobs may have been made ready since: news
        from the listener or the supervisor's check, or a poll's interval gone by. (A
        success the completer writes is none: it frees room of both kinds, and taking it
        as news brought back one empty claim per batch written.)"""
        if self.lifecycle.news.is_set():
            self.lifecycle.news.clear()
            self.dry.clear()
        elif self.dry and time.monotonic() - self.dry_since >= self.idle_wait():
            self.dry.clear()

    def run(self) -> None:
        backoff = Backoff(self.conf.db_retry_max_delay)
        self.completer.start()
        self.watchdog.start()
        # On PostgreSQL, a NOTIFY for a new ready job sets wake (see listener.py).
        listener = None if self.once else start_listener(self.conf, self.selector, self.lifecycle)
        # Elsewhere, the supervisor's check for ready jobs sets it (see wakeup.py).
        if self.wake_feed is not None:
            self.wake_feed.start()
        try:
            while not self.lifecycle.stopping.is_set():
                if self.recycle is not None and (reason := self.recycle.reason()):
                    self.lifecycle.request_recycle(reason)
                    break
                self.refresh_dry()
                idle, lane = self.capacity()
                limit = min(idle, self.conf.batch_size)
                if self.recycle is not None:
                    limit = self.recycle.room(limit)
                claimed = 0
                if limit > 0:
                    try:
                        if self.claims_in_doubt:
                            self.release_orphaned_claims()
                        claimed = self.claim_and_submit(limit, lane)
                        self.note_claim(lane, limit, claimed)
                        backoff.reset()
                    except Exception as exc:
                        # An outage, a row no check foresaw, or a bug of ours: this loop is
                        # the process's only claimer, so it goes on, backing off. The error
                        # may have hidden a committed claim, or come after one: its jobs
                        # are handed back before the next claim, not left to no thread.
                        reset_connection(self.db)
                        self.claims_in_doubt = True
                        delay = backoff.next()
                        if isinstance(exc, DB_ERRORS):
                            logger.warning(
                                "database unavailable while claiming (%s); retrying in %.2fs",
                                exc,
                                delay,
                            )
                        else:
                            logger.exception("claiming failed; trying again in %.2fs", delay)
                        self.lifecycle.sleep(delay)
                        continue
                if claimed and (claimed == limit < idle or self.async_next):
                    continue  # a full batch with room to spare: there may be more
                if self.once and not claimed and not self.running and self.queue_is_empty():
                    return
                # Until a thread frees up or a job is notified (they set wake), or
                # the next poll is due.
                self.lifecycle.sleep(self.idle_wait())
        finally:
            if listener is not None:
                listener.stop()
            self.shutdown()
            self.watchdog.stop()

    def idle_wait(self) -> float:
        """Seconds until the next poll of an idle worker: the fallback interval while the
        supervisor's check for ready jobs wakes it (it wakes the worker too when it goes
        quiet, so a long fallback never outlives it), else ``polling_interval``."""
        if self.wake_feed is not None and self.wake_feed.live:
            return self.conf.fallback_polling_interval
        return self.conf.polling_interval

    def queue_is_empty(self) -> bool:
        """In --once mode: nothing due or ready for our queues, nothing of ours claimed."""
        if promote_due_jobs(self.db, self.conf.batch_size):
            return False
        conditions = Q()
        for condition in self.selector.conditions():
            conditions |= condition
        ready = (
            ReadyExecution.objects.using(self.db)
            .filter(conditions)
            .exclude(queue_name__in=Pause.objects.using(self.db).values("queue_name"))
        )
        mine = ClaimedExecution.objects.using(self.db).filter(process_id=self.process_id)
        return not ready.exists() and not mine.exists()

    def release_orphaned_claims(self) -> None:
        """Hand back claims of ours that no thread runs (their claim's commit seemed
        to fail but went through): never started, they cost no attempt. Only this
        thread claims, so every other claim of this process is in ``running``."""
        with self.lock:
            running = [*self.running, *self.completer.pending_ids()]
        orphans = list(
            ClaimedExecution.objects.using(self.db)
            .filter(process_id=self.process_id)
            .exclude(job_id__in=running)
            .values_list("job_id", flat=True)
        )
        for job_id in orphans:
            if release_job(self.db, job_id, self.process_id):
                logger.warning("handed back job %s: claimed, but the claim seemed lost", job_id)
        self.claims_in_doubt = False

    def claim_and_submit(self, limit: int, lane: Lane | None = None) -> int:
        """Claim, count the attempts of the claimed jobs in one transaction, run them.

        The claim itself counts the attempts of most jobs (see
        ``core.ready.claim_jobs``); the others are started here in one transaction.
        A job whose task cannot be imported, or claimed as a stop began, is not
        run: its thread fails it, or hands it back, with any start the claim
        counted taken back, so it costs no attempt.
        """
        jobs = claim_jobs(
            self.db,
            self.process_id,
            self.selector,
            limit,
            self.conf.max_concurrency,
            worker_id=self.ctx.worker_id,
            lane=lane,
        )
        with self.lock:
            for job in jobs:
                self.running[job.pk] = job
        if lane is None and self.lane is not None:
            self.async_next = len(jobs) == limit and all(map(runs_async, jobs))
        submitted: set[int] = set()
        try:
            self.submit(jobs, submitted)
        except BaseException:
            # Jobs no thread took are not running: forgotten here, their claims are
            # handed back before the next claim (``claims_in_doubt``, set by the caller).
            for job in jobs:
                if job.pk not in submitted:
                    self.forget(job)
            raise
        return len(jobs)

    def submit(self, jobs: list[Job], submitted: set[int]) -> None:
        """Start what the claim did not, and hand each job to a thread (its id then goes
        into ``submitted``)."""
        runnable = [] if self.lifecycle.stopping.is_set() else [j for j in jobs if importable(j)]
        started = {job.pk for job in runnable if job.status == JobStatus.RUNNING}
        startable = [job for job in runnable if job.status == JobStatus.CLAIMED]
        started |= {job.pk for job in start_claimed(startable, self.ctx)}
        if self.recycle is not None:
            self.recycle.count(len(jobs))
        lost = {job.pk for job in startable} - started
        on_lane: list[Job] = []
        for job in jobs:
            if job.pk in lost and job.status == JobStatus.SCHEDULED:
                # Over its rate limit: the start sent it back to wait for its window.
                logger.debug("job %s: rate-limited until %s", job.pk, job.rate_reserved_at)
                self.forget(job)
                continue
            if job.pk in lost:
                logger.warning(
                    "job %s: claim lost before start (process pruned?); not running it", job.pk
                )
                self.forget(job)
                continue
            if self.lane is not None and runs_async(job):
                on_lane.append(job)
                continue
            self.pool.submit(self.run_one, job, job.pk in started)
            submitted.add(job.pk)
        if self.lane is not None and on_lane:
            with self.lock:
                self.on_lane.update(job.pk for job in on_lane)
            self.lane_jobs.update(job.pk for job in on_lane)
            runs: list[tuple[Job, bool, Callable[[], None]]] = [
                (job, job.pk in started, partial(self.ended, job)) for job in on_lane
            ]
            self.lane.submit(runs)
            submitted.update(job.pk for job in on_lane)

    def run_one(self, job: Job, started: bool) -> None:
        try:
            execute_job(job, self.ctx, started=started)
        finally:
            self.ended(job)

    def ended(self, job: Job) -> None:
        """``job``'s outcome is recorded or with the completer: its room is free.

        Room of its own kind: a claim of its lane alone may find a job again (one a queue
        cap held back, say), so that lane is no longer taken as dry. The other lane still
        is: a thread freeing up says nothing of async jobs, nor a loop slot of sync ones.
        """
        self.dry.discard(Lane.ASYNC if job.pk in self.on_lane else Lane.SYNC)
        self.forget(job)
        self.lifecycle.wake.set()

    def forget(self, job: Job) -> None:
        """Take ``job`` (this claim's object) out of ``running``, unless the entry is a
        newer claim of the same job. A failed attempt retried at once can be claimed again
        by this process while the thread that recorded the failure is still on its way
        out: popping by id then dropped the new run's entry, and the next check for
        orphaned claims handed back a job that was running (its attempt undone, so the
        same attempt ran twice; the chaos soak caught it)."""
        with self.lock:
            if self.running.get(job.pk) is job:
                del self.running[job.pk]
                self.on_lane.discard(job.pk)

    def running_besides_stuck(self) -> bool:
        """Jobs still running that may yet end (a stuck one will not: no use waiting)."""
        with self.lock:
            return any(pk not in self.lifecycle.stuck_jobs for pk in self.running)

    def shutdown(self) -> None:
        """Let running jobs finish up to the shutdown timeout; interrupt the rest.

        A process stopping to be recycled waits for its jobs without a deadline,
        until a stop signal arrives: then the shutdown timeout runs from there.

        At the deadline each body still running gets ``WorkerShutdown`` raised in
        its thread (an ``async def`` one: its asyncio task cancelled) and
        ``interrupt_grace`` seconds to end; one that ends is recorded by its own
        thread like any failure, or as a success if it returned. One that does
        not (blocked in C code, which no Python exception reaches, or an async
        body that goes on after its ``CancelledError``) keeps its claim, and so
        its concurrency slot: this process exits without settling it, and it is
        settled once the process is gone (docs/design.md invariant 9). Failing it
        from here, as this once did, freed its slot while its body still ran,
        and another worker could start the next job of a limit-1 key before this
        process had exited.
        """
        if self.claims_in_doubt:
            # A claim whose commit seemed lost, then a stop before the next claim could
            # hand its jobs back: do it now. Left to recovery, jobs the claim started
            # would count as failed attempts of bodies that never ran.
            persist(self.ctx, "handing back claims no thread runs", self.release_orphaned_claims)
        deadline = time.monotonic() + self.conf.shutdown_timeout
        while (
            self.running_besides_stuck()
            and self.lifecycle.recycling
            and not self.lifecycle.signalled.is_set()
        ):
            self.lifecycle.signalled.wait(0.05)
            deadline = time.monotonic() + self.conf.shutdown_timeout
        self.wait_for_running(deadline)
        if self.running_besides_stuck() and not self.lifecycle.immediate.is_set():
            self.interrupt_running()
            self.wait_for_running(time.monotonic() + self.conf.interrupt_grace)
        if not self.lifecycle.immediate.is_set():
            # Successes handed to the completer are written before this process goes.
            self.completer.stop()
        with self.lock:
            leftovers = list(self.running.values())
        # Stop now, or a body that did not end: its thread cannot be killed, so the
        # process must exit without joining it, and the claim is left to whoever
        # recovers this process once it is gone.
        self.abandoned = len(leftovers)
        if self.lifecycle.immediate.is_set():
            return
        for job in leftovers:
            if job.pk not in self.lifecycle.stuck_jobs:
                self.leave_running(job)
        self.pool.shutdown(wait=not leftovers, cancel_futures=True)
        if self.lane is not None:
            self.lane.stop(wait=not leftovers)
        close_old_connections()

    def wait_for_running(self, deadline: float) -> None:
        """Until the running jobs (stuck ones aside) have ended, the deadline, or a stop-now."""
        while self.running_besides_stuck() and time.monotonic() < deadline:
            if self.lifecycle.immediate.wait(0.05):
                return

    def interrupt_running(self) -> None:
        """Interrupt each body still running, as the watchdog interrupts one past its
        timeout (``Watchdog.interrupt_at_shutdown``): recorded as ``WorkerShutdown``."""
        with self.lock:
            job_ids = [pk for pk in self.running if pk not in self.lifecycle.stuck_jobs]
        interrupted = self.watchdog.interrupt_at_shutdown(job_ids, self.conf.shutdown_timeout)
        if interrupted:
            logger.warning(
                "job(s) %s still running after the %gs shutdown timeout: interrupting them "
                "(%gs to end)",
                ", ".join(map(str, interrupted)),
                self.conf.shutdown_timeout,
                self.conf.interrupt_grace,
            )

    def leave_running(self, job: Job) -> None:
        """A job whose thread still runs after the interrupt: its claim outlives us.

        Its body may not have ended (or, if it has, its outcome is not written):
        whoever recovers this process once it is gone records it.
        """
        self.lifecycle.left_running.add(job.pk)
        with self.watchdog.lock:
            control = self.watchdog.controls.get(job.pk)
        if control is None:
            what = "its thread has not finished"
        elif control.asynchronous:
            what = "its body still runs (CancelledError ignored, or a synchronous call?)"
        else:
            what = "its body still runs (blocked outside Python?)"
        logger.error(
            "job %s: %s %gs after the interrupt at the shutdown deadline: exiting without "
            "settling it; it is recovered once this process is gone, and its concurrency "
            "slot stays held until then",
            job.pk,
            what,
            self.conf.interrupt_grace,
        )


def unrecorded_bound(threads: int, async_jobs: int = 0) -> int:
    """The most jobs of one worker process whose body has returned and whose
    success has not committed, at any instant: what a SIGKILL can cost
    (docs/running.md). The threads' running jobs and unwritten successes together
    never pass ``2 x threads``, the lane's never pass its ``async_jobs`` slots
    (``Worker.lane_room``), so it holds whatever the load or the number of keys."""
    return 2 * threads + async_jobs
