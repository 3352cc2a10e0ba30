"""Each tick enqueued once, forced: two schedulers on one tick, and a scheduler killed
between its enqueue and its commit.

In the style of ``test_races``: one transaction is paused at the dangerous point
(a wrapper around the real function), the other path runs, and the test waits
until the database reports it blocked on a lock (or finished: the buggy order).
The ``_unprotected`` test removes the unique constraint and shows the bug
appear. PostgreSQL and MariaDB only: SQLite serialises whole write transactions.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import InterfaceError, OperationalError, connection, connections
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core import recurring
from django_jobs.core.recurring import enqueue_tick, parse_entry, sync_recurring_tasks
from django_jobs.models import Job, RecurringExecution, RecurringTask
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.scheduler import Scheduler
from tests.test_races import Paused, Runner, wait_for

DB = "default"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
    ),
]


@pytest.fixture
def nightly():
    """A daily task known for a week, so its latest tick is due and may be caught up."""
    entry = parse_entry(
        "nightly", {"task": "tests.tasks.echo", "schedule": "0 3 * * *", "args": ["n"]}
    )
    sync_recurring_tasks(DB, [entry])
    RecurringTask.objects.update(active_since=timezone.now() - timedelta(days=7))
    return entry


def fresh_scheduler(entry) -> Scheduler:
    conf = JobsSettings.load(recurring={entry.key: {}})
    return Scheduler(conf, Lifecycle(), entries=[entry])


def jobs_for(entry) -> int:
    return Job.objects.filter(task_path=entry.task_path).count()


# --- two schedulers fire the same tick at once --------------------------------------------


def race_two_schedulers(monkeypatch, entry) -> tuple[object, object, bool]:
    """A has inserted the tick's row and waits inside its transaction; B fires the same tick.

    Returns both results and whether B was seen waiting on a lock.
    """
    tick = entry.schedule.latest(timezone.now())
    paused = Paused(monkeypatch, recurring, "insert_execution")
    first = Runner(lambda: enqueue_tick(DB, entry, tick), paused)
    first.start()
    assert paused.reached.wait(10)  # A's row is in, uncommitted
    second = Runner(lambda: enqueue_tick(DB, entry, tick))
    second.start()
    wait_for(second.blocked_or_done, "the second scheduler to block or finish")
    blocked = not second.done.is_set()
    paused.resume.set()
    return first.finish(), second.finish(), blocked


def test_two_schedulers_on_the_same_tick_enqueue_one_job(monkeypatch, nightly):
    """Protection: the unique (task_key, run_at) row, inserted in the job's transaction."""
    first, second, blocked = race_two_schedulers(monkeypatch, nightly)
    assert blocked, "the second insert should wait for the first transaction"
    assert isinstance(first, int) and second is None
    assert jobs_for(nightly) == 1
    assert list(RecurringExecution.objects.values_list("job_id", flat=True)) == [first]


def test_two_schedulers_unprotected_enqueue_the_tick_twice(monkeypatch, nightly):
    (constraint,) = RecurringExecution._meta.constraints
    with connection.schema_editor() as editor:
        editor.remove_constraint(RecurringExecution, constraint)
    try:
        first, second, blocked = race_two_schedulers(monkeypatch, nightly)
        assert not blocked
        assert isinstance(first, int) and isinstance(second, int) and first != second
        assert jobs_for(nightly) == 2
    finally:
        RecurringExecution.objects.all().delete()
        with connection.schema_editor() as editor:
            editor.add_constraint(RecurringExecution, constraint)


# --- a scheduler killed between its enqueue and its commit ----------------------------------


def test_a_scheduler_killed_before_its_commit_leaves_the_tick_to_the_next_one(monkeypatch, nightly):
    """The tick row and the job die together; the next scheduler's start-up enqueues it once."""
    tick = nightly.schedule.latest(timezone.now())
    paused = Paused(monkeypatch, recurring, "enqueue_job")
    dying = Runner(lambda: fresh_scheduler(nightly).start_up(timezone.now()), paused)
    dying.start()
    assert paused.reached.wait(10)  # job inserted, nothing committed
    assert jobs_for(nightly) == 0 and not RecurringExecution.objects.exists()
    with connections[DB].cursor() as cursor:  # the process dies: its connection is cut
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s)", [dying.session])
        else:
            cursor.execute(f"KILL {int(dying.session)}")
    paused.resume.set()
    dying.join(20)
    assert isinstance(dying.error, OperationalError | InterfaceError), dying.error
    assert jobs_for(nightly) == 0 and not RecurringExecution.objects.exists()

    fresh_scheduler(nightly).start_up(timezone.now())
    fresh_scheduler(nightly).start_up(timezone.now())  # and another: still once
    (execution,) = RecurringExecution.objects.all()
    assert execution.run_at == tick
    assert jobs_for(nightly) == 1 and Job.objects.get().pk == execution.job_id
    assert RecurringTask.objects.get().last_job_id == execution.job_id
