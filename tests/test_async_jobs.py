"""Everything a job can do, done by ``async def`` jobs on the worker's event loop (issue 39,
item 2), each through a real ``run_jobs`` process on the test database.

Every body reports the thread it ran in: ``django-jobs-async``, the event loop's
(``runtime/async_lane.py``), never a worker thread (``async_to_sync``, the path with
``--async-jobs 0``). What a job did is read from what it wrote itself (the demo app's
``AuditEvent`` rows, through the async ORM) as well as from the queue's rows. Crash
recovery, shutdown, connections, a blocked loop and bad input are in
tests/test_async_runtime.py.
"""

from __future__ import annotations

import signal
import time

import pytest
from django.tasks import TaskResultStatus

from django_jobs import cancel, enqueue_batch, workflow
from django_jobs.models import (
    Batch,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Process,
)
from testproject.demo.models import AuditEvent
from tests import async_job_tasks as at
from tests.async_job_tasks import LOOP_THREAD
from tests.harness import error_paths, job_row, max_overlap, most_in_any_period, wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

WORKER = ("--processes", "1", "--threads", "2")
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED}
CANCELLED = "django_jobs.exceptions.JobCancelled"
TIMEOUT = "django_jobs.exceptions.JobTimeout"


def pks(results) -> list[int]:
    return [int(result.id) for result in results]


def settled(ids: list[int], timeout: float = 30.0) -> dict[int, Job]:
    """Wait until every job of ``ids`` has ended; their rows."""

    def ended() -> dict[int, Job] | None:
        jobs = {job.pk: job for job in Job.objects.filter(pk__in=ids)}
        done = len(jobs) == len(ids) and all(job.status in TERMINAL for job in jobs.values())
        return jobs if done else None

    return wait_until(ended, timeout, what=f"jobs {ids[:10]}... to end")


def audits(result_or_id, key: str | None = None) -> list[AuditEvent]:
    rows = AuditEvent.objects.filter(job_id=int(getattr(result_or_id, "id", result_or_id)))
    if key is not None:
        rows = rows.filter(key=key)
    return list(rows.order_by("attempt", "pk"))


def running(result) -> AuditEvent:
    """Its body has begun (it audited its start)."""
    return wait_until(lambda: next(iter(audits(result)), None), 30, what=f"{result.id} started")


def stop(proc) -> None:
    """A graceful stop that leaves nothing claimed and no process row."""
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


# --- results, dependencies --------------------------------------------------------------------


def test_values_and_dependency_results_come_back_from_bodies_on_the_loop(run_jobs):
    plain = at.doubled.enqueue(21)
    with workflow("async results") as wf:
        a = wf.add(at.doubled, 1)
        b = wf.add(at.doubled, 2)
        merged = wf.add(at.collects, after=[b, a])
    proc = run_jobs(*WORKER)
    settled(pks([plain, a.result, b.result, merged.result]))

    plain.refresh()
    assert plain.status == TaskResultStatus.SUCCESSFUL
    assert plain.return_value == {"value": 42, "thread": LOOP_THREAD, "attempt": 1}
    value = job_row(merged.result).return_value
    # In its after= order, read through sync_to_async on the job's ORM thread.
    assert value == {
        "values": [
            {"value": 4, "thread": LOOP_THREAD, "attempt": 1},
            {"value": 2, "thread": LOOP_THREAD, "attempt": 1},
        ],
        "thread": LOOP_THREAD,
    }
    assert wf.result.status == "succeeded"
    stop(proc)


def test_dependency_results_called_on_the_loop_fails_that_job_naming_the_fix(run_jobs):
    """A synchronous query from the loop is Django's SynchronousOnlyOperation: that job
    fails with it (the docs' rule: ``await sync_to_async(dependency_results)()``); the
    node after it follows its on_dependency_failure="run" and sees the failure."""
    with workflow() as wf:
        first = wf.add(at.step, "first")
        wrong = wf.add(at.collects_on_the_loop, after=[first])
        after = wf.add(at.sees_statuses, after=[wrong])
    proc = run_jobs(*WORKER)
    jobs = settled(pks([first.result, wrong.result, after.result]))
    assert jobs[int(wrong.result.id)].status == JobStatus.FAILED
    assert error_paths(wrong.result) == ["django.core.exceptions.SynchronousOnlyOperation"]
    assert "async context" in FailedExecution.objects.get(job_id=int(wrong.result.id)).message
    assert jobs[int(after.result.id)].return_value == {
        "statuses": ["FAILED"],
        "thread": LOOP_THREAD,
    }
    stop(proc)


# --- exceptions, retries, snoozes, progress ---------------------------------------------------


def test_exceptions_are_retried_after_their_backoff_until_attempts_run_out(run_jobs):
    """Exponential(base=0.5, factor=2, jitter=0): the 2nd attempt starts >= 0.5 s after the
    1st failed, the 3rd >= 1 s after the 2nd. One job succeeds at its 3rd attempt, one
    never does (max_attempts=3): three ValueErrors recorded, FAILED."""
    recovers = at.fails_until.enqueue(succeed_at=3)
    never = at.fails_until.enqueue(succeed_at=9)
    proc = run_jobs(*WORKER)
    jobs = settled(pks([recovers, never]))

    assert (jobs[int(recovers.id)].status, jobs[int(recovers.id)].attempts) == (
        JobStatus.SUCCEEDED,
        3,
    )
    assert jobs[int(recovers.id)].return_value == {"attempt": 3, "thread": LOOP_THREAD}
    assert error_paths(recovers) == ["builtins.ValueError"] * 2
    assert (jobs[int(never.id)].status, jobs[int(never.id)].attempts) == (JobStatus.FAILED, 3)
    failures = FailedExecution.objects.filter(job_id=int(never.id)).order_by("attempt")
    assert [f.message for f in failures] == [f"async attempt {n} failed" for n in (1, 2, 3)]
    for result in (recovers, never):
        runs = audits(result)
        assert [run.attempt for run in runs] == [1, 2, 3]
        for before, after, delay in zip(runs, runs[1:], (0.5, 1.0), strict=False):
            assert before.ended is not None
            assert after.started - before.ended >= delay, (before, after, delay)
    stop(proc)


def test_a_snooze_runs_the_job_again_later_without_using_an_attempt(run_jobs):
    result = at.snoozes_first.enqueue(1.0)
    proc = run_jobs(*WORKER)
    job = settled(pks([result]))[int(result.id)]
    # max_attempts=1, and yet a second start: the snooze raised the ceiling with the count.
    assert (job.status, job.attempts, job.max_attempts) == (JobStatus.SUCCEEDED, 2, 2)
    assert job.return_value == {"attempt": 2, "thread": LOOP_THREAD}
    first, second = audits(result)
    assert second.started - first.started >= 1.0
    assert error_paths(result) == []
    proc.wait_for_output(f"job snoozed task=tests.async_job_tasks.snoozes_first job={result.id}")
    stop(proc)


def test_progress_set_on_the_loop_is_written_while_the_job_runs_and_at_its_end(run_jobs, tmp_path):
    flag = tmp_path / "go"
    result = at.reports_progress.enqueue(str(flag))
    proc = run_jobs(*WORKER)
    job = wait_until(
        lambda: (row := job_row(result)).progress_message and row,
        20,
        what="the first progress written",
    )
    assert job.status == JobStatus.RUNNING
    assert (job.progress_done, job.progress_total) == (1, 2)
    assert job.progress_message == f"half, on {LOOP_THREAD}"
    flag.touch()
    job = settled(pks([result]))[int(result.id)]
    assert job.status == JobStatus.SUCCEEDED and job.return_value == "reported"
    assert (job.progress_done, job.progress_total, job.progress_message) == (2, 2, "done")
    stop(proc)


# --- cancel and timeout: one asyncio task cancelled, its siblings untouched -------------------


def test_cancel_of_a_running_async_job_cancels_its_task_only(run_jobs, tmp_path):
    """30 siblings wait on the same loop; cancel() of one job ends it at once (its
    CancelledError handler runs), recorded JobCancelled and not retried (max_attempts=3).
    The siblings run on, and succeed when told to."""
    flag = tmp_path / "go"
    siblings = [at.waits_for.enqueue(str(flag)) for _ in range(30)]
    victim = at.sleeps.enqueue(60)
    proc = run_jobs(*WORKER, env={"JOBS_INTERRUPT_GRACE": "10"})
    wait_until(lambda: AuditEvent.objects.count() == 31, 30, what="all 31 bodies started")
    began = time.monotonic()
    assert cancel(victim.id) == "requested"
    job = settled(pks([victim]))[int(victim.id)]
    took = time.monotonic() - began
    assert took < 5.0, f"{took:.2f}s from cancel() to the recorded end"
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
    assert error_paths(victim) == [CANCELLED]
    message = FailedExecution.objects.get(job_id=job.pk).message
    assert message.startswith("cancelled (ran ") and "it raised CancelledError" in message
    (run,) = audits(victim)
    assert run.ended is not None, "its except CancelledError did not run"
    assert Job.objects.filter(pk__in=pks(siblings), status=JobStatus.RUNNING).count() == 30
    flag.touch()
    jobs = settled(pks(siblings))
    assert {job.status for job in jobs.values()} == {JobStatus.SUCCEEDED}
    assert {job.return_value for job in jobs.values()} == {LOOP_THREAD}
    proc.wait_for_output(f"job {victim.id} cancelled: cancelling its asyncio task")
    stop(proc)


def test_a_timeout_cancels_each_attempt_at_its_deadline_and_retries(run_jobs, tmp_path):
    """timeout=1, max_attempts=2: each attempt's await ends at about 1 s (not after the
    10 s grace), recorded JobTimeout; a sibling on the loop is untouched."""
    flag = tmp_path / "go"
    sibling = at.waits_for.enqueue(str(flag))
    result = at.past_its_timeout.enqueue()
    proc = run_jobs(*WORKER, env={"JOBS_INTERRUPT_GRACE": "10"})
    job = settled(pks([result]), 40)[int(result.id)]
    assert (job.status, job.attempts) == (JobStatus.FAILED, 2)
    assert error_paths(result) == [TIMEOUT, TIMEOUT]
    for run in audits(result, "timeout"):
        # The second counts from the attempt's start, before the body's first await wrote
        # its stamp (a trip to the ORM thread); 5 s is well short of the 10 s grace.
        assert run.ended is not None
        assert 0.5 < run.ended - run.started < 5.0, run.ended - run.started
    for failure in FailedExecution.objects.filter(job_id=job.pk):
        assert "timed out: still running after its timeout of 1s" in failure.message
    assert job_row(sibling).status == JobStatus.RUNNING
    flag.touch()
    assert settled(pks([sibling]))[int(sibling.id)].return_value == LOOP_THREAD
    stop(proc)


# --- concurrency keys, rate limits, unique jobs -----------------------------------------------


def test_concurrency_limits_hold_for_bodies_on_the_loops_of_two_processes(run_jobs):
    """Two processes whose loops could run every job at once: a limit-1 key never has two
    bodies overlapping (from the bodies' own start and end stamps), a limit-3 key never
    more than three, and it does reach three (the limit, not the lane, is what holds)."""
    one = [at.keyed_one.enqueue("a", 0.03) for _ in range(25)]
    three = [at.keyed_three.enqueue("b", 0.1) for _ in range(24)]
    proc = run_jobs("--processes", "2", "--threads", "2")
    jobs = settled(pks(one + three), 60)
    assert {job.status for job in jobs.values()} == {JobStatus.SUCCEEDED}
    assert {job.return_value for job in jobs.values()} == {LOOP_THREAD}

    def intervals(key: str) -> list[tuple[float, float]]:
        rows = AuditEvent.objects.filter(key=key)
        return [(row.started, row.ended) for row in rows]

    assert len(intervals("one:a")) == 25 and len(intervals("three:b")) == 24
    assert max_overlap(intervals("one:a")) == 1
    assert max_overlap(intervals("three:b")) == 3
    stop(proc)


def test_a_rate_limit_holds_for_async_jobs(run_jobs):
    """5/s per account: 15 jobs of one account start no more than 5 in any second, wherever
    the second begins (the starts the worker recorded as it decided the rate), each body
    after its recorded start, every job once, no attempt wasted."""
    results = [at.rated.enqueue("acct") for _ in range(15)]
    proc = run_jobs(*WORKER, env={"JOBS_DISPATCHER_INTERVAL": "0.2"})
    jobs = settled(pks(results), 40)
    assert {(job.status, job.attempts) for job in jobs.values()} == {(JobStatus.SUCCEEDED, 1)}
    recorded = [job.last_attempted_at.timestamp() for job in jobs.values()]
    assert most_in_any_period(recorded, 1.0) == 5
    bodies = dict(AuditEvent.objects.filter(key="rate:acct").values_list("job_id", "started"))
    assert bodies.keys() == jobs.keys()
    for job in jobs.values():
        assert bodies[job.pk] >= job.last_attempted_at.timestamp()
    stop(proc)


def test_a_unique_async_job_runs_once_and_lets_its_key_go_at_its_end(run_jobs, tmp_path):
    flag = tmp_path / "go"
    first = at.unique_report.enqueue(7, str(flag))
    assert at.unique_report.enqueue(7, str(flag)).id == first.id  # waiting: covered
    proc = run_jobs(*WORKER)
    running(first)
    assert at.unique_report.enqueue(7, str(flag)).id == first.id  # running: covered
    flag.touch()
    settled(pks([first]))
    again = at.unique_report.enqueue(7, str(flag))
    assert again.id != first.id
    settled(pks([again]))
    assert [row.job_id for row in AuditEvent.objects.order_by("pk")] == [
        int(first.id),
        int(again.id),
    ]
    assert {job_row(r).return_value for r in (first, again)} == {LOOP_THREAD}
    stop(proc)


# --- batches, workflows, enqueue on commit ----------------------------------------------------


def test_a_batch_of_async_items_fires_each_callback_once_and_nests(run_jobs):
    """40 async items (4 fail); the on_finish callback, async, enqueues a child batch
    through sync_to_async, which nests under it (the running job's id crosses into the
    ORM thread); the child's own async callback runs."""
    made = enqueue_batch(
        [(at.item, [n], {"fail": n % 10 == 0}) for n in range(40)],
        on_finish=at.next_stage,
        on_failure=at.batch_done,
        description="async parent",
    )
    proc = run_jobs(*WORKER)

    def child_done():
        child = Batch.objects.filter(description="async child").first()
        callback = child and child.callback_jobs.get("on_finish")
        return callback and Job.objects.filter(pk=callback, status=JobStatus.SUCCEEDED).exists()

    wait_until(child_done, 40, what="the child batch's callback to succeed")
    parent = Batch.objects.get(pk=made.id)
    assert (parent.pending, parent.succeeded, parent.failed) == (0, 36, 4)
    stage = Job.objects.get(pk=parent.callback_jobs["on_finish"])
    failure_callback = Job.objects.get(pk=parent.callback_jobs["on_failure"])
    assert Job.objects.filter(task_path="tests.async_job_tasks.next_stage").count() == 1
    child = Batch.objects.get(description="async child")
    assert (child.parent_job_id, stage.return_value) == (stage.pk, child.id)
    assert (child.pending, child.succeeded, child.failed) == (0, 3, 0)
    settled([failure_callback.pk, child.callback_jobs["on_finish"]])
    assert job_row(failure_callback.pk).return_value == {
        "batch_id": parent.pk,
        "succeeded": 36,
        "failed": 4,
        "thread": LOOP_THREAD,
    }
    assert job_row(child.callback_jobs["on_finish"]).return_value == {
        "batch_id": child.pk,
        "succeeded": 3,
        "failed": 0,
        "thread": LOOP_THREAD,
    }
    items = Job.objects.filter(batch_id=parent.pk, status=JobStatus.SUCCEEDED)
    assert {job.return_value["thread"] for job in items} == {LOOP_THREAD}
    stop(proc)


def test_workflow_nodes_run_on_the_loop_in_order_and_a_failure_follows_its_policy(run_jobs):
    """A diamond of async nodes, and a failing node whose dependent is cancelled and
    whose "run" dependent runs anyway."""
    with workflow("async diamond") as diamond:
        top = diamond.add(at.step, "top")
        left = diamond.add(at.step, "left", after=[top])
        right = diamond.add(at.step, "right", after=[top])
        bottom = diamond.add(at.collects, after=[left, right])
    with workflow("async failure") as failing:
        bad = failing.add(at.step, "bad", fail=True)
        skipped = failing.add(at.step, "skipped", after=[bad])
        cleanup = failing.add(at.sees_statuses, after=[bad])
    proc = run_jobs(*WORKER)
    nodes = [top, left, right, bottom, bad, skipped, cleanup]
    jobs = settled(pks(node.result for node in nodes))
    assert job_row(bottom.result).return_value == {
        "values": ["left", "right"],
        "thread": LOOP_THREAD,
    }
    starts = {node: job_row(node.result).started_at for node in (top, left, right, bottom)}
    assert starts[top] < min(starts[left], starts[right])
    assert max(starts[left], starts[right]) < starts[bottom]
    assert diamond.result.status == "succeeded"
    assert jobs[int(skipped.result.id)].attempts == 0
    assert jobs[int(skipped.result.id)].status == JobStatus.FAILED
    assert job_row(cleanup.result).return_value == {"statuses": ["FAILED"], "thread": LOOP_THREAD}
    assert failing.result.status == "failed"
    stop(proc)


def test_enqueue_on_commit_inside_an_async_job_follows_its_transaction(run_jobs):
    """Through sync_to_async, on the job's ORM thread: the committed transaction's job is
    enqueued and reads the row it needs; the rolled-back one's never exists."""
    committed = at.enqueues_on_commit.enqueue("kept", True)
    rolled_back = at.enqueues_on_commit.enqueue("dropped", False)
    proc = run_jobs(*WORKER)
    settled(pks([committed, rolled_back]))
    (child,) = wait_until(
        lambda: list(Job.objects.filter(task_path="tests.async_job_tasks.reads_its_row")),
        what="the committed transaction's job",
    )
    assert child.args == ["kept"]
    job = settled([child.pk])[child.pk]
    assert job.return_value == {"row": "commit:kept", "thread": LOOP_THREAD}
    assert not AuditEvent.objects.filter(key="commit:dropped").exists()
    assert Job.objects.filter(task_path="tests.async_job_tasks.reads_its_row").count() == 1
    assert {job_row(r).return_value for r in (committed, rolled_back)} == {LOOP_THREAD}
    stop(proc)


# --- --async-jobs 0: the threads run async bodies, as before the loop -----------------------------


def test_with_no_async_slots_async_bodies_run_on_the_threads_and_still_cancel(run_jobs):
    """``--async-jobs 0``: no event loop in the process; each async body runs on a worker
    thread through async_to_sync (its own short-lived loop), its value comes back, and a
    cancel() still ends it through asyncio at once."""
    plain = at.doubled.enqueue(5)
    victim = at.sleeps.enqueue(60)
    proc = run_jobs(*WORKER, "--async-jobs", "0", env={"JOBS_INTERRUPT_GRACE": "10"})
    running(victim)
    assert cancel(victim.id) == "requested"
    jobs = settled(pks([plain, victim]))
    value = jobs[int(plain.id)].return_value
    # async_to_sync's own thread, not the lane's loop.
    assert value["value"] == 10 and not value["thread"].startswith("django-jobs-async")
    assert (jobs[int(victim.id)].status, error_paths(victim)) == (JobStatus.FAILED, [CANCELLED])
    proc.wait_for_output(f"job {victim.id} cancelled: cancelling its asyncio task")
    stop(proc)
