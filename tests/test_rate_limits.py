"""Rate limits per period: declaration, the window's arithmetic, the start path, races,
and real worker processes audited window by window."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.core.checks import run_checks
from django.db import connection
from django.tasks.exceptions import InvalidTask
from django.test import override_settings
from django.utils import timezone

from django_jobs import cancel
from django_jobs import task as jobs_task
from django_jobs.core import starting
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.rate_limits import Window
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_jobs
from django_jobs.models import (
    BlockedExecution,
    FailedExecution,
    Job,
    JobStatus,
    RateLimit,
    ReadyExecution,
    ScheduledExecution,
)
from django_jobs.tasks.rates import Rate, parse_rate
from testproject.demo.models import AuditEvent
from tests import rate_tasks
from tests.harness import most_in_any_period, wait_until
from tests.test_races import Paused, Runner, wait_for

DB = "default"
ALL = QueueSelector(("*",))


def echo(value: int) -> int:
    return value


def takes_account(account: str) -> str:
    return account


# --- declaration and settings --------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("10/parsec", "unknown period unit 'parsec'"),
        ("0/s", "between 1 and 10,000"),
        ("20000/s", "between 1 and 10,000"),
        ("ten/m", "is not a rate like"),
        ("10/0s", "longer than 0"),
        ("no-such-limit", "neither a rate like '10/m' nor a name"),
        ("partner-apj", "Did you mean 'partner-api'?"),
    ],
)
def test_a_bad_rate_fails_at_declaration(spec, message):
    with pytest.raises(InvalidTask, match=message):
        jobs_task(echo, rate_limit=spec)


def test_rate_key_needs_a_rate_and_names_real_arguments():
    with pytest.raises(InvalidTask, match="rate_key needs a rate_limit"):
        jobs_task(echo, rate_key="{value}")
    with pytest.raises(InvalidTask, match="names 'account'"):
        jobs_task(echo, rate_limit="1/s", rate_key="{account}")
    with pytest.raises(TypeError, match="Did you mean 'rate_limit'"):
        jobs_task(echo, rate_limt="1/s")


@pytest.mark.parametrize(
    "text, rate",
    [
        ("10/m", Rate(10, 60.0)),
        ("100/5s", Rate(100, 5.0)),
        (" 3 / 2 hours ", Rate(3, 7200.0)),
        ("1/0.5s", Rate(1, 0.5)),
        ("5000/d", Rate(5000, 86400.0)),
    ],
)
def test_rates_read_as_written(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.django_db
def test_a_bad_named_rate_is_a_system_check_error_naming_it():
    with override_settings(DJANGO_JOBS={"rate_limits": {"stripe": "100/parsec", "ok": "1/s"}}):
        errors = [e for e in run_checks() if e.id == "django_jobs.E022"]
    assert [e.msg for e in errors] == [
        "DJANGO_JOBS['rate_limits']: 'stripe': '100/parsec': unknown period unit 'parsec'; "
        "use s, m, h or d (e.g. '10/m', '100/5s')."
    ]
    with override_settings(DJANGO_JOBS={"rate_limits": ["100/s"]}):
        assert [e.id for e in run_checks() if e.id == "django_jobs.E022"] == ["django_jobs.E022"]


# --- the window's arithmetic (no database) --------------------------------------------


def fresh_window() -> Window:
    return Window(RateLimit(key="k"))


@pytest.mark.parametrize("seed", range(5))
def test_no_period_ever_holds_more_than_n_starts(seed):
    """Random arrivals, random lateness of waiting jobs: admitted starts, wherever a
    window is placed, never exceed the limit."""
    rng = random.Random(seed)
    rate = Rate(rng.randint(1, 5), rng.choice([0.5, 1.0, 3.0]))
    window = fresh_window()
    clock, admitted, waiting = 0.0, [], []  # waiting: (due, reserved)
    for _ in range(3000):
        clock += rng.expovariate(20.0)
        due = [w for w in waiting if w <= clock]
        waiting = [w for w in waiting if w > clock]
        arrivals = [(t + rng.uniform(0, 0.2), t) for t in due]  # late by up to 0.2 s
        arrivals += [(clock, None)] * rng.randint(0, 2)
        for at, reserved in sorted(arrivals, key=lambda arrival: arrival[0]):
            decision = window.decide(max(at, clock), rate, reserved)
            if decision.admitted:
                admitted.append(decision.at)
            else:
                assert decision.at >= clock
                waiting.append(decision.at)
    assert len(admitted) > rate.limit * 10
    assert most_in_any_period(admitted, rate.period) == rate.limit


def test_a_backlog_is_planned_one_window_after_another():
    window, rate = fresh_window(), Rate(2, 60.0)
    decisions = [window.decide(1000.0, rate) for _ in range(7)]
    assert [d.admitted for d in decisions] == [True, True] + [False] * 5
    assert [d.at for d in decisions] == [1000.0, 1000.0, 1060.0, 1060.0, 1120.0, 1120.0, 1180.0]
    # A newcomer queues behind the plan, even once the first window has passed.
    late = window.decide(1061.0, rate)
    assert not late.admitted and late.at == 1180.0
    # A job whose planned time came is checked against the real starts only.
    assert window.decide(1060.5, rate, reserved=1060.0).admitted


def test_recorded_starts_never_go_back_in_time():
    """A worker whose clock is behind the last recorded start is stamped after it."""
    window, rate = fresh_window(), Rate(5, 1.0)
    assert window.decide(100.0, rate).at == 100.0
    assert window.decide(99.5, rate).at == 100.0


# --- the start path, on every database ------------------------------------------------


@pytest.fixture
def worker(transactional_db):
    return register_process(DB, "worker")


def claim_and_start(worker, limit: int = 10) -> tuple[list[Job], list[Job]]:
    jobs = claim_jobs(DB, worker.pk, ALL, limit)
    return jobs, start_jobs(DB, jobs, worker.pk, worker.name)


def test_jobs_over_the_limit_wait_without_an_attempt(worker):
    ids = [int(rate_tasks.once_a_minute.enqueue(i).id) for i in range(4)]
    claimed, started = claim_and_start(worker)
    assert [job.pk for job in started] == ids[:1]
    waiting = Job.objects.filter(pk__in=ids[1:]).order_by("pk")
    assert {job.status for job in waiting} == {JobStatus.SCHEDULED}
    assert {job.attempts for job in waiting} == {0}
    first_start = Job.objects.get(pk=ids[0]).last_attempted_at
    planned = [job.rate_reserved_at for job in waiting]
    assert planned == [first_start + timedelta(minutes=n) for n in (1, 2, 3)]
    assert [
        row.scheduled_at for row in ScheduledExecution.objects.filter(job_id__in=ids[1:])
    ] == planned
    # The caller's copies say so too: the worker drops them quietly.
    sent_back = [job for job in claimed if job.pk in ids[1:]]
    assert [job.status for job in sent_back] == [JobStatus.SCHEDULED] * 3
    row = RateLimit.objects.get(key="tests.rate_tasks.once_a_minute")
    assert (row.limit, row.period, len(row.starts)) == (1, 60.0, 1)


def test_a_waiting_job_due_in_a_full_window_waits_for_the_opening_not_the_queue(worker):
    """It was promised its time: it comes back when the real starts allow, while a
    newcomer goes to the back of the plan."""
    first, second, third = (int(rate_tasks.once_a_minute.enqueue(i).id) for i in range(3))
    claim_and_start(worker)
    # The second job's time comes; a late start (the first one's, moved on a little)
    # still fills the window, as a start that ran late would.
    row = RateLimit.objects.get()
    row.starts = [row.starts[0] + 30.0]
    row.save()
    ScheduledExecution.objects.filter(job_id=second).update(scheduled_at=timezone.now())
    assert promote_due_jobs(DB, 10) == 1
    _, started = claim_and_start(worker)
    assert started == []
    job = Job.objects.get(pk=second)
    assert job.status == JobStatus.SCHEDULED and job.attempts == 0
    expected = row.starts[0] + 60.0
    assert job.rate_reserved_at.timestamp() == pytest.approx(expected)
    # The newcomer's place in the plan is untouched, and after the returning job's.
    first_start = Job.objects.get(pk=first).last_attempted_at
    assert Job.objects.get(pk=third).rate_reserved_at == first_start + timedelta(minutes=2)
    assert job.rate_reserved_at < first_start + timedelta(minutes=2)


def test_a_named_limit_is_shared_by_every_task_naming_it(worker):
    for _ in range(3):
        rate_tasks.partner_report.enqueue()
    with override_settings(DJANGO_JOBS={"rate_limits": {"partner-api": "2/h"}}):
        rate_tasks.partner_call.enqueue("acct-1")
        rate_tasks.partner_call.enqueue("acct-1")
    keys = sorted(set(Job.objects.values_list("rate_key", flat=True)))
    assert keys == ["partner-api", "partner-api/acct-1"]
    assert set(Job.objects.values_list("rate_limit", "rate_period")) == {(5, 1.0), (2, 3600.0)}
    _, started = claim_and_start(worker)
    # Five per second for the reports (three fit), two per hour for acct-1 (both fit).
    assert len(started) == 5
    with override_settings(DJANGO_JOBS={"rate_limits": {"partner-api": "2/h"}}):
        rate_tasks.partner_call.enqueue("acct-1")
    _, started = claim_and_start(worker)
    assert started == []


def test_a_job_sent_back_frees_its_concurrency_slot(worker):
    """Keyed and rated: waiting for the window, it holds no slot, so the next job
    of its concurrency key is promoted at once (and waits for the window in turn)."""
    ids = [int(rate_tasks.keyed_and_rated.enqueue("a").id) for _ in range(2)]
    rate_tasks.keyed_and_rated.enqueue("b")
    RateLimit.objects.create(
        key="tests.rate_tasks.keyed_and_rated",
        limit=2,
        period=1.0,
        starts=[timezone.now().timestamp()] * 2,
        planned=[],
    )
    _, started = claim_and_start(worker)
    assert started == []
    assert Job.objects.get(pk=ids[0]).status == JobStatus.SCHEDULED
    assert Job.objects.get(pk=ids[1]).status == JobStatus.READY
    assert not BlockedExecution.objects.exists()
    assert ReadyExecution.objects.filter(job_id=ids[1]).exists()


def test_a_job_cancelled_while_claimed_ends_instead_of_waiting(worker):
    ids = [int(rate_tasks.once_a_minute.enqueue(i).id) for i in range(2)]
    claimed = claim_jobs(DB, worker.pk, ALL, 10)
    assert cancel(str(ids[1])) == "requested"
    started = start_jobs(DB, claimed, worker.pk, worker.name)
    assert [job.pk for job in started] == ids[:1]
    job = Job.objects.get(pk=ids[1])
    assert (job.status, job.attempts) == (JobStatus.FAILED, 0)
    assert FailedExecution.objects.get(job_id=ids[1]).exception_class_path.endswith("JobCancelled")
    assert not ScheduledExecution.objects.exists()


def test_a_waiting_job_can_be_cancelled(worker):
    ids = [int(rate_tasks.once_a_minute.enqueue(i).id) for i in range(2)]
    claim_and_start(worker)
    assert cancel(str(ids[1])) == "cancelled"
    assert Job.objects.get(pk=ids[1]).status == JobStatus.FAILED


# --- two starts at once: the row lock decides -----------------------------------------

races = pytest.mark.skipif(
    "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
)


def by_transaction(monkeypatch) -> None:
    """Starts decided by the transaction (``starting.start_locked``) on every database, not
    first by PostgreSQL's one statement (tests/test_rate_limits_one_statement.py races that)."""
    monkeypatch.setattr(starting, "start_in_one_statement", lambda *args: None)


def race_two_starters(monkeypatch, pause_after=(starting, "lock_rate_limits")) -> int:
    """Two workers start one job each of a key allowed one start a minute, by the
    transaction; the first is paused once ``pause_after`` (module, name) has returned."""
    by_transaction(monkeypatch)
    rate_tasks.once_a_minute.enqueue(1)
    rate_tasks.once_a_minute.enqueue(2)
    first_worker, second_worker = register_process(DB, "worker"), register_process(DB, "worker")
    (first_job,) = claim_jobs(DB, first_worker.pk, ALL, 1)
    (second_job,) = claim_jobs(DB, second_worker.pk, ALL, 1)
    paused = Paused(monkeypatch, *pause_after)
    first = Runner(lambda: start_jobs(DB, [first_job], first_worker.pk, first_worker.name), paused)
    first.start()
    assert paused.reached.wait(10)  # read the window, not yet written it back
    second = Runner(lambda: start_jobs(DB, [second_job], second_worker.pk, second_worker.name))
    second.start()
    wait_for(second.blocked_or_done, "the second start")
    paused.resume.set()
    return len(first.finish()) + len(second.finish())


@races
@pytest.mark.django_db(transaction=True)
def test_two_workers_starting_at_once_take_one_start_between_them(monkeypatch):
    assert race_two_starters(monkeypatch) == 1
    assert Job.objects.filter(status=JobStatus.RUNNING).count() == 1
    assert Job.objects.filter(status=JobStatus.SCHEDULED, attempts=0).count() == 1


@races
@pytest.mark.django_db(transaction=True)
def test_unprotected_two_workers_both_start(monkeypatch):
    """The twin: the window read without its row lock lets both through."""

    def read_without_lock(db, keys):
        rows = RateLimit.objects.using(db).filter(key__in=sorted(set(keys)))
        return {row.key: Window(row) for row in rows}

    monkeypatch.setattr(starting, "lock_rate_limits", read_without_lock)
    assert race_two_starters(monkeypatch) == 2


def race_prune_and_start(monkeypatch) -> RateLimit | None:
    """A key idle for days: maintenance reads it as forgettable, then a start of it
    commits, then maintenance deletes. Returns the key's row after both."""
    from django_jobs.core import maintenance

    worker = register_process(DB, "worker")
    job_id = int(rate_tasks.once_a_minute.enqueue(1).id)
    key = Job.objects.get(pk=job_id).rate_key
    days_ago = timezone.now() - timedelta(days=3)
    RateLimit.objects.create(
        key=key, period=60.0, starts=[days_ago.timestamp()], planned=[], updated_at=days_ago
    )
    (job,) = claim_jobs(DB, worker.pk, ALL, 1)
    paused = Paused(monkeypatch, maintenance, "delete_forgettable", before=True)
    pruner = Runner(lambda: maintenance.prune_rate_limits(DB), paused)
    pruner.start()
    assert paused.reached.wait(10)  # the candidates read, nothing locked or deleted yet
    assert [started.pk for started in start_jobs(DB, [job], worker.pk, worker.name)] == [job_id]
    paused.resume.set()
    pruner.finish()
    return RateLimit.objects.filter(key=key).first()


@races
@pytest.mark.django_db(transaction=True)
def test_a_prune_never_forgets_a_start_recorded_after_it_read(monkeypatch):
    row = race_prune_and_start(monkeypatch)
    assert row is not None, "the start's row was deleted: its key would begin an empty window"
    started = Job.objects.get().last_attempted_at.timestamp()
    assert started in row.starts


@races
@pytest.mark.django_db(transaction=True)
def test_unprotected_a_prune_deleting_what_it_read_forgets_the_start(monkeypatch):
    """The twin: deleting by id what the unlocked read found, without deciding again."""
    from django_jobs.core import maintenance

    def delete_as_read(db, keys, now):
        return RateLimit.objects.using(db).filter(key__in=keys).delete()[0]

    monkeypatch.setattr(maintenance, "delete_forgettable", delete_as_read)
    assert race_prune_and_start(monkeypatch) is None


# --- real worker processes ----------------------------------------------------------------


def starts_by_key(ids: list[int]) -> dict[str, list[float]]:
    """Each job's recorded start (the time its rate was checked at), by rate key."""
    by_key: dict[str, list[float]] = {}
    for key, started in Job.objects.filter(pk__in=ids).values_list("rate_key", "last_attempted_at"):
        by_key.setdefault(key, []).append(started.timestamp())
    return by_key


@pytest.mark.workers
def test_workers_under_load_never_start_more_than_n_in_any_window(run_jobs):
    """Two processes of four threads, 45 jobs over three keys at 3 per second: every
    job runs once, without a wasted attempt, and no second holds more than three
    starts of a key, wherever the second begins."""
    rate = parse_rate("3/s")
    ids = [int(rate_tasks.call_api.enqueue(f"acct-{i % 3}").id) for i in range(45)]
    began = timezone.now()
    proc = run_jobs(
        "--processes",
        "2",
        "--threads",
        "4",
        env={"JOBS_DISPATCHER_INTERVAL": "0.2", "JOBS_POLLING_INTERVAL": "0.05"},
    )
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status=JobStatus.SUCCEEDED).count() == 45,
        timeout=90,
        what="all 45 jobs to succeed",
    )
    elapsed = (timezone.now() - began).total_seconds()
    proc.close()
    assert set(Job.objects.filter(pk__in=ids).values_list("attempts", flat=True)) == {1}
    assert not FailedExecution.objects.filter(job_id__in=ids).exists()
    by_key = starts_by_key(ids)
    assert sorted(len(times) for times in by_key.values()) == [15, 15, 15]
    worst = {key: most_in_any_period(times, rate.period) for key, times in by_key.items()}
    # Fixed windows too (each whole second), the way a provider's counter sees them.
    per_second = {}
    for key, times in by_key.items():
        for t in times:
            per_second[key, int(t)] = per_second.get((key, int(t)), 0) + 1
    over = [window for window, n in per_second.items() if n > rate.limit]
    body = {}
    for key, started in AuditEvent.objects.filter(job_id__in=ids).values_list("key", "started"):
        body.setdefault(key, []).append(started)
    body_worst = {key: most_in_any_period(times, rate.period) for key, times in body.items()}
    print(
        f"\n{connection.vendor}: 45 jobs, 3 keys at 3/s, 2x4 threads: {elapsed:.1f}s "
        f"(ideal ~5s); most recorded starts of a key in any 1s: {max(worst.values())}; "
        f"fixed seconds over 3: {len(over)}; most body starts in any 1s: "
        f"{max(body_worst.values())}"
    )
    assert max(worst.values()) == rate.limit
    assert over == []


# --- the admin's page -----------------------------------------------------------------------


def test_the_admin_shows_each_key_its_window_next_opening_and_waiting_jobs(admin_client, worker):
    from django.urls import reverse

    ids = [int(rate_tasks.once_a_minute.enqueue(i).id) for i in range(3)]
    claim_and_start(worker)
    first_start = Job.objects.get(pk=ids[0]).last_attempted_at
    response = admin_client.get(reverse("admin:django_jobs_ratelimitedkey_changelist"))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-key="tests.rate_tasks.once_a_minute"' in html
    assert 'class="jobs-rate-used">1</strong> of 1' in html
    assert 'class="jobs-rate-waiting">2</strong>' in html
    opening = timezone.localtime(first_start + timedelta(minutes=1))
    assert f'<time datetime="{opening.isoformat()}"' in html
    # The waiting jobs in the order they will run, each at its planned time.
    assert html.index(f">#{ids[1]}</a> at") < html.index(f">#{ids[2]}</a> at")
    # A waiting job's own page says what it waits for, and until when.
    page = admin_client.get(reverse("admin:django_jobs_job_change", args=[ids[1]]))
    planned = timezone.localtime(Job.objects.get(pk=ids[1]).rate_reserved_at)
    assert "waiting for its window, planned to start at" in page.content.decode()
    assert f'<time datetime="{planned.isoformat()}"' in page.content.decode()


def test_maintenance_prunes_only_rows_with_nothing_left_to_remember(transactional_db):
    from django_jobs.core.maintenance import prune_rate_limits

    now = timezone.now()
    day_ago = now - timedelta(days=1, minutes=1)
    clock = now.timestamp()
    rows = {
        "idle": (60.0, [clock - 90000], []),
        "daily, started 23h ago": (86400.0, [clock - 82800], []),
        "planned ahead": (60.0, [clock - 90000], [clock + 30]),
        "recent": (60.0, [clock - 10], []),
    }
    for key, (period, starts, planned) in rows.items():
        RateLimit.objects.create(
            key=key, period=period, starts=starts, planned=planned, updated_at=day_ago
        )
    RateLimit.objects.filter(key="recent").update(updated_at=now)
    assert prune_rate_limits(DB, now) == 1
    assert sorted(RateLimit.objects.values_list("key", flat=True)) == [
        "daily, started 23h ago",
        "planned ahead",
        "recent",
    ]
