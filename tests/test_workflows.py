"""Workflows: a job waits for others and runs once, only after all of them succeeded; the
policies when one fails; what the enqueue refuses; retry, cancel, keys, batches, unique jobs.

Each job is run as a worker would (claim, start, body, finish or fail) through the state
machine's own functions, one at a time, so every step can be checked in between; where a
test needs no check between two jobs, ``run_enqueued_jobs()`` runs them (django_jobs.testing,
the same functions, and the follow-ups each commit would run). The
races are tests/test_workflow_races.py; real processes, tests/test_workflow_stress.py.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.tasks import TaskResultStatus
from hypothesis import given, settings
from hypothesis import strategies as st

import django_jobs
from django_jobs import workflow
from django_jobs.core import operator
from django_jobs.core.batches import current_job_id
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.dependencies import DEPENDENCY_FAILED_ERROR, settle_stranded
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.workflows import get_workflow, sweep_workflows
from django_jobs.exceptions import InvalidDependency
from django_jobs.models import (
    AwaitingExecution,
    Batch,
    Job,
    JobDependency,
    JobStatus,
    ReadyExecution,
    ScheduledExecution,
    Workflow,
)
from django_jobs.testing import run_enqueued_jobs
from tests import workflow_tasks as wt
from tests.harness import error_paths, job_row

pytestmark = pytest.mark.django_db

DB = "default"
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


@pytest.fixture
def worker():
    return register_process(DB, "worker")


@pytest.fixture
def commits(django_capture_on_commit_callbacks):
    """Run what each transaction leaves for after its commit (the follow-ups), as a real
    commit would: a test's transaction never commits."""

    def capture():
        return django_capture_on_commit_callbacks(execute=True)

    return capture


def pk(result) -> int:
    return int(result.id)


def status(result) -> str:
    return Job.objects.get(pk=pk(result)).status


def run(worker, result, *, fail: bool = False, commits=None):
    """Claim this job alone, run its body as its worker would, record the outcome."""
    job_id = pk(result)
    assert ReadyExecution.objects.filter(job_id=job_id).exists(), f"#{job_id} is not ready"
    ReadyExecution.objects.exclude(job_id=job_id).update(queue_name="parked")
    try:
        (job,) = claim_jobs(DB, worker.pk, QueueSelector(("default",)), 1, worker_id=worker.name)
    finally:
        ReadyExecution.objects.filter(queue_name="parked").update(queue_name="default")
    assert job.pk == job_id and job.status == JobStatus.RUNNING
    if fail:
        outcome = (lambda: fail_job(DB, job_id, worker.pk, BOOM), None)
    else:
        from django_jobs.tasks.loading import load_task

        token = current_job_id.set(job_id)
        try:
            value = load_task(job.task_path).func(*job.args, **job.kwargs)
        finally:
            current_job_id.reset(token)
        outcome = (lambda: finish_job(DB, job_id, worker.pk, value), value)
    if commits is None:
        return outcome[0]()
    with commits():
        return outcome[0]()


def test_a_chain_runs_in_order_each_step_only_after_the_one_before(worker):
    with workflow("three steps") as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.step, "c", after=[b])
    assert [status(n.result) for n in (a, b, c)] == ["ready", "awaiting", "awaiting"]
    assert AwaitingExecution.objects.get(job_id=pk(b.result)).remaining == 1
    assert wf.result.status == "running"
    run(worker, a.result)
    assert [status(n.result) for n in (b, c)] == ["ready", "awaiting"]
    run(worker, b.result)
    run(worker, c.result)
    assert wf.result.status == "succeeded"
    assert not AwaitingExecution.objects.exists()
    assert JobDependency.objects.filter(settled=False).count() == 0
    assert {job.workflow_id for job in Job.objects.all()} == {wf.result.id}


def test_a_fan_in_waits_for_every_parent_and_reads_their_values_in_after_order(worker):
    with workflow() as wf:
        x = wf.add(wt.step, "x")
        y = wf.add(wt.step, "y")
        m = wf.add(wt.merge, after=[y, x])
    run(worker, x.result)
    assert status(m.result) == "awaiting"
    assert AwaitingExecution.objects.get(job_id=pk(m.result)).remaining == 1
    run(worker, y.result)
    assert status(m.result) == "ready"
    assert run(worker, m.result)
    assert job_row(m.result).return_value == ["y", "x"]


def test_chain_shorthand_and_a_result_per_node(worker):
    made = django_jobs.chain(wt.merge.using(priority=1), (wt.step, ["two"], {}), name="c")
    assert len(made.results) == 2 and made.name == "c"
    assert made.results[0].task.priority == 1
    assert status(made.results[1]) == "awaiting"
    assert get_workflow(made.id).results[1].id == made.results[1].id


def test_a_failed_dependency_cancels_its_dependents_and_theirs_after_the_commit():
    with workflow() as wf:
        a = wf.add(wt.step, "a", fail=True)
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.step, "c", after=[b])
        d = wf.add(wt.cleanup, after=[c])  # declared on_dependency_failure="run"
    # a alone, its follow-ups run as its commit would run them.
    assert run_enqueued_jobs(limit=1).outcomes == ["failed"]
    for node in (b, c):
        row = job_row(node.result)
        assert row.status == JobStatus.FAILED and row.attempts == 0
        assert error_paths(node.result) == [DEPENDENCY_FAILED_ERROR]
    assert "dependency #" in job_row(b.result).failures.get().message
    # "run": it goes on once its dependency has ended, failed or not.
    assert status(d.result) == "ready"
    assert wf.result.status == "running"
    assert run_enqueued_jobs().return_values() == [["FAILED"]]
    assert wf.result.status == "failed"


def test_run_anyway_counts_a_failed_dependency_as_ended(worker):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b")
        m = wf.add(wt.merge, after=[a, b], on_dependency_failure="run")
    run(worker, a.result, fail=True)
    assert status(m.result) == "awaiting"
    run(worker, b.result)
    assert status(m.result) == "ready"


def test_fail_policy_fails_the_whole_workflow_and_cancels_the_rest():
    with workflow() as wf:
        a = wf.add(wt.step, "a", fail=True)
        other = wf.add(wt.step, "other")
        later = wf.add(wt.step, "later", after=[other])
        wf.add(wt.step, "b", after=[a], on_dependency_failure="fail")
    # a alone (claimed first: the oldest), its follow-up (the cancel of the rest) with it.
    assert run_enqueued_jobs(limit=1).outcomes == ["failed"]
    assert Workflow.objects.get(pk=wf.result.id).ended_as == "failed"
    assert status(other.result) == "failed" and status(later.result) == "failed"
    assert "django_jobs.exceptions.JobCancelled" in error_paths(other.result)
    assert wf.result.status == "failed"
    assert not ReadyExecution.objects.exists() and not AwaitingExecution.objects.exists()


def test_retrying_the_failed_dependency_brings_its_dependents_back(worker, commits):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.step, "c", after=[b])
    run(worker, a.result, fail=True, commits=commits)
    assert status(c.result) == "failed"
    # A dependent cannot be retried on its own while what it waits for has failed.
    assert not operator.retry_failed_job(DB, pk(b.result))
    assert operator.retry_failed_job(DB, pk(a.result))
    assert [status(n.result) for n in (a, b, c)] == ["ready", "awaiting", "awaiting"]
    assert AwaitingExecution.objects.get(job_id=pk(c.result)).remaining == 1
    report = run_enqueued_jobs()
    assert [run.job_id for run in report] == [pk(a.result), pk(b.result), pk(c.result)]
    assert wf.result.status == "succeeded"
    assert job_row(c.result).attempts == 1


def test_after_waits_for_jobs_enqueued_before_and_counts_a_success_at_once(worker):
    first = wt.step.enqueue("first")
    done = wt.step.enqueue("done")
    run(worker, done)
    later = wt.merge.using(after=[first, done]).enqueue()
    assert status(later) == "awaiting"
    assert AwaitingExecution.objects.get(job_id=pk(later)).remaining == 1
    # The job it waits for joined a workflow, the mark its finish reads.
    workflow_id = job_row(later).workflow_id
    assert workflow_id is not None and job_row(first).workflow_id == workflow_id
    assert job_row(done).workflow_id is None  # ended already: nothing to release
    run(worker, first)
    assert status(later) == "ready"
    run(worker, later)
    assert job_row(later).return_value == ["first", "done"]


def test_after_a_job_that_failed_already_meets_the_policy_at_once(worker):
    failed = wt.step.enqueue("x")
    run(worker, failed, fail=True)
    cancelled = wt.step.using(after=[failed]).enqueue("y")
    assert status(cancelled) == "failed"
    assert error_paths(cancelled) == [DEPENDENCY_FAILED_ERROR]
    anyway = wt.cleanup.using(after=[failed]).enqueue()
    assert status(anyway) == "ready"


def test_the_enqueue_refuses_an_unknown_job_a_cycle_and_writes_nothing(worker):
    with pytest.raises(InvalidDependency, match="does not exist"):
        wt.step.using(after=[987654321]).enqueue("x")
    with pytest.raises(InvalidDependency, match="cycle"):
        with workflow() as wf:
            a = wf.add(wt.step, "a")
            b = wf.add(wt.step, "b", after=[a])
            a.after(b)
    with pytest.raises(InvalidDependency, match="not a job id"):
        wt.step.using(after=["nope"])
    assert not Job.objects.exists() and not Workflow.objects.exists()


@pytest.fixture
def second_backend(settings):
    """A second django-jobs backend, ``other``, on the database alias given."""
    from django.tasks import task_backends

    def make(database: str) -> None:
        settings.TASKS = {
            **settings.TASKS,
            "other": {
                "BACKEND": "django_jobs.backend.JobsBackend",
                "OPTIONS": {"database": database},
            },
        }
        task_backends._settings = None

    yield make
    task_backends._settings = None


def test_a_dependency_in_another_database_is_refused(worker, second_backend):
    from django_jobs.tasks.job_task import Dependency

    second_backend("listen_elsewhere")
    with pytest.raises(InvalidDependency, match="own database"):
        wt.step.using(after=[Dependency("other", 1)]).enqueue("x")


def test_cancel_workflow_ends_waiting_and_awaiting_jobs_and_releases_nothing(worker, commits):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.cleanup, after=[a])  # would run anyway after a failure
    with commits():
        assert django_jobs.cancel_workflow(wf.result) == 2
    assert status(a.result) == "failed" and status(b.result) == "failed"
    assert wf.result.status == "cancelled"
    assert not ReadyExecution.objects.exists() and not AwaitingExecution.objects.exists()
    assert django_jobs.cancel_workflow(wf.result.id) == 0


def test_a_released_dependent_with_a_key_is_admitted_through_its_key_after_the_commit(
    worker, commits
):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        k = wf.add(wt.keyed, "k", after=[a])
        root = wf.add(wt.keyed, "root")
    # A keyed job of a graph goes in scheduled, due now, and is admitted after the commit.
    assert status(root.result) == "scheduled"
    assert ScheduledExecution.objects.filter(job_id=pk(root.result)).exists()
    run(worker, a.result, commits=commits)
    assert status(k.result) in {"scheduled", "blocked", "ready"}
    from django_jobs.core.scheduling import promote_jobs

    promote_jobs(DB, [pk(root.result), pk(k.result)])
    # One slot: one of them ready, the other blocked behind it.
    assert sorted([status(root.result), status(k.result)]) == ["blocked", "ready"]


def test_a_batch_is_a_node_what_waits_for_it_waits_for_every_item(worker):
    with workflow() as wf:
        first = wf.add(wt.step, "first")
        batch = wf.add_batch(
            [(wt.step, ["i1"], {}), (wt.step, ["i2"], {})], after=[first], description="items"
        )
        last = wf.add(wt.merge, after=[batch])
    assert [status(r) for r in batch.results] == ["awaiting", "awaiting"]
    assert Batch.objects.get(pk=batch.batch_id).total == 2
    report = run_enqueued_jobs()
    items = {pk(result) for result in batch.results}
    assert report[0].job_id == pk(first.result)
    assert {run.job_id for run in report[1:3]} == items
    assert report[3].job_id == pk(last.result) and len(report) == 4
    assert Batch.objects.get(pk=batch.batch_id).finished_at is not None
    assert job_row(last.result).return_value == ["i1", "i2"]


def test_a_unique_node_whose_key_is_held_is_the_holder(worker):
    holder = wt.unique.enqueue("u")
    with workflow() as wf:
        u = wf.add(wt.unique, "u")
        after = wf.add(wt.merge, after=[u])
    assert u.result.id == holder.id
    assert status(after.result) == "awaiting"
    assert job_row(holder).workflow_id == wf.result.id
    run(worker, holder)
    assert status(after.result) == "ready"


def test_an_ended_job_whose_follow_up_was_lost_is_settled_by_the_sweep(worker):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.step, "c", after=[b])
    run(worker, a.result, fail=True)  # its follow-up never runs: the test never commits
    assert status(b.result) == "failed" and status(c.result) == "awaiting"
    assert settle_stranded(DB) == 1
    assert status(c.result) == "failed"
    assert sweep_workflows(DB) == 0


def test_a_task_result_reports_an_awaiting_job_as_ready(worker):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
    assert b.result.status == TaskResultStatus.READY
    assert wt.step.get_backend().get_result(b.result.id).status == TaskResultStatus.READY
    assert connection.alias == DB


def test_options_are_checked_where_they_are_written():
    from django.tasks.exceptions import InvalidTask

    with pytest.raises(InvalidTask, match="on_dependency_failure must be one of"):
        django_jobs.task(on_dependency_failure="later")(wt.step.func)
    with pytest.raises(InvalidTask, match="per call"):
        django_jobs.task(after=[1])(wt.step.func)
    with pytest.raises(InvalidTask, match="on_dependency_failure must be one of"):
        with workflow() as wf:
            wf.add(wt.step, "a", on_dependency_failure="sometimes")


@given(
    st.one_of(
        st.integers(),
        st.floats(allow_nan=True),
        st.text(max_size=30),
        st.none(),
        st.booleans(),
        st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
)
@settings(max_examples=200, deadline=None)
def test_any_after_value_is_a_dependency_list_or_a_clear_refusal(value):
    """Whatever ``after=`` is given, ``using()`` either keeps job ids that fit the column
    (positive, 64-bit) or refuses naming the value; it never raises anything else."""
    from django_jobs.tasks.job_task import Dependency

    try:
        task = wt.step.using(after=value)
    except InvalidDependency as exc:
        assert "after=" in str(exc)
        return
    assert isinstance(task.after, tuple)
    for item in task.after:
        assert isinstance(item, Dependency) and 1 <= item.job_id <= 2**63 - 1


def test_discarding_an_awaiting_job_settles_what_waits_for_it(worker):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.cleanup, after=[b])
    assert operator.discard_job(DB, pk(b.result))
    assert status(b.result) == "discarded"
    assert not AwaitingExecution.objects.filter(job_id=pk(b.result)).exists()
    # c runs anyway once what it waits for has ended; a is untouched.
    assert status(c.result) == "ready" and status(a.result) == "ready"


def test_a_job_joining_an_ended_workflow_ends_at_once(worker, commits):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
    with commits():
        django_jobs.cancel_workflow(wf.result)
    late = wt.cleanup.using(after=[a.result]).enqueue()
    assert job_row(late).workflow_id == wf.result.id
    assert status(late) == "failed"
    assert error_paths(late) == [DEPENDENCY_FAILED_ERROR]


def test_retrying_a_dependent_whose_dependency_is_waiting_again_makes_it_wait(worker, commits):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
    run(worker, a.result, fail=True, commits=commits)
    # a retried from the admin: b waits again. b's own retry, meanwhile, changes nothing.
    assert operator.retry_failed_job(DB, pk(a.result))
    assert status(b.result) == "awaiting"
    assert not operator.retry_failed_job(DB, pk(b.result))
    assert AwaitingExecution.objects.get(job_id=pk(b.result)).remaining == 1


def test_after_a_whole_workflow_waits_for_every_job_of_it(worker):
    with workflow() as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b")
    after_all = wt.merge.using(after=[wf.result]).enqueue()
    assert AwaitingExecution.objects.get(job_id=pk(after_all)).remaining == 2
    run(worker, a.result)
    run(worker, b.result)
    assert status(after_all) == "ready"


def test_a_workflow_of_two_backends_is_refused_in_its_own_words(worker, second_backend):
    from django.tasks.exceptions import InvalidTask

    second_backend(DB)
    with pytest.raises(InvalidTask, match="one task backend"):
        with workflow() as wf:
            wf.add(wt.step, "a")
            wf.add(wt.step.using(backend="other"), "b")
