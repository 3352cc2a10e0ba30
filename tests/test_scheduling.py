"""Promoting due scheduled jobs, in-process, on the real database."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from django_jobs.core.claimed import finish_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import (
    BlockedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)
from tests import transition_tasks as tt
from tests.transition_tasks import DB, InThread

ALL = QueueSelector(("*",))


def later(seconds: float = 3600):
    return timezone.now() + timedelta(seconds=seconds)


def schedule(task, *args, priority: int = 0) -> int:
    """Enqueue with a future run_after: the job waits as scheduled."""
    return int(task.using(run_after=later(), priority=priority).enqueue(*args).id)


def make_due(*job_ids: int, ago: float = 1) -> None:
    ScheduledExecution.objects.filter(job_id__in=job_ids).update(
        scheduled_at=timezone.now() - timedelta(seconds=ago)
    )


def status(job_id: int) -> str:
    return Job.objects.get(pk=job_id).status


@pytest.mark.django_db
class TestPromote:
    def test_a_future_job_waits_as_scheduled(self):
        job_id = schedule(tt.noop)
        assert status(job_id) == JobStatus.SCHEDULED
        assert ScheduledExecution.objects.filter(job_id=job_id).exists()
        assert not ReadyExecution.objects.exists()
        assert promote_due_jobs(DB, 10) == 0
        assert status(job_id) == JobStatus.SCHEDULED

    def test_only_due_rows_move(self):
        due = [schedule(tt.noop) for _ in range(2)]
        future = schedule(tt.noop)
        make_due(*due)
        assert promote_due_jobs(DB, 10) == 2
        assert set(ReadyExecution.objects.values_list("job_id", flat=True)) == set(due)
        assert {status(job_id) for job_id in due} == {JobStatus.READY}
        assert list(ScheduledExecution.objects.values_list("job_id", flat=True)) == [future]
        assert status(future) == JobStatus.SCHEDULED
        assert promote_due_jobs(DB, 10) == 0

    def test_a_row_due_exactly_now_moves(self):
        job_id = schedule(tt.noop)
        ScheduledExecution.objects.update(scheduled_at=timezone.now())
        assert promote_due_jobs(DB, 10) == 1
        assert status(job_id) == JobStatus.READY

    def test_batches_of_batch_size_oldest_due_first(self):
        jobs = [schedule(tt.noop) for _ in range(5)]
        # Due times in reverse of creation: the last created is the most overdue.
        for n, job_id in enumerate(jobs):
            make_due(job_id, ago=100 - n)
        moved = []
        for expected in (2, 2, 1, 0):
            before = set(ReadyExecution.objects.values_list("job_id", flat=True))
            assert promote_due_jobs(DB, 2) == expected
            after = set(ReadyExecution.objects.values_list("job_id", flat=True))
            moved.append(sorted(after - before))
        assert moved == [sorted(jobs[:2]), sorted(jobs[2:4]), [jobs[4]], []]

    def test_promoted_jobs_keep_queue_and_priority(self, db):
        job_id = int(tt.noop.using(queue_name="emails", priority=7, run_after=later()).enqueue().id)
        make_due(job_id)
        promote_due_jobs(DB, 10)
        row = ReadyExecution.objects.get(job_id=job_id)
        assert (row.queue_name, row.priority) == ("emails", 7)
        worker = register_process(DB, "worker")
        assert [j.pk for j in claim_jobs(DB, worker.pk, QueueSelector(("emails",)), 5)] == [job_id]

    def test_keyed_jobs_are_admitted_through_the_semaphore(self):
        jobs = [schedule(tt.one_at_a_time, "x") for _ in range(3)]
        make_due(*jobs)
        assert promote_due_jobs(DB, 10) == 3
        assert list(ReadyExecution.objects.values_list("job_id", flat=True)) == [jobs[0]]
        assert set(BlockedExecution.objects.values_list("job_id", flat=True)) == set(jobs[1:])
        assert Semaphore.objects.get(key="one/x").value == 0

    def test_keyed_jobs_in_one_batch_get_the_slot_by_priority(self):
        low = schedule(tt.one_at_a_time, "x", priority=1)
        high = schedule(tt.one_at_a_time, "x", priority=9)
        make_due(low, high)
        promote_due_jobs(DB, 10)
        assert status(high) == JobStatus.READY and status(low) == JobStatus.BLOCKED

    def test_a_due_keyed_job_waits_behind_a_running_holder(self, db):
        worker = register_process(DB, "worker")
        holder = int(tt.one_at_a_time.enqueue("x").id)
        (job,) = claim_jobs(DB, worker.pk, ALL, 1)
        start_job(DB, job, worker.pk, worker.name)
        due = schedule(tt.one_at_a_time, "x")
        other_key = schedule(tt.one_at_a_time, "y")
        make_due(due, other_key)
        assert promote_due_jobs(DB, 10) == 2
        assert status(due) == JobStatus.BLOCKED
        assert status(other_key) == JobStatus.READY  # another key has its own slot
        assert finish_job(DB, holder, worker.pk, None)
        assert status(due) == JobStatus.READY

    def test_two_slots_admit_two(self):
        jobs = [schedule(tt.two_at_a_time, "x") for _ in range(3)]
        make_due(*jobs)
        promote_due_jobs(DB, 10)
        assert [status(j) for j in jobs] == [JobStatus.READY, JobStatus.READY, JobStatus.BLOCKED]


@pytest.mark.django_db(transaction=True)
def test_two_dispatchers_promote_each_due_row_once():
    """Two dispatchers on two connections share the due rows (SKIP LOCKED on
    PostgreSQL/MariaDB; serialised on SQLite); none is admitted twice."""
    jobs = [schedule(tt.noop) for _ in range(10)]
    keyed = [schedule(tt.one_at_a_time, "x") for _ in range(4)]
    make_due(*jobs, *keyed)
    barrier = threading.Barrier(2, timeout=20)

    def dispatch() -> int:
        barrier.wait()
        moved = 0
        while n := promote_due_jobs(DB, 3):
            moved += n
        return moved

    runners = [InThread(dispatch), InThread(dispatch)]
    assert sum(runner.join() for runner in runners) == 14
    assert not ScheduledExecution.objects.exists()
    assert ReadyExecution.objects.count() == 11  # 10 keyless + one holder of key one/x
    assert BlockedExecution.objects.count() == 3
    assert Semaphore.objects.get(key="one/x").value == 0
