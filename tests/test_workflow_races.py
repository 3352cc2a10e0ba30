"""Workflow races, forced with two real connections (the method of ``test_races``): each
test holds one transaction at the point the race is about, runs the other meanwhile, and
checks the outcome; its ``unprotected`` twin removes the one lock that decides, and shows
the bug that lock prevents.

PostgreSQL and MariaDB only: SQLite serialises whole write transactions.
"""

from __future__ import annotations

import logging
import threading

import pytest
from django.db import (
    OperationalError,
    connection,  # noqa: F401  (skipif reads it)
)

from django_jobs import enqueue_batch, workflow
from django_jobs.core import attempts, claimed, dependencies, dependency_graph, workflows
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.operator import cancel_job
from django_jobs.core.processes import register_process
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.workflows import cancel_workflow
from django_jobs.db import features
from django_jobs.exceptions import JobAlreadyFinished
from django_jobs.models import (
    FINISHED_STATUSES,
    AwaitingExecution,
    Job,
    JobStatus,
    ReadyExecution,
    Workflow,
)
from tests import workflow_tasks as wt
from tests.test_races import ALL, DB, Paused, Runner, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
    ),
]

BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def unlocked_awaiting(db, job_ids):
    """The twin of ``lock_awaiting``: the counts read with no lock (a stale read)."""
    return {
        row.job_id: row
        for row in AwaitingExecution.objects.using(db).filter(job_id__in=sorted(job_ids))
    }


def portable_settle(monkeypatch):
    """Settle through the ORM's statements even where the database has its one statement
    (PostgreSQL: ``Operations.settle_succeeded``)."""
    monkeypatch.setattr(features(DB), "can_settle_in_one_statement", False)


def unprotect_counts(monkeypatch):
    portable_settle(monkeypatch)
    monkeypatch.setattr(dependencies, "lock_awaiting", unlocked_awaiting)


def claimed_parents(worker, count: int):
    jobs = claim_jobs(DB, worker.pk, ALL, count, worker_id=worker.name)
    assert len(jobs) == count and all(job.status == JobStatus.RUNNING for job in jobs)
    return sorted(jobs, key=lambda job: job.pk)


def two_parents_of_one_child(policy: str = "cancel") -> int:
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b")
        m = wf.add(wt.merge, after=[a, b], on_dependency_failure=policy)
    assert AwaitingExecution.objects.get(job_id=int(m.id)).remaining == 2
    return int(m.id)


def end_both_at_once(monkeypatch, worker, *, first_fails: bool) -> None:
    first, second = claimed_parents(worker, 2)
    paused = Paused(monkeypatch, claimed, "settle_ended")
    if first_fails:
        one = Runner(lambda: fail_job(DB, first.pk, worker.pk, BOOM), paused)
    else:
        one = Runner(lambda: finish_job(DB, first.pk, worker.pk, "a"), paused)
    one.start()
    assert paused.reached.wait(10)  # the first parent settled its edge, not committed
    other = Runner(lambda: finish_job(DB, second.pk, worker.pk, "b"))
    other.start()
    wait_for(other.blocked_or_done, "the second parent's finish to block or end")
    paused.resume.set()
    assert one.finish() not in (None, False)
    assert other.finish() is True


# --- two parents of one child finishing at the same instant --------------------------


@pytest.mark.parametrize("path", ["one_statement", "portable"])
def test_two_parents_finishing_at_once_release_their_child_exactly_once(monkeypatch, worker, path):
    """The with_items fan-in of docs/design.md section 1. Protection: the child's awaiting
    row, locked by each parent's settle in its own finish (``lock_awaiting``; PostgreSQL's
    one statement locks it the same way and moves the count from its latest value)."""
    if path == "portable":
        portable_settle(monkeypatch)
    child = two_parents_of_one_child()
    end_both_at_once(monkeypatch, worker, first_fails=False)
    assert Job.objects.get(pk=child).status == JobStatus.READY
    assert ReadyExecution.objects.filter(job_id=child).count() == 1
    assert not AwaitingExecution.objects.filter(job_id=child).exists()


def test_unprotected_two_parents_finishing_at_once_strand_their_child(monkeypatch, worker):
    unprotect_counts(monkeypatch)
    child = two_parents_of_one_child()
    end_both_at_once(monkeypatch, worker, first_fails=False)
    # Both parents succeeded; each wrote "1 left" from a count read before the other's.
    assert Job.objects.filter(status=JobStatus.SUCCEEDED).count() == 2
    assert Job.objects.get(pk=child).status == JobStatus.AWAITING
    assert AwaitingExecution.objects.get(job_id=child).remaining == 1


# --- a parent failing while another succeeds ----------------------------------------------


def test_a_parent_failing_while_another_succeeds_ends_the_child_once(monkeypatch, worker):
    """Protection: the same lock. The failure (policy "cancel") ends the child; the success
    finds its awaiting row gone and changes nothing."""
    child = two_parents_of_one_child("cancel")
    end_both_at_once(monkeypatch, worker, first_fails=True)
    job = Job.objects.get(pk=child)
    assert job.status == JobStatus.FAILED and job.attempts == 0
    assert list(job.failures.values_list("exception_class_path", flat=True)) == [
        dependencies.DEPENDENCY_FAILED_ERROR
    ]
    assert not ReadyExecution.objects.filter(job_id=child).exists()


def test_with_run_anyway_the_child_is_released_once_after_both_end(monkeypatch, worker):
    child = two_parents_of_one_child("run")
    end_both_at_once(monkeypatch, worker, first_fails=True)
    assert Job.objects.get(pk=child).status == JobStatus.READY
    assert ReadyExecution.objects.filter(job_id=child).count() == 1


def test_unprotected_run_anyway_child_is_stranded(monkeypatch, worker):
    unprotect_counts(monkeypatch)
    child = two_parents_of_one_child("run")
    end_both_at_once(monkeypatch, worker, first_fails=True)
    assert Job.objects.get(pk=child).status == JobStatus.AWAITING


# --- a parent finishing while its child's workflow is cancelled ---------------------------


def race_finish_against_cancel(monkeypatch, worker) -> tuple[int, int]:
    """a's finish pauses after it released b (not committed); the workflow is cancelled
    meanwhile; then a commits."""
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
    (parent,) = claimed_parents(worker, 1)
    assert parent.pk == int(a.id)
    paused = Paused(monkeypatch, claimed, "settle_ended")
    finishing = Runner(lambda: finish_job(DB, parent.pk, worker.pk, "a"), paused)
    finishing.start()
    assert paused.reached.wait(10)
    cancelling = Runner(lambda: cancel_workflow(wf.result))
    cancelling.start()
    wait_for(cancelling.blocked_or_done, "the cancel to block or end")
    paused.resume.set()
    assert finishing.finish() is True
    cancelling.finish()
    return wf.result.id, int(b.id)


def test_a_parent_finishing_while_the_workflow_is_cancelled_leaves_nothing_to_run(
    monkeypatch, worker
):
    """Protection: the cancel ends each job it listed through ``cancel_job``, whose first
    write to the job's row waits for the release still in flight, and then acts on the
    state that release committed (b ready: its ready row deleted, b ended)."""
    workflow_id, child = race_finish_against_cancel(monkeypatch, worker)
    assert Workflow.objects.get(pk=workflow_id).ended_as == "cancelled"
    job = Job.objects.get(pk=child)
    assert job.status == JobStatus.FAILED and job.attempts == 0
    assert not ReadyExecution.objects.exists()


def test_unprotected_a_cancel_acting_on_a_stale_listing_leaves_a_job_to_run(monkeypatch, worker):
    def stale_cancel_rest(db, workflow_id):
        listed = list(
            Job.objects.using(db)
            .filter(workflow_id=workflow_id)
            .exclude(status__in=FINISHED_STATUSES)
            .order_by("pk")
            .values_list("pk", "status")
        )
        for job_id, status in listed:
            if status == JobStatus.AWAITING:  # ended by its awaiting row, as listed
                if AwaitingExecution.objects.using(db).filter(job_id=job_id).delete()[0]:
                    Job.objects.using(db).filter(pk=job_id).update(status=JobStatus.FAILED)
                continue
            try:
                cancel_job(db, job_id)
            except JobAlreadyFinished:
                continue
        return len(listed)

    monkeypatch.setattr(workflows, "cancel_rest", stale_cancel_rest)
    workflow_id, child = race_finish_against_cancel(monkeypatch, worker)
    assert Workflow.objects.get(pk=workflow_id).ended_as == "cancelled"
    # b was listed awaiting; its awaiting row was gone by the time the cancel got it
    # (the release had it locked), and b, released, is ready to run in a cancelled workflow.
    assert Job.objects.get(pk=child).status == JobStatus.READY
    assert ReadyExecution.objects.filter(job_id=child).exists()


# --- an enqueue waiting for a job that finishes at the same instant --------------------------


def race_enqueue_against_parent_finish(monkeypatch, worker, known: bool) -> int:
    """``using(after=[parent])`` pauses holding what it read of the running parent; the
    parent's finish runs meanwhile (with ``known``, as a worker's: its claim-time copy says
    "no workflow", which on PostgreSQL picks the one-statement finish)."""
    parent = wt.step.enqueue("parent")
    (job,) = claimed_parents(worker, 1)
    assert job.pk == int(parent.id) and job.workflow_id is None
    paused = Paused(monkeypatch, dependency_graph, "mark_parents")
    enqueueing = Runner(lambda: int(wt.merge.using(after=[parent]).enqueue().id), paused)
    enqueueing.start()
    assert paused.reached.wait(10)  # the edge is decided, nothing committed
    copies = [job] if known else []
    finishing = Runner(lambda: claimed.finish_jobs(DB, worker.pk, {job.pk: "p"}, copies))
    finishing.start()
    wait_for(finishing.blocked_or_done, "the parent's finish to block or end")
    paused.resume.set()
    child = enqueueing.finish()
    assert finishing.finish() == {job.pk}
    assert Job.objects.get(pk=job.pk).status == JobStatus.SUCCEEDED
    return child


@pytest.mark.parametrize("known", [True, False], ids=["worker_copy", "no_copy"])
def test_a_parent_finishing_as_a_job_starts_waiting_for_it_releases_that_job(
    monkeypatch, worker, known
):
    """Protection: the enqueue locks the parent's row and marks it with a workflow before
    writing the edge; the finish reads the mark under that lock (PostgreSQL's one-statement
    finish rechecks it as it updates the row, and leaves the job to the general path)."""
    child = race_enqueue_against_parent_finish(monkeypatch, worker, known)
    assert Job.objects.get(pk=child).status == JobStatus.READY
    assert not AwaitingExecution.objects.filter(job_id=child).exists()


def test_unprotected_an_unlocked_read_of_the_parent_strands_the_job(monkeypatch, worker):
    def unlocked_parents(db, ids, **_):
        rows = (
            Job.objects.using(db)
            .filter(pk__in=sorted(ids))
            .values_list("pk", "status", "workflow_id")
        )
        return {
            pk: dependency_graph.ParentRow(status, workflow_id) for pk, status, workflow_id in rows
        }

    monkeypatch.setattr(dependency_graph, "lock_parents", unlocked_parents)
    monkeypatch.setattr(dependency_graph, "mark_parents", lambda db, parents, workflow_id: None)
    child = race_enqueue_against_parent_finish(monkeypatch, worker, known=True)
    # The enqueue saw its parent running and counted it; the finish, which saw no edge,
    # released nothing: the job waits for a job that has ended.
    assert Job.objects.get(pk=child).status == JobStatus.AWAITING
    assert AwaitingExecution.objects.get(job_id=child).remaining == 1


# --- an enqueue waiting for a finish batch's job and for a dependent that batch releases ---


def enqueue_waiting_for(way: str, parents: list) -> int:
    """One job waiting for ``parents``, enqueued ``way``; its id."""
    if way == "using":
        return int(wt.merge.using(after=parents).enqueue().id)
    if way == "workflow":
        with workflow() as wf:
            node = wf.add(wt.merge, after=parents)
        return int(node.result.id)
    (result,) = enqueue_batch([(wt.merge.using(after=parents), (), {})]).results
    return int(result.id)


WAYS = ["using", "workflow", "enqueue_batch"]


def race_enqueue_against_a_finish_batch(
    monkeypatch, worker, way: str
) -> tuple[Runner, Runner, int, bool]:
    """A finish batch of G and F holds both job rows and pauses before it settles G's
    edges, which makes D (G's dependent, an id below F's) ready; meanwhile
    ``using(after=[D, F])`` locks its parents in ascending order: D, then F. Then the finish
    goes on; the enqueue is made ``way`` (each runs its tries, core.attempts). The runners
    (finished), D's id, and whether the enqueue met F's row held and paused (else it waited
    for the row)."""
    with workflow() as wf:
        g = wf.add(wt.step, "g")
        d = wf.add(wt.step, "d", after=[g])
    f = wt.step.enqueue("f")
    assert int(d.id) < int(f.id)
    first, second = claimed_parents(worker, 2)
    assert (first.pk, second.pk) == (int(g.id), int(f.id))
    paused = Paused(monkeypatch, claimed, "settle_ended", before=True)
    finishing = Runner(
        lambda: claimed.finish_jobs(DB, worker.pk, {first.pk: "g", second.pk: "f"}), paused
    )
    finishing.start()
    assert paused.reached.wait(10)  # G and F succeeded, rows held; D not yet released
    met_busy_parent = threading.Event()
    pause = attempts.pause_for_parents

    def noted_pause(seconds: float) -> None:
        met_busy_parent.set()
        pause(seconds)

    monkeypatch.setattr(attempts, "pause_for_parents", noted_pause)
    # However slow this machine, the enqueue never gives up and waits (a minute's patience).
    monkeypatch.setattr(attempts, "PARENTS_PATIENCE", 60.0)
    enqueueing = Runner(lambda: enqueue_waiting_for(way, [d, f]))
    enqueueing.start()
    wait_for(
        lambda: met_busy_parent.is_set() or enqueueing.blocked_or_done(),
        "the enqueue to meet F's row held",
    )
    paused.resume.set()
    finishing.join(20)
    enqueueing.join(20)
    return finishing, enqueueing, int(d.id), met_busy_parent.is_set()


@pytest.mark.parametrize("way", WAYS)
def test_an_enqueue_waits_for_no_parent_a_finish_batch_holds(monkeypatch, worker, caplog, way):
    """Protection: in its own transaction the enqueue locks its parents all at once or none
    (NOWAIT); finding F's row held, it rolls back, letting go of D, and runs again after a
    pause, while the finish releases D and commits. Nobody waits in a cycle: no deadlock."""
    with caplog.at_level(logging.INFO, logger="django_jobs"):
        finishing, enqueueing, dependent, met_busy = race_enqueue_against_a_finish_batch(
            monkeypatch, worker, way
        )
    assert met_busy
    assert finishing.finish() is not None and len(finishing.result) == 2
    child = enqueueing.finish()
    assert not [r for r in caplog.records if "deadlock" in r.getMessage()]
    assert Job.objects.get(pk=dependent).status == JobStatus.READY
    # F had succeeded when the enqueue ran again; D, ready, still counts.
    assert Job.objects.get(pk=child).status == JobStatus.AWAITING
    assert AwaitingExecution.objects.get(job_id=child).remaining == 1


@pytest.mark.parametrize("way", WAYS)
def test_unprotected_an_enqueue_waiting_for_its_parents_deadlocks_with_a_finish_batch(
    monkeypatch, worker, caplog, way
):
    """The twin: parents locked one after another, waiting for each (as inside a caller's
    transaction). The enqueue holds D and waits for F; the finish holds F and wants D: the
    database breaks the cycle by failing one of them (an enqueue it fails is retried)."""
    waiting = dependency_graph.lock_parents
    monkeypatch.setattr(
        dependency_graph, "lock_parents", lambda db, ids, wait=True: waiting(db, ids)
    )
    with caplog.at_level(logging.INFO, logger="django_jobs"):
        finishing, enqueueing, _, met_busy = race_enqueue_against_a_finish_batch(
            monkeypatch, worker, way
        )
    assert not met_busy
    enqueue_retried = any("deadlock victim" in r.getMessage() for r in caplog.records)
    finish_failed = (
        isinstance(finishing.error, OperationalError) and "deadlock" in str(finishing.error).lower()
    )
    assert enqueue_retried or finish_failed, (finishing.error, enqueueing.error)
