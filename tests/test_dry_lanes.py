"""A worker whose room is of one kind only claims that kind again only on news.

With every thread busy and the event loop free, the worker claims async jobs alone; with
the loop full and threads free, sync jobs alone (``Worker.capacity``). Such a claim that
finds nothing leaves its lane dry until jobs may have been made ready: a notification, the
supervisor's check, a job of that kind ending, or the next poll (``Worker.refresh_dry``).
Before, every job that ended with the threads still full (its success waiting for the
completer) brought one more claim for the other lane, which found nothing: on MariaDB,
where such a claim is several statements, the sync drain ran at 0.75 of its rate before the
async lane (bench/README.md).

Observed through the worker's DEBUG line for each claim ("claimed N of M (lane)") on a
real ``run_jobs`` process; each test names the count before the fix.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from django_jobs.models import Job, JobStatus
from tests import async_tasks, lane_tasks, transition_tasks
from tests.harness import wait_until

pytestmark = pytest.mark.workers

CLAIM_LINE = re.compile(r"claimed (\d+) of (\d+) \((sync|async|either kind)\)")
JOBS = 400
# The workers' polling interval here: the harness's 0.05 s would let a dry lane be claimed
# 20 times a second by design (as often as an idle worker polls), close to the rate a
# per-job claim reaches; at the default 0.2 s the two are apart by four times or more.
POLLING_INTERVAL = 0.2
WORKER_ENV = {"JOBS_LOG_LEVEL": "DEBUG", "JOBS_POLLING_INTERVAL": str(POLLING_INTERVAL)}
# No news of ready jobs at all (no LISTEN on PostgreSQL, no supervisor's check elsewhere):
# what the worker claims is then decided by its polls alone.
NO_NEWS = {**WORKER_ENV, "JOBS_LISTEN_NOTIFY": "false", "JOBS_READY_CHECK_INTERVAL": "none"}


def empty_claims(output: str, lane: str) -> int:
    return sum(1 for got, _, kind in CLAIM_LINE.findall(output) if kind == lane and got == "0")


def claiming_seconds(output: str) -> float:
    """From the worker's first claim line to its last, by the lines' own times."""
    stamps = [
        datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        for line in output.splitlines()
        if CLAIM_LINE.search(line)
    ]
    return (stamps[-1] - stamps[0]).total_seconds()


def news_bound(output: str) -> float:
    """The empty claims of a dry lane that news and polls allow: one per polling interval
    twice over (the listener or the supervisor's check, and the worker's own poll), and a
    few at the start. Before the fix their count grew with the jobs, not with the time."""
    return 5 + 2 * claiming_seconds(output) / POLLING_INTERVAL


def all_succeeded() -> bool:
    return Job.objects.filter(status=JobStatus.SUCCEEDED).count() == JOBS


def assert_dry_lane_claimed_on_news_only(output: str, lane: str, figure) -> None:
    assert CLAIM_LINE.search(output), output[-2000:]
    empty = empty_claims(output, lane)
    seconds = claiming_seconds(output)
    figure(f"dry {lane} lane: {empty} empty claims in {seconds:.1f}s of {JOBS:,} jobs")
    assert empty <= news_bound(output), f"{empty} empty {lane} claims in {seconds:.1f}s"


def test_busy_threads_do_not_claim_async_jobs_after_every_job_that_ends(run_jobs, figure):
    """Sync no-ops on 2 threads, the loop empty: async claims at most one per news or
    poll, not one per job (before: 444 in 6.7 s of 1,000 jobs, 28 after)."""
    for i in range(JOBS):
        transition_tasks.noop.enqueue(i)
    proc = run_jobs("--processes", "1", "--threads", "2", env=WORKER_ENV)
    wait_until(all_succeeded, 120, what="the sync jobs")
    assert_dry_lane_claimed_on_news_only(proc.output(), "async", figure)


def test_a_full_loop_does_not_claim_sync_jobs_after_every_async_job_that_ends(run_jobs, figure):
    """Async jobs on a loop of 2 slots, the threads idle: sync claims at most one per news
    or poll, not one per job (before: 493 in 23.7 s of 1,000 jobs, 45 after)."""
    for _ in range(JOBS):
        async_tasks.wait.enqueue(0)
    proc = run_jobs("--processes", "1", "--threads", "2", "--async-jobs", "2", env=WORKER_ENV)
    wait_until(all_succeeded, 120, what="the async jobs")
    assert_dry_lane_claimed_on_news_only(proc.output(), "sync", figure)


def test_a_dry_async_lane_is_claimed_again_at_the_next_poll_without_news(
    run_jobs, tmp_path, figure
):
    """The other side of the rule: a process whose one thread stays busy, which found its
    async lane dry and hears no news, still claims an async job made ready meanwhile, at a
    poll, on its event loop, while the thread is still held (no claim of either kind comes
    to take it: no thread frees up)."""
    gate = tmp_path / "release"
    held = lane_tasks.sync_hold.enqueue(str(gate), 120.0)
    proc = run_jobs("--processes", "1", "--threads", "1", env=NO_NEWS)
    try:
        wait_until(
            lambda: Job.objects.get(pk=held.id).status == JobStatus.RUNNING,
            60,
            what="the held sync job to start",
        )
        # Its one thread busy, the worker claims async jobs alone and finds none: the
        # lane is dry from here on, until a poll.
        wait_until(
            lambda: re.search(r"claimed 0 of \d+ \(async\)", proc.output()),
            60,
            what="an empty claim of async jobs",
        )
        echoed = lane_tasks.async_echo.enqueue("reached")
        began = time.monotonic()
        wait_until(
            lambda: Job.objects.get(pk=echoed.id).status == JobStatus.SUCCEEDED,
            60,
            what="the async job",
        )
        waited = time.monotonic() - began
        figure(f"async job behind a held thread, no news: done after {waited:.2f}s")
        assert Job.objects.get(pk=held.id).status == JobStatus.RUNNING  # still held
    finally:
        gate.touch()
    wait_until(lambda: Job.objects.get(pk=held.id).status == JobStatus.SUCCEEDED, 60)
    assert Job.objects.get(pk=held.id).return_value is True
