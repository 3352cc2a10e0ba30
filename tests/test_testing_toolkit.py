"""The test toolkit (django_jobs.testing) as a project's tests use it: inside Django's
``TestCase`` (one transaction, never committed), ``TransactionTestCase`` (autocommit) and
pytest-django functions with the ``jobs`` fixture, on every database.

Jobs run through the real state machine, so what each test checks is the state the jobs
and their rows end in, read back from the database, not what the toolkit says it did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import date, datetime, timedelta
from functools import partial
from pathlib import Path
from unittest.mock import ANY

import pytest
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase, override_settings
from django.utils import timezone

import django_jobs
from django_jobs import enqueue_batch, enqueue_on_commit, workflow
from django_jobs.core.dependencies import DEPENDENCY_FAILED_ERROR
from django_jobs.db import notify
from django_jobs.models import ClaimedExecution, Job, JobStatus, RecurringExecution
from django_jobs.testing import (
    JobsNotReady,
    Outcome,
    RunawayJobs,
    assert_enqueued,
    assert_not_enqueued,
    clear_dummy_backends,
    enqueue_recurring,
    enqueued_jobs,
    run_enqueued_jobs,
)
from django_jobs.testing.pytest_plugin import JobsToolkit
from tests import batch_tasks as bt
from tests import rate_tasks as rt
from tests import toolkit_tasks as t
from tests import workflow_tasks as wt
from tests.harness import create_server_database, database_url, error_paths, job_row


def is_notification(callback: object) -> bool:
    """Whether an on-commit callback is the workers' notification (``notify.jobs_ready``)."""
    return isinstance(callback, partial) and callback.func is notify.send


ROOT = Path(__file__).resolve().parent.parent


def status(result) -> str:
    return Job.objects.get(pk=int(result.id)).status


def later(**delta: float):
    return timezone.now() + timedelta(**delta)


class WhatEveryTestCaseChecks:
    """The tests both kinds of Django test case run: once inside a transaction that never
    commits (``TestCase``), once in autocommit (``TransactionTestCase``)."""

    inside_a_transaction: bool

    def test_jobs_enqueued_by_jobs_run_in_the_same_call_in_claim_order(self):
        t.add.enqueue(1, 2)
        t.fan_out.enqueue(2)
        report = run_enqueued_jobs()
        assert report.task_paths == [
            "tests.toolkit_tasks.add",
            "tests.toolkit_tasks.fan_out",
            "tests.toolkit_tasks.add",
            "tests.toolkit_tasks.add",
        ]
        assert report.outcomes == ["succeeded"] * 4
        assert report.return_values(t.add) == [3, 1, 2]
        # The bodies wrote through the test's own connection, in run order.
        assert t.notes() == ["add 1 2", "add 0 1", "add 1 1"]
        assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.SUCCEEDED}
        assert Job.objects.get(pk=report[0].job_id).attempts == 1
        assert run_enqueued_jobs().runs == []

    def test_an_async_task_runs_on_the_tests_connection(self):
        t.async_add.enqueue(20, 22)
        assert run_enqueued_jobs().return_values() == [42]
        assert t.notes() == ["async add 20 22"]

    def test_a_key_of_limit_one_runs_the_blocked_job_after_the_first(self):
        first = t.keyed.enqueue(1, "first")
        second = t.keyed.enqueue(1, "second")
        assert (status(first), status(second)) == ("ready", "blocked")
        report = run_enqueued_jobs()
        assert [run.job_id for run in report] == [int(first.id), int(second.id)]
        assert report.outcomes == ["succeeded", "succeeded"]
        assert t.notes() == ["keyed first", "keyed second"]

    def test_a_chain_and_a_fan_in_run_in_dependency_order(self):
        with workflow("chain and fan-in") as wf:
            a = wf.add(wt.step, "a")
            b = wf.add(wt.step, "b", after=[a])
            c = wf.add(wt.step, "c")
            merged = wf.add(wt.merge, after=[c, b])
        report = run_enqueued_jobs()
        order = [run.job_id for run in report]
        assert order.index(int(a.result.id)) < order.index(int(b.result.id))
        assert order[-1] == int(merged.result.id)
        # dependency_results() in the after= order of the fan-in.
        assert job_row(merged.result).return_value == ["c", "b"]
        assert wf.result.status == "succeeded"

    def test_a_failure_ends_its_dependents_and_theirs_after_the_commit(self):
        """The dependents of a job ended by its policy are settled by an on_commit
        follow-up: the runner runs it, else the last one would wait forever."""
        with workflow() as wf:
            a = wf.add(wt.step, "a", fail=True)
            b = wf.add(wt.step, "b", after=[a])
            c = wf.add(wt.step, "c", after=[b])
            d = wf.add(wt.cleanup, after=[c])  # on_dependency_failure="run"
        report = run_enqueued_jobs()
        assert report.outcomes == ["failed", "succeeded"]
        assert report[0].error is not None and "step a failed" in report[0].error.message
        for node in (b, c):
            assert status(node.result) == JobStatus.FAILED
            assert error_paths(node.result) == [DEPENDENCY_FAILED_ERROR]
        assert job_row(d.result).return_value == ["FAILED"]
        assert wf.result.status == "failed"

    def test_a_batch_fires_its_callback_once_its_items_are_done(self):
        made = enqueue_batch([(bt.item, [n], {}) for n in range(3)], on_success=bt.callback)
        report = run_enqueued_jobs()
        assert report.task_paths == ["tests.batch_tasks.item"] * 3 + ["tests.batch_tasks.callback"]
        assert report[-1].return_value == {"batch_id": made.id, "succeeded": 3, "failed": 0}
        assert made.refresh().finished_at is not None

    def test_a_job_body_may_enqueue_on_commit(self):
        t.enqueue_after_commit.enqueue("ada")
        report = run_enqueued_jobs()
        assert report.task_paths == [
            "tests.toolkit_tasks.enqueue_after_commit",
            "tests.toolkit_tasks.send_email",
        ]
        assert t.notes() == ["email ada@example.com"]

    def test_progress_is_written_on_the_test_connection(self):
        result = t.reports_progress.enqueue()
        assert run_enqueued_jobs().outcomes == ["succeeded"]
        row = job_row(result)
        assert (row.progress_done, row.progress_total, row.progress_message) == (3, 3, "done")
        # Inside a TestCase the writer's own connection would wait for the job's row,
        # which the test's transaction holds (InnoDB: 50 s, then the value is lost).
        assert t.notes() == ["the writer thread does not have it"]

    def test_a_body_that_breaks_a_constraint_fails_and_the_test_goes_on(self):
        """The write before the error is kept in autocommit, as in a worker; inside a
        TestCase the error marks the test's transaction for rollback, so the body's
        writes are rolled back, and the run, the log and assert_all_succeeded say so."""
        t.breaks_a_unique_constraint.enqueue("dup")
        t.add.enqueue(2, 2)
        watch = self.assertLogs if self.inside_a_transaction else self.assertNoLogs
        with watch("django_jobs.testing", "WARNING") as logged:
            report = run_enqueued_jobs()
        assert report.outcomes == ["failed", "succeeded"]
        assert report[0].error is not None and "IntegrityError" in str(report[0].error)
        with pytest.raises(AssertionError) as raised:
            report.assert_all_succeeded()
        if not self.inside_a_transaction:
            assert t.notes() == ["before the error dup", "add 2 2"]
            assert report.rolled_back == [] and report[0].rolled_back is None
            assert "rolled back" not in str(raised.value)
            return
        assert t.notes() == ["add 2 2"]
        assert report.rolled_back == [report[0]]
        assert "marked the test's transaction for rollback" in (report[0].rolled_back or "")
        (line,) = logged.output
        assert f"job {report[0].job_id} (tests.toolkit_tasks.breaks_a_unique_constraint)" in line
        assert "its body's writes were rolled back" in line and "TransactionTestCase" in line
        assert "-> failed (django.db.utils.IntegrityError" in str(raised.value)
        assert "[its writes were rolled back: a database error" in str(raised.value)
        assert "wrap the write that may fail in its own transaction.atomic()" in str(raised.value)

    def test_a_body_that_catches_a_database_error_and_goes_on(self):
        """In autocommit both succeed, as in a worker. Inside a TestCase the one without
        an atomic() of its own around the failing write gets TransactionManagementError
        at its next query, and its writes are rolled back: reported as such."""
        t.catches_a_constraint_error.enqueue("unguarded", guarded=False)
        t.catches_a_constraint_error.enqueue("guarded", guarded=True)
        report = run_enqueued_jobs()
        unguarded = ["unguarded before", "unguarded caught", "unguarded after"]
        guarded = ["guarded before", "guarded caught", "guarded after"]
        if not self.inside_a_transaction:
            assert report.outcomes == ["succeeded", "succeeded"] and not report.rolled_back
            assert t.notes() == [*unguarded, *guarded]
            return
        assert report.outcomes == ["failed", "succeeded"]
        error = report[0].error
        assert error is not None and error.exception_class_path.endswith(
            "TransactionManagementError"
        )
        assert report.rolled_back == [report[0]]
        assert "its TransactionManagementError is that mark too" in (report[0].rolled_back or "")
        assert t.notes() == guarded

    def test_a_body_that_catches_a_raw_database_error_and_returns(self):
        """A failed raw statement aborts a PostgreSQL transaction, not a MariaDB or
        SQLite one: inside a TestCase, on PostgreSQL alone, the body's writes are lost."""
        t.catches_a_raw_error.enqueue("raw")
        report = run_enqueued_jobs()
        assert report.outcomes == ["succeeded"]
        if self.inside_a_transaction and connection.vendor == "postgresql":
            assert t.notes() == []
            assert "the database refused to go on" in (report[0].rolled_back or "")
            with pytest.raises(AssertionError, match="its writes were rolled back"):
                report.assert_all_succeeded()
        else:
            assert t.notes() == ["raw before"] and report[0].rolled_back is None
            report.assert_all_succeeded()

    def test_a_body_may_open_a_durable_block_where_the_test_may(self):
        """Allowed where the test itself may open one (directly in a TestCase, or in
        autocommit), refused inside a block of the test's own, as Django refuses it."""
        t.durable_write.enqueue("first")
        run_enqueued_jobs().assert_all_succeeded()
        assert t.notes() == ["durable first"]
        t.durable_write.enqueue("nested")
        with transaction.atomic():
            (run,) = run_enqueued_jobs()
        assert run.outcome == Outcome.FAILED and run.error is not None
        assert run.error.exception_class_path == "builtins.RuntimeError"
        assert "durable atomic block cannot be nested" in run.error.message

    def test_ctrl_c_in_a_body_settles_its_job_and_stops_the_run(self):
        """A real SIGINT in the body: the attempt is recorded as failed (retried, as a
        body a worker's stop interrupts), then KeyboardInterrupt reaches the test."""
        interrupted = t.waits_for_ctrl_c.enqueue()
        after = t.add.enqueue(1, 1)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.raises(KeyboardInterrupt):
                run_enqueued_jobs()
        finally:
            signal.signal(signal.SIGINT, previous)
        row = job_row(interrupted)
        assert (row.status, row.attempts) == (JobStatus.SCHEDULED, 1)
        assert error_paths(interrupted) == ["builtins.KeyboardInterrupt"]
        assert status(after) == JobStatus.READY  # the run stopped there
        assert t.notes() == ["waiting for Ctrl-C"]
        assert not ClaimedExecution.objects.exists()
        assert not django_jobs.models.Process.objects.exists()


class TestInsideATestCase(WhatEveryTestCaseChecks, TestCase):
    """Inside the test's transaction: nothing commits, and no second connection."""

    inside_a_transaction = True

    def test_retries_with_backoff_run_by_time_travel(self):
        result = t.flaky.enqueue("sync", succeed_on=3)
        first = run_enqueued_jobs()
        assert first.outcomes == ["will_retry"]
        run = first[0]
        assert run.attempt == 1 and run.error is not None
        assert str(run.error) == "builtins.ValueError: sync: attempt 1 fails"
        assert run.next_run_at is not None and run.next_run_at > later(seconds=50)
        # Not due yet: a call without time travel leaves it waiting, and says till when.
        assert run_enqueued_jobs().runs == []
        (waiting,) = enqueued_jobs(t.flaky)
        assert (waiting.status, waiting.run_after) == ("scheduled", run.next_run_at)
        assert f"run_after={run.next_run_at.isoformat()}" in str(waiting)
        # An hour on: the retry due in 60 s, and the one after it, run in this call.
        second = run_enqueued_jobs(now=later(hours=1))
        assert second.outcomes == ["will_retry", "succeeded"]
        assert [r.attempt for r in second] == [2, 3]
        row = job_row(result)
        assert (row.status, row.attempts, row.return_value) == (JobStatus.SUCCEEDED, 3, 3)

    def test_run_scheduled_retries_at_once_until_the_attempts_are_used_up(self):
        result = t.flaky.enqueue("never", succeed_on=9)
        report = run_enqueued_jobs(run_scheduled=True)
        assert report.outcomes == ["will_retry", "will_retry", "failed"]
        assert report.failed[0].error is not None
        assert (job_row(result).status, job_row(result).attempts) == (JobStatus.FAILED, 3)
        assert t.notes() == [f"flaky never attempt {n}" for n in (1, 2, 3)]

    def test_a_snoozed_job_runs_again_when_its_time_comes(self):
        result = t.snoozing.enqueue(30)
        report = run_enqueued_jobs()
        assert report.outcomes == ["snoozed"] and report.snoozed[0].error is None
        assert report[0].next_run_at > later(seconds=20)
        assert enqueued_jobs(t.snoozing)[0].run_after == report[0].next_run_at
        assert run_enqueued_jobs(now=later(seconds=10)).runs == []
        again = run_enqueued_jobs(now=later(minutes=1))
        assert again.outcomes == ["succeeded"] and again[0].return_value == 2
        # The snooze used up no attempt: max_attempts grew with it.
        row = job_row(result)
        assert (row.attempts, row.max_attempts) == (2, 2)

    def test_a_job_over_its_rate_waits_and_time_travel_does_not_bring_it_back(self):
        first = rt.once_a_minute.enqueue(1)
        second = rt.once_a_minute.enqueue(2)
        report = run_enqueued_jobs(run_scheduled=True)
        assert [run.job_id for run in report] == [int(first.id)]
        assert report.rate_limited == [int(second.id)]
        row = job_row(second)
        assert (row.status, row.attempts) == (JobStatus.SCHEDULED, 0)
        assert run_enqueued_jobs(now=later(hours=1)).runs == []

    def test_a_unique_job_runs_once_and_lets_go_of_its_key(self):
        one = t.unique_sync.enqueue(7)
        assert t.unique_sync.enqueue(7).id == one.id
        assert run_enqueued_jobs().outcomes == ["succeeded"]
        again = t.unique_sync.enqueue(7)
        assert again.id != one.id
        assert run_enqueued_jobs().outcomes == ["succeeded"]
        assert t.notes() == ["sync 7", "sync 7"]

    def test_queue_runs_only_those_queues_in_their_order(self):
        t.add.enqueue(1, 1)
        t.send_email.enqueue("a@example.com")
        t.build_report.enqueue("weekly")
        report = run_enqueued_jobs(queue=["reports", "emails"])
        assert report.task_paths == [
            "tests.toolkit_tasks.build_report",
            "tests.toolkit_tasks.send_email",
        ]
        assert run_enqueued_jobs(queue="emails").runs == []
        assert_enqueued(t.add, args=[1, 1], count=1)
        assert run_enqueued_jobs(queue="default").outcomes == ["succeeded"]

    def test_a_time_travel_leaves_the_scheduled_jobs_of_other_queues(self):
        t.send_email.using(run_after=later(minutes=5)).enqueue("b@example.com")
        t.add.using(run_after=later(minutes=5)).enqueue(2, 2)
        assert run_enqueued_jobs(queue="default", now=later(minutes=10)).task_paths == [
            "tests.toolkit_tasks.add"
        ]
        (waiting,) = enqueued_jobs(t.send_email)
        assert waiting.status == "scheduled"

    def test_limit_runs_that_many_and_leaves_the_rest(self):
        for n in range(5):
            t.add.enqueue(n, 0)
        assert len(run_enqueued_jobs(limit=2)) == 2
        assert len(enqueued_jobs(t.add)) == 3
        assert run_enqueued_jobs(limit=0).runs == []
        assert len(run_enqueued_jobs()) == 3

    def test_the_tests_own_on_commit_callbacks_are_left_alone(self):
        called: list[str] = []
        transaction.on_commit(lambda: called.append("the test's own"))
        t.enqueue_after_commit.enqueue("bo")
        with self.captureOnCommitCallbacks(execute=True) as captured:
            assert len(run_enqueued_jobs()) == 2
        # The runner ran its steps' callbacks and dropped them: a capture around it has
        # none left to run a second time.
        assert captured == []
        assert called == []
        assert len(connection.run_on_commit) == 1  # the test's own, where it was

    def test_enqueue_on_commit_with_capture_on_commit_callbacks(self):
        with self.captureOnCommitCallbacks(execute=True) as callbacks:
            enqueue_on_commit(t.send_email, "c@example.com")
            assert_not_enqueued(t.send_email)
        # The enqueue's own callback, and on PostgreSQL the workers' notification when this
        # process notified within the last INLINE_AFTER (an earlier test's enqueue): how
        # many depends on the tests run before, so only the enqueue's is counted.
        assert len([c for c in callbacks if not is_notification(c)]) == 1
        assert_enqueued(t.send_email, args=["c@example.com"], queue="emails")
        assert run_enqueued_jobs().return_values() == ["c@example.com"]

    def test_a_job_whose_arguments_no_longer_bind_fails_clearly(self):
        result = t.add.enqueue(1, 2)
        Job.objects.filter(pk=int(result.id)).update(args=[1, 2, 3])
        report = run_enqueued_jobs()
        (run,) = report.failed
        assert run.error is not None and run.error.exception_class_path == "builtins.TypeError"
        assert "takes 2 positional arguments but 3 were given" in run.error.message
        assert "TypeError" in run.error.traceback
        assert status(result) == JobStatus.FAILED
        with pytest.raises(AssertionError, match=r"1 of 1 job run\(s\) did not succeed"):
            report.assert_all_succeeded()

    def test_a_job_whose_task_is_gone_fails_without_an_attempt(self):
        from django_jobs.signals import job_attempt_failed

        result = t.add.enqueue(1, 2)
        Job.objects.filter(pk=int(result.id)).update(task_path="tests.toolkit_tasks.gone")
        announced: list[int] = []

        def note(sender, attempt, **kwargs):
            announced.append(attempt)

        job_attempt_failed.connect(note)
        try:
            (run,) = run_enqueued_jobs()
        finally:
            job_attempt_failed.disconnect(note)
        assert run.outcome == Outcome.FAILED and run.attempt == 0
        assert run.error is not None and "cannot be imported" in run.error.message
        # The attempt that failed is the first, as a worker announces it (error trackers
        # tag it): not the claim's start counted twice.
        assert announced == [1]

    def test_a_task_that_enqueues_itself_forever_is_stopped_and_named(self):
        t.forever.enqueue(0)
        with pytest.raises(RunawayJobs) as raised:
            run_enqueued_jobs(max_runs=25)
        message = str(raised.value)
        assert "max_runs of 25" in message
        assert "tests.toolkit_tasks.forever (1 due)" in message
        assert "tests.toolkit_tasks.forever x25" in message
        assert len(raised.value.report) == 25
        # Nothing was lost: the next one waits, and the process row is gone.
        assert_enqueued(t.forever, args=[25], count=1)
        assert not django_jobs.models.Process.objects.exists()

    def test_a_body_that_raises_keeps_what_it_wrote_as_in_a_worker(self):
        t.fails_after_writing.enqueue("x")
        assert run_enqueued_jobs().outcomes == ["failed"]
        assert t.notes() == ["wrote x"]

    def test_a_job_that_fails_after_its_cancel_request_ends_cancelled(self):
        result = t.cancels_itself.enqueue()
        (run,) = run_enqueued_jobs(run_scheduled=True)
        assert run.outcome == Outcome.CANCELLED and run.error is not None
        row = job_row(result)
        assert (row.status, row.attempts) == (JobStatus.FAILED, 1)  # never retried

    def test_assertions_name_what_was_enqueued(self):
        t.add.enqueue(1, 2)
        t.send_email.enqueue("d@example.com")
        t.add.using(run_after=later(hours=1)).enqueue(5, 6)
        assert [job.args for job in enqueued_jobs(t.add)] == [[1, 2], [5, 6]]
        assert [job.status for job in enqueued_jobs("tests.toolkit_tasks.add")] == [
            "ready",
            "scheduled",
        ]
        assert_enqueued(t.add, args=(1, 2))
        assert_enqueued(t.add, args=[ANY, 6], count=1)
        assert_enqueued(count=3)
        assert_enqueued(t.send_email, kwargs={}, queue="emails")
        assert_not_enqueued(t.add, args=[9, 9])
        with pytest.raises(AssertionError) as raised:
            assert_enqueued(t.add, args=[7, 7])
        message = str(raised.value)
        assert "expected at least one job of tests.toolkit_tasks.add with args=[7, 7]" in message
        assert "found 0" in message and "Waiting to run (3):" in message
        assert "tests.toolkit_tasks.add(1, 2) queue='default' status=ready" in message
        assert "tests.toolkit_tasks.send_email('d@example.com') queue='emails'" in message
        with pytest.raises(AssertionError, match="expected 1 job"):
            assert_enqueued(t.add, count=1)
        with pytest.raises(AssertionError, match=r"expected no job of tests.toolkit_tasks.add"):
            assert_not_enqueued(t.add)

    def test_a_failure_message_lists_the_first_twenty(self):
        for n in range(25):
            t.add.enqueue(n, n)
        with pytest.raises(AssertionError) as raised:
            assert_enqueued(t.send_email)
        message = str(raised.value)
        assert "Waiting to run (25):" in message and "... and 5 more" in message
        assert message.count("tests.toolkit_tasks.add(") == 20
        with pytest.raises(AssertionError) as raised:
            assert_not_enqueued(t.add)
        message = str(raised.value)
        assert "found 25:" in message and message.endswith("\n  ... and 5 more")
        assert message.count("tests.toolkit_tasks.add(") == 20

    def test_recurring_ticks_on_demand(self):
        recurring = {
            "nightly": {
                "task": "tests.toolkit_tasks.build_report",
                "schedule": "0 3 * * *",
                "args": ["nightly"],
            },
            "hourly": {"task": "tests.toolkit_tasks.add", "schedule": "every hour", "args": [1, 1]},
        }
        with override_settings(DJANGO_JOBS={"recurring": recurring}):
            at = timezone.now().replace(hour=3, minute=30) + timedelta(days=1)
            made = enqueue_recurring("nightly", now=at)
            assert list(made) == ["nightly"] and made["nightly"] is not None
            # One tick, once: the same tick again enqueues nothing.
            assert enqueue_recurring("nightly", now=at + timedelta(minutes=5)) == {"nightly": None}
            tick = RecurringExecution.objects.get(task_key="nightly").run_at
            assert (tick.hour, tick.minute) == (3, 0)
            assert list(enqueue_recurring("hourly")) == ["hourly"]
            with pytest.raises(LookupError, match="'weekly'"):
                enqueue_recurring("weekly")
        assert_enqueued(t.build_report, args=["nightly"], queue="reports", count=1)
        assert run_enqueued_jobs(queue="reports").return_values() == ["nightly"]
        assert run_enqueued_jobs().return_values() == [2]


class TestInAutocommit(WhatEveryTestCaseChecks, TransactionTestCase):
    """Every step commits, as in a worker (on MariaDB, hot_transaction's own
    START TRANSACTION and COMMIT)."""

    inside_a_transaction = False

    def test_no_notification_is_sent_while_the_runner_runs(self):
        """The runner sends nobody a NOTIFY (a notifier would hold a connection of its
        own to the test database), not even for the jobs its bodies enqueue; the
        enqueue outside it still does."""
        if not notify.enabled("default"):
            self.skipTest(
                "the enqueue notifies nobody here (LISTEN/NOTIFY: PostgreSQL, listen_notify on)"
            )
        sent: list[frozenset[str]] = []

        class Recorder:
            def send(self, queues=(), cancels=()):
                sent.append(frozenset(queues))

            def quiet(self) -> bool:
                return False

        previous = notify.install("default", Recorder())  # type: ignore[arg-type]
        try:
            t.fan_out.enqueue(3)
            assert sent == [frozenset({"default"})]
            # fan_out enqueues three jobs from its body: each would notify, outside it.
            assert run_enqueued_jobs().outcomes == ["succeeded"] * 4
            assert sent == [frozenset({"default"})]
        finally:
            if previous is not None:
                notify.install("default", previous)
            else:
                notify._notifiers.pop("default", None)


@pytest.mark.django_db
def test_the_fixture_in_a_plain_pytest_function(jobs):
    assert isinstance(jobs, JobsToolkit)
    t.add.enqueue(2, 3)
    jobs.assert_enqueued(t.add, args=[2, 3])
    assert jobs.run_enqueued_jobs().return_values() == [5]
    jobs.assert_not_enqueued(t.add)
    assert jobs.enqueued_jobs() == []


def test_the_fixture_gives_database_access_by_itself(jobs):
    t.keyed.enqueue(2, "one")
    t.keyed.enqueue(2, "two")
    assert jobs.run_enqueued_jobs().return_values() == ["one", "two"]


def test_the_fixture_with_transactional_db(
    jobs, transactional_db, django_capture_on_commit_callbacks
):
    assert not connection.in_atomic_block
    with transaction.atomic():
        enqueue_on_commit(t.send_email, "e@example.com")
        jobs.assert_not_enqueued(t.send_email)
    jobs.assert_enqueued(t.send_email, args=["e@example.com"])
    t.fan_out.enqueue(1)
    assert jobs.run_enqueued_jobs().outcomes == ["succeeded"] * 3
    assert Job.objects.filter(status=JobStatus.SUCCEEDED).count() == 3


def test_bad_arguments_are_refused_before_anything_runs(jobs):
    t.add.enqueue(1, 1)
    with pytest.raises(ValueError, match="not both"):
        jobs.run_enqueued_jobs(now=later(hours=1), run_scheduled=True)
    with pytest.raises(ValueError, match="aware"):
        jobs.run_enqueued_jobs(now=timezone.now().replace(tzinfo=None))
    with pytest.raises(ValueError, match="max_runs must be at least 1"):
        jobs.run_enqueued_jobs(max_runs=0)
    with pytest.raises(TypeError, match="limit must be an int"):
        jobs.run_enqueued_jobs(limit="3")
    with pytest.raises(TypeError, match="queue names"):
        jobs.run_enqueued_jobs(queue=[1])
    for empty in ("", ["emails", ""]):
        with pytest.raises(ValueError, match="empty queue name"):
            jobs.run_enqueued_jobs(queue=empty)
    with pytest.raises(TypeError, match="a task"):
        jobs.assert_enqueued(len)
    for count in ("1", True, 1.0):
        with pytest.raises(TypeError, match="count must be an int"):
            jobs.assert_enqueued(t.add, count=count)
    with pytest.raises(ValueError, match="count must be 0 or more, not -1"):
        jobs.assert_enqueued(t.add, count=-1)
    for args in ("11", b"11", 11):
        with pytest.raises(TypeError, match="args= takes a list or tuple"):
            jobs.assert_enqueued(t.add, args=args)
    with pytest.raises(TypeError, match="args= takes a list or tuple"):
        jobs.enqueued_jobs(t.add, args="11")
    with pytest.raises(TypeError, match="kwargs= takes a dict"):
        jobs.assert_not_enqueued(t.add, kwargs=[("a", 1)])
    recurring = {"r": {"task": t.add.module_path, "schedule": "every hour", "args": [0, 0]}}
    with override_settings(DJANGO_JOBS={"recurring": recurring}):
        for now in ("2026-01-01", date(2026, 1, 1)):
            with pytest.raises(TypeError, match=r"enqueue_recurring\(\): now must be a datetime"):
                jobs.enqueue_recurring(now=now)
        with pytest.raises(ValueError, match=r"enqueue_recurring\(\): now must be an aware"):
            jobs.enqueue_recurring(now=datetime(2026, 1, 1))
        with pytest.raises(TypeError, match=r"separate arguments: enqueue_recurring\(\*keys\)"):
            jobs.enqueue_recurring(["r"])
    jobs.assert_enqueued(t.add, count=1)  # nothing ran, nothing was enqueued


def test_a_database_without_the_jobs_tables_is_named_with_the_fix(tmp_path, db):
    """In a process of its own, against a database that exists but was never migrated."""
    vendor = connection.vendor
    if vendor == "sqlite":
        url = f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    else:
        name = f"{connection.settings_dict['NAME']}_empty"
        create_server_database(name)
        url = database_url().rsplit("/", 1)[0] + f"/{name}"
    try:
        done = run_in_a_process(url, "testproject.settings")
    finally:
        if vendor != "sqlite":
            drop_server_database(name)
    assert done.returncode != 0
    assert "JobsNotReady" in done.stderr
    assert "the jobs tables are missing from database 'default'" in done.stderr
    assert "manage.py migrate django_jobs" in done.stderr


def test_a_project_without_the_app_is_named_with_the_fix(tmp_path):
    done = run_in_a_process(f"sqlite:///{tmp_path / 'bare.sqlite3'}", "tests.toolkit_bare_settings")
    assert done.returncode != 0
    assert 'django_jobs is not in INSTALLED_APPS: add "django_jobs"' in done.stderr


@override_settings(TASKS={"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}})
def test_no_backend_of_ours_is_refused_and_dummy_results_are_read(jobs):
    from django.tasks import task_backends

    with pytest.raises(
        JobsNotReady, match=r"no backend of TASKS is django_jobs\.backend\.JobsBackend"
    ):
        jobs.run_enqueued_jobs()
    task_backends["default"].clear()
    bt.callback.enqueue(batch_id=1, succeeded=2, failed=0)
    (found,) = jobs.assert_enqueued(
        bt.callback, kwargs={"batch_id": 1, "succeeded": ANY, "failed": 0}
    )
    assert (found.backend, found.status, found.queue_name) == ("default", "ready", "default")
    jobs.assert_not_enqueued(bt.callback, kwargs={"batch_id": 2, "succeeded": 2, "failed": 0})


# The tests run in a pytest process of their own by test_a_separate_jobs_database.
SEPARATE_JOBS_DATABASE_TESTS = """
import pytest
from django.db import connections
from django.test import TestCase
from django.test.testcases import DatabaseOperationForbidden

from django_jobs.models import Job
from django_jobs.testing import run_enqueued_jobs
from tests import toolkit_tasks as t


def test_the_fixture_asks_for_the_jobs_database(jobs):
    t.fan_out.enqueue(2)
    assert jobs.run_enqueued_jobs().outcomes == ["succeeded"] * 3
    assert Job.objects.using("jobs").count() == 3
    assert t.notes() == ["add 0 1", "add 1 1"]
    assert connections["jobs"].in_atomic_block and connections["default"].in_atomic_block


@pytest.mark.django_db(transaction=True)
def test_the_fixture_keeps_the_tests_own_marker(jobs):
    t.add.enqueue(1, 2)
    assert jobs.run_enqueued_jobs().return_values() == [3]
    assert not connections["jobs"].in_atomic_block


def test_the_fixture_after_the_db_fixture(db, jobs):
    t.add.enqueue(2, 3)
    assert jobs.run_enqueued_jobs().return_values() == [5]


class NamesBothDatabases(TestCase):
    databases = {"default", "jobs"}

    def test_a_bodys_on_commit_on_another_database_waits_for_the_test(self):
        t.notes_on_commit.enqueue("x")
        with self.captureOnCommitCallbacks(using="default", execute=True) as waiting:
            assert run_enqueued_jobs().outcomes == ["succeeded"]
            assert t.notes() == []
        assert len(waiting) == 1 and t.notes() == ["committed x"]


class NamesOnlyDefault(TestCase):
    def test_the_jobs_database_is_refused(self):
        with pytest.raises(DatabaseOperationForbidden, match="Database queries to 'jobs'"):
            run_enqueued_jobs()
"""


def test_a_separate_jobs_database(tmp_path, db):
    """DJANGO_JOBS["database"] = "jobs" with JobsRouter, in a pytest run of its own (two
    test databases of the database under test): the fixture adds "jobs" to the test's
    databases, whatever its marker and fixtures; a TestCase names both itself."""
    base = {k: v for k, v in connection.settings_dict.items() if k not in ("NAME", "TEST")}
    if connection.vendor == "sqlite":
        names = {alias: str(tmp_path / f"{alias}.sqlite3") for alias in ("default", "jobs")}
    else:
        names = {
            alias: f"{connection.settings_dict['NAME']}_{alias}" for alias in ("default", "jobs")
        }
    databases = {
        alias: {
            **base,
            "NAME": name,
            "TEST": {"NAME": f"{name}_test" if connection.vendor == "sqlite" else name},
        }
        for alias, name in names.items()
    }
    (tmp_path / "jobsdb_settings.py").write_text(
        "from testproject.settings import *  # noqa: F403\n"
        f"DATABASES = {databases!r}\n"
        'DATABASE_ROUTERS = ["django_jobs.routers.JobsRouter"]\n'
        'DJANGO_JOBS = {**DJANGO_JOBS, "database": "jobs", "listen_notify": False}  # noqa: F405\n'
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the rootdir, not the project's
    (tmp_path / "test_jobsdb.py").write_text(SEPARATE_JOBS_DATABASE_TESTS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env.pop("TEST_DATABASE_NAME", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ds=jobsdb_settings"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout


DUMMY_TASKS = {"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}


def test_the_fixture_forgets_what_a_dummy_backend_kept_from_earlier_tests(settings, request):
    """Django's DummyBackend keeps its results for the process: a test settings file
    that uses it would show each test the jobs of the tests before it."""
    settings.TASKS = DUMMY_TASKS
    t.add.enqueue(1, 1)  # as an earlier test of the process would have
    assert len(enqueued_jobs(t.add)) == 1
    jobs = request.getfixturevalue("jobs")  # the fixture, set up after that test
    jobs.assert_not_enqueued(t.add)
    t.add.enqueue(2, 2)
    (found,) = jobs.assert_enqueued(t.add)
    assert found.args == [2, 2]


def test_clear_dummy_backends_for_a_test_case(settings, db):
    """What a TestCase calls in setUp(); a backend of ours is left alone."""
    settings.TASKS = {**DUMMY_TASKS, "jobs": {"BACKEND": "django_jobs.backend.JobsBackend"}}
    t.add.enqueue(3, 3)
    assert [job.backend for job in enqueued_jobs(t.add)] == ["default"]
    clear_dummy_backends()
    assert enqueued_jobs(t.add) == []


def run_in_a_process(url: str, settings_module: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": settings_module,
        "PYTHONPATH": str(ROOT),
    }
    env.pop("TEST_DATABASE_NAME", None)
    code = (
        "import django; django.setup(); "
        "from django_jobs.testing import run_enqueued_jobs; run_enqueued_jobs()"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def drop_server_database(name: str) -> None:
    with connection._nodb_cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {connection.ops.quote_name(name)}")
