"""Recurring tasks against the database: sync, one job per tick, catch-up, run now, checks."""

from __future__ import annotations

import logging
import sys
import threading
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connections
from django.tasks import task, task_backends
from django.test import override_settings
from django.utils import timezone

from django_jobs.checks import backend_checks
from django_jobs.conf import JobsSettings
from django_jobs.core import recurring
from django_jobs.core.recurring import (
    enqueue_tick,
    parse_entry,
    run_now,
    set_enabled,
    sync_recurring_tasks,
)
from django_jobs.models import Job, RecurringExecution, RecurringTask
from django_jobs.runtime import scheduler as scheduler_module
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.scheduler import Scheduler
from tests.harness import wait_until

DB = "default"
DAY = timedelta(days=1)
NIGHTLY = {"task": "tests.tasks.echo", "schedule": "0 3 * * *", "args": ["nightly"]}

pytestmark = pytest.mark.django_db


def entry(key: str = "nightly", **raw):
    return parse_entry(key, {**NIGHTLY, **raw})


def scheduler(*entries) -> Scheduler:
    conf = JobsSettings.load(recurring={e.key: {} for e in entries})
    return Scheduler(conf, Lifecycle(), entries=list(entries))


def jobs_of(key: str = "nightly") -> list[int]:
    return sorted(RecurringExecution.objects.filter(task_key=key).values_list("job_id", flat=True))


def activate(key: str, since) -> None:
    """Pretend the task has been known since ``since`` (so its ticks from then are due)."""
    RecurringTask.objects.filter(key=key).update(active_since=since)


# --- sync -------------------------------------------------------------------------------


def test_sync_creates_rows_active_from_now():
    before = timezone.now()
    sync_recurring_tasks(DB, [entry(), entry("fast", schedule="every 30 seconds", args=[])])
    row = RecurringTask.objects.get(key="nightly")
    assert (row.task_path, row.schedule, row.time_zone, row.args) == (
        "tests.tasks.echo",
        "0 3 * * *",
        "UTC",
        ["nightly"],
    )
    assert row.enabled and row.last_run_at is None
    assert before <= row.active_since <= timezone.now()
    assert RecurringTask.objects.get(key="fast").schedule == "every 30 seconds"


def test_sync_overwrites_settings_and_keeps_database_state():
    sync_recurring_tasks(DB, [entry()])
    long_ago = timezone.now() - 10 * DAY
    RecurringTask.objects.update(enabled=False, active_since=long_ago, last_run_at=long_ago)
    changed = entry(schedule="@hourly", args=[1], queue_name="reports", timezone="Asia/Tokyo")
    sync_recurring_tasks(DB, [changed])
    row = RecurringTask.objects.get(key="nightly")
    assert (row.schedule, row.args, row.queue_name, row.time_zone) == (
        "@hourly",
        [1],
        "reports",
        "Asia/Tokyo",
    )
    assert (row.enabled, row.active_since, row.last_run_at) == (False, long_ago, long_ago)
    assert RecurringTask.objects.count() == 1


def test_interval_schedules_are_stored_as_text():
    sync_recurring_tasks(DB, [entry("a", schedule=90), entry("b", schedule=timedelta(hours=2))])
    assert RecurringTask.objects.get(key="a").schedule == "every 90 seconds"
    assert RecurringTask.objects.get(key="b").schedule == "every 7200 seconds"


# --- one job per tick ---------------------------------------------------------------------


def test_enqueue_tick_enqueues_once_and_records_it():
    nightly = entry(queue_name="reports", priority=7, kwargs={})
    sync_recurring_tasks(DB, [nightly])
    tick = nightly.schedule.latest(timezone.now())
    job_id = enqueue_tick(DB, nightly, tick)
    job = Job.objects.get(pk=job_id)
    assert (job.task_path, job.args, job.queue_name, job.priority) == (
        "tests.tasks.echo",
        ["nightly"],
        "reports",
        7,
    )
    execution = RecurringExecution.objects.get()
    assert (execution.task_key, execution.run_at, execution.job_id) == ("nightly", tick, job_id)
    row = RecurringTask.objects.get(key="nightly")
    assert (row.last_run_at, row.last_job_id) == (tick, job_id)

    assert enqueue_tick(DB, nightly, tick) is None
    assert enqueue_tick(DB, nightly, tick + timedelta(microseconds=5)) is None  # same second
    assert Job.objects.count() == 1 and RecurringExecution.objects.count() == 1


def test_enqueue_tick_without_a_synced_row_still_enqueues_once():
    nightly = entry()
    tick = nightly.schedule.latest(timezone.now())
    assert enqueue_tick(DB, nightly, tick) is not None
    assert enqueue_tick(DB, nightly, tick) is None
    assert Job.objects.count() == 1


def test_last_run_at_only_moves_forward():
    nightly = entry()
    sync_recurring_tasks(DB, [nightly])
    tick = nightly.schedule.latest(timezone.now())
    newer = enqueue_tick(DB, nightly, tick)
    assert enqueue_tick(DB, nightly, tick - DAY) is not None
    row = RecurringTask.objects.get(key="nightly")
    assert (row.last_run_at, row.last_job_id) == (tick, newer)


def test_a_tick_the_task_refuses_rolls_back_its_execution_row():
    """The job is refused (a queue the backend does not know): no row, so no lost tick."""
    bad = entry(queue_name="no-such-queue")
    sync_recurring_tasks(DB, [bad])
    with pytest.raises(Exception, match="no-such-queue"):
        enqueue_tick(DB, bad, bad.schedule.latest(timezone.now()))
    assert not RecurringExecution.objects.exists() and not Job.objects.exists()


def test_disabled_tasks_enqueue_nothing():
    nightly = entry()
    sync_recurring_tasks(DB, [nightly])
    assert set_enabled(DB, "nightly", False)
    assert enqueue_tick(DB, nightly, nightly.schedule.latest(timezone.now())) is None
    assert not Job.objects.exists() and not RecurringExecution.objects.exists()
    assert set_enabled(DB, "missing", False) is False


# --- catch-up policy ---------------------------------------------------------------------


def test_start_up_enqueues_only_the_latest_missed_tick(caplog):
    nightly = entry()
    sync_recurring_tasks(DB, [nightly])
    now = timezone.now()
    activate("nightly", now - 3 * DAY)  # three ticks missed: two skipped, the latest caught up
    with caplog.at_level(logging.WARNING, "django_jobs.scheduler"):
        scheduler(nightly).start_up(now)
    latest = nightly.schedule.latest(now)
    assert list(RecurringExecution.objects.values_list("run_at", flat=True)) == [latest]
    assert len(jobs_of()) == 1
    assert "nightly: skipping 2 missed tick(s)" in caplog.text
    # A second start (another scheduler, a restart) finds the tick taken.
    scheduler(nightly).start_up(timezone.now())
    assert Job.objects.count() == 1


def test_start_up_counts_missed_ticks_from_the_last_run(caplog):
    fast = entry("fast", schedule="every 1 minute")
    sync_recurring_tasks(DB, [fast])
    now = timezone.now()
    latest = fast.schedule.latest(now)
    activate("fast", now - 10 * DAY)
    RecurringTask.objects.update(last_run_at=latest - timedelta(minutes=4))
    s = scheduler(fast)
    with caplog.at_level(logging.WARNING, "django_jobs.scheduler"):
        s.start_up(now)
    assert list(RecurringExecution.objects.values_list("run_at", flat=True)) == [latest]
    # Between the last run and the latest: three ticks, skipped.
    assert "fast: skipping 3 missed tick(s)" in caplog.text
    assert s.seen["fast"] == latest


def test_the_missed_tick_count_stops_at_the_limit(caplog):
    fast = entry("fast", schedule="every 1 second")
    sync_recurring_tasks(DB, [fast])
    activate("fast", timezone.now() - 10 * DAY)
    with caplog.at_level(logging.WARNING, "django_jobs.scheduler"):
        scheduler(fast).start_up(timezone.now())
    assert "fast: skipping 1000+ missed tick(s)" in caplog.text
    assert RecurringExecution.objects.count() == 1


def test_no_tick_at_or_before_active_since_is_enqueued():
    """A task seen for the first time starts with the next tick, not a past one."""
    nightly = entry()
    now = timezone.now()
    s = scheduler(nightly)
    s.start_up(now)  # creates the row: active since now
    assert not RecurringExecution.objects.exists()
    s.fire_due(now)
    assert not RecurringExecution.objects.exists()
    next_tick = nightly.schedule.next(now)
    s.fire_due(next_tick)
    assert list(RecurringExecution.objects.values_list("run_at", flat=True)) == [next_tick]


def test_a_running_scheduler_enqueues_every_tick_that_comes_due():
    every = entry("every", schedule="every 10 seconds")
    now = timezone.now()
    s = scheduler(every)
    s.start_up(now)
    first = every.schedule.next(now)
    s.fire_due(first + timedelta(seconds=25))  # three ticks came due
    expected = [first + timedelta(seconds=10 * i) for i in range(3)]
    assert list(RecurringExecution.objects.order_by("run_at").values_list("run_at", flat=True)) == (
        expected
    )
    assert len(set(jobs_of("every"))) == 3 and Job.objects.count() == 3
    s.fire_due(first + timedelta(seconds=25))  # nothing new
    assert Job.objects.count() == 3
    # A second scheduler running alongside finds each tick taken.
    other = scheduler(every)
    other.start_up(now)
    other.fire_due(first + timedelta(seconds=25))
    assert Job.objects.count() == 3


def test_disabled_ticks_are_skipped_and_re_enabling_does_not_catch_them_up():
    every = entry("every", schedule="every 10 seconds")
    now = timezone.now()
    s = scheduler(every)
    s.start_up(now)
    first = every.schedule.next(now)
    set_enabled(DB, "every", False)
    s.fire_due(first + timedelta(seconds=15))  # two ticks while disabled
    assert not RecurringExecution.objects.exists()
    set_enabled(DB, "every", True)
    assert RecurringTask.objects.get(key="every").active_since >= now
    # A restart right now: the latest due tick is before the re-enable, not caught up.
    scheduler(every).start_up(timezone.now())
    assert not RecurringExecution.objects.exists()
    # The running scheduler goes on with the ticks after the re-enable.
    later = first + timedelta(seconds=20)
    s.fire_due(later)
    assert list(RecurringExecution.objects.values_list("run_at", flat=True)) == [later]


def test_re_enabling_an_enabled_task_keeps_active_since():
    sync_recurring_tasks(DB, [entry()])
    since = RecurringTask.objects.get().active_since
    set_enabled(DB, "nightly", True)
    assert RecurringTask.objects.get().active_since == since


def test_the_scheduler_sleeps_until_the_next_tick_at_most_the_interval():
    every = entry("every", schedule="every 1 second")
    now = timezone.now()
    s = scheduler(every)
    s.start_up(now)
    assert 0 <= s.delay(now) <= 1.01
    s.seen["every"] = every.schedule.latest(now) + timedelta(hours=1)
    assert s.delay(now) == s.conf.dispatcher_interval


# --- run now ----------------------------------------------------------------------------


@override_settings(DJANGO_JOBS={"recurring": {"nightly": NIGHTLY}})
def test_run_now_enqueues_outside_the_tick_series():
    job_id = run_now(DB, "nightly")
    execution = RecurringExecution.objects.get()
    assert execution.job_id == job_id and execution.run_at.microsecond != 0
    assert Job.objects.get(pk=job_id).args == ["nightly"]
    row = RecurringTask.objects.get(key="nightly")
    assert row.last_job_id == job_id
    # The tick of that same second is still free.
    nightly = entry()
    assert enqueue_tick(DB, nightly, execution.run_at) is not None
    # Disabled or not, an explicit request runs.
    set_enabled(DB, "nightly", False)
    assert run_now(DB, "nightly") is not None
    assert Job.objects.count() == 3
    with pytest.raises(LookupError):
        run_now(DB, "missing")


# --- the task's backend -----------------------------------------------------------------


def noop() -> None:
    """A module-level function, as Django requires of a task, for the dummy backend."""


@override_settings(
    TASKS={
        "default": {"BACKEND": "django_jobs.backend.JobsBackend", "QUEUES": []},
        "dummy": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"},
    }
)
def test_a_task_on_another_backend_is_refused(monkeypatch):
    """Its job would not be in the tick's transaction: exactly-once would not hold."""
    elsewhere = task(backend="dummy")(noop)
    monkeypatch.setattr(sys.modules[__name__], "elsewhere", elsewhere, raising=False)
    foreign = entry(task=f"{__name__}.elsewhere", args=[])
    with pytest.raises(ImproperlyConfigured, match="must use a django-jobs backend"):
        enqueue_tick(DB, foreign, foreign.schedule.latest(timezone.now()))
    assert not RecurringExecution.objects.exists()
    errors = check_ids({"x": {"task": f"{__name__}.elsewhere", "schedule": "@daily"}})
    assert errors == ["django_jobs.E020"]


def test_parse_entry_refuses_what_the_checks_report():
    with pytest.raises(ImproperlyConfigured, match="needs 'task' and 'schedule'"):
        parse_entry("x", {"task": "tests.tasks.add"})
    with pytest.raises(ImproperlyConfigured, match="Bad hour"):
        parse_entry("x", {"task": "tests.tasks.add", "schedule": "0 25 * * *"})
    with pytest.raises(ImproperlyConfigured, match="unknown key"):
        parse_entry("x", {"task": "tests.tasks.add", "schedule": "@daily", "queue": "a"})


# --- system checks ----------------------------------------------------------------------


def check_ids(recurring_setting) -> list[str]:
    with override_settings(DJANGO_JOBS={"recurring": recurring_setting}):
        return sorted(error.id for error in backend_checks(task_backends["default"]))


GOOD = {"task": "tests.tasks.add", "schedule": "every 5 minutes", "args": [1, 2]}


@pytest.mark.parametrize(
    ("setting", "ids"),
    [
        ({"ok": GOOD}, []),
        (
            {
                "ok": {
                    **GOOD,
                    "schedule": "0 3 * * MON",
                    "timezone": "Europe/Paris",
                    "kwargs": {},
                    "queue_name": "reports",
                    "priority": -5,
                    "description": "a report",
                }
            },
            [],
        ),
        (["not", "a", "dict"], ["django_jobs.E010"]),
        ({"x": "0 3 * * *"}, ["django_jobs.E010"]),
        ({"x": {**GOOD, "queue": "reports"}}, ["django_jobs.E011"]),
        ({"x": {"task": "tests.tasks.add", "args": [1, 2]}}, ["django_jobs.E012"]),
        ({"x": {"schedule": "@daily"}}, ["django_jobs.E012"]),
        ({"x": {**GOOD, "schedule": "0 3 * *"}}, ["django_jobs.E013"]),
        ({"x": {**GOOD, "schedule": "every 0 seconds"}}, ["django_jobs.E013"]),
        ({"x": {**GOOD, "schedule": 0.5}}, ["django_jobs.E013"]),
        ({"x": {**GOOD, "timezone": "Europe/Atlantis"}}, ["django_jobs.E014"]),
        ({"x": {**GOOD, "task": "tests.tasks.missing"}}, ["django_jobs.E015"]),
        ({"x": {**GOOD, "task": "no_such_module.task"}}, ["django_jobs.E015"]),
        ({"x": {**GOOD, "task": "tests.tasks.not_a_task"}}, ["django_jobs.E015"]),
        ({"x": {**GOOD, "args": [object()]}}, ["django_jobs.E016"]),
        ({"x": {**GOOD, "kwargs": {"when": timedelta(1)}}}, ["django_jobs.E016"]),
        ({"x": {**GOOD, "args": "1, 2"}}, ["django_jobs.E016"]),
        ({"x": {**GOOD, "queue_name": "nowhere"}}, ["django_jobs.E017"]),
        ({"k" * 129: GOOD}, ["django_jobs.E018"]),
        ({"": GOOD}, ["django_jobs.E018"]),
        ({"x": {**GOOD, "priority": 101}}, ["django_jobs.E019"]),
        ({"x": {**GOOD, "priority": "high"}}, ["django_jobs.E019"]),
        (
            {"x": {"task": "tests.tasks.missing", "schedule": "nope", "bad": 1}},
            ["django_jobs.E011", "django_jobs.E013", "django_jobs.E015"],
        ),
    ],
)
def test_system_checks(setting, ids):
    assert check_ids(setting) == ids


def test_checks_name_the_entry_and_the_problem():
    with override_settings(
        DJANGO_JOBS={"recurring": {"nightly": {**GOOD, "timezone": "Europe/Atlantis"}}}
    ):
        (error,) = backend_checks(task_backends["default"])
    assert "DJANGO_JOBS['recurring']['nightly']" in error.msg
    assert "Europe/Atlantis" in error.msg


def test_default_time_zone_is_the_projects():
    with override_settings(TIME_ZONE="Europe/Paris"):
        nightly = entry()
        assert nightly.time_zone == "Europe/Paris"
        assert recurring.default_time_zone() == "Europe/Paris"
    assert nightly.schedule.zone.key == "Europe/Paris"


# --- a database outage ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_scheduler_survives_a_database_error_and_starts_over(monkeypatch, caplog):
    """A lost connection mid-tick: it backs off, reconnects, and applies the start-up rule,
    which enqueues the tick whose transaction was lost."""
    every = entry("every", schedule="every day")
    sync_recurring_tasks(DB, [every])
    activate("every", timezone.now() - 2 * DAY)
    failed: list = []

    def flaky(db, e, tick):
        if not failed:
            failed.append(tick)
            raise OperationalError("server closed the connection unexpectedly")
        return enqueue_tick(db, e, tick)

    monkeypatch.setattr(scheduler_module, "enqueue_tick", flaky)
    lifecycle = Lifecycle()
    s = Scheduler(JobsSettings.load(recurring={"every": {}}), lifecycle, entries=[every])

    def run() -> None:
        try:
            s.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    with caplog.at_level(logging.WARNING, "django_jobs.scheduler"):
        thread.start()
        try:
            wait_until(lambda: RecurringExecution.objects.exists(), 10, what="a tick enqueued")
        finally:
            lifecycle.request_stop()
            thread.join(10)
    assert not thread.is_alive()
    assert "database unavailable" in caplog.text
    # The start-up's tick failed; the start-up after the error enqueued that same tick, once.
    (execution,) = RecurringExecution.objects.all()
    assert execution.run_at == failed[0] == every.schedule.latest(timezone.now())
    assert list(Job.objects.values_list("pk", flat=True)) == [execution.job_id]


def test_a_stalled_scheduler_catches_up_the_latest_tick_only(monkeypatch):
    """A pass far behind (a suspended process) gets the start-up rule, not a burst."""
    every = entry("every", schedule="every 10 seconds")
    now = timezone.now()
    s = scheduler(every)
    s.start_up(now)
    assert not s.stalled(now)
    resumed = now + timedelta(minutes=10)
    assert s.stalled(resumed)
    monkeypatch.setattr(scheduler_module.timezone, "now", lambda: resumed)
    monkeypatch.setattr(s.lifecycle, "sleep", lambda seconds: s.lifecycle.stopping.set())
    s.run()  # one pass: its sleep stops it
    (tick,) = RecurringExecution.objects.values_list("run_at", flat=True)
    assert tick == every.schedule.latest(resumed)
    assert Job.objects.count() == 1
