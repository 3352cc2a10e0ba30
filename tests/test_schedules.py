"""Schedules: parsing, cron in a time zone across DST changes, interval anchoring, errors.

No database: a schedule is pure computation over aware datetimes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from django_jobs.tasks.schedules import (
    CronSchedule,
    IntervalSchedule,
    ScheduleError,
    parse_schedule,
)

PARIS = ZoneInfo("Europe/Paris")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def ticks(schedule, start: datetime, count: int) -> list[datetime]:
    found = []
    for _ in range(count):
        start = schedule.next(start)
        found.append(start)
    return found


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("every 30 seconds", 30),
        ("every 5 minutes", 300),
        ("every 2 hours", 7200),
        ("every day", 86400),
        ("every second", 1),
        ("Every  1   minute", 60),
        ("every 3 days", 3 * 86400),
        (45, 45),
        (2.5, 2.5),
        (timedelta(minutes=10), 600),
    ],
)
def test_intervals_parse(text, seconds):
    schedule = parse_schedule(text)
    assert isinstance(schedule, IntervalSchedule)
    assert schedule.interval == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("text", "cron"),
    [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("*/15 9-17 * * MON-FRI", "*/15 9-17 * * MON-FRI"),
    ],
)
def test_cron_expressions_and_aliases_parse(text, cron):
    schedule = parse_schedule(text, "Europe/Paris")
    assert isinstance(schedule, CronSchedule)
    assert schedule.cron == cron and schedule.zone == PARIS


def test_aliases_tick_like_their_expansion():
    start = utc(2026, 5, 17, 10, 20, 30)
    for alias in ("@hourly", "@daily", "@weekly", "@monthly", "@yearly"):
        schedule = parse_schedule(alias)
        expanded = parse_schedule(schedule.cron)
        assert ticks(schedule, start, 3) == ticks(expanded, start, 3)
    assert parse_schedule("@hourly").next(start) == utc(2026, 5, 17, 11)
    assert parse_schedule("@weekly").next(start) == utc(2026, 5, 24)  # a Sunday


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("61 * * * *", "Bad minute"),
        ("* * * *", "5 fields"),
        ("0 0 * * * *", "5 fields"),  # cronsim's seconds field is not cron
        ("@reboot", "unknown cron alias"),
        ("every 0 seconds", "at least 1 second"),
        ("every 3 weeks", "not an interval"),
        ("every minutes", "every N minutes"),
        ("every -5 minutes", "not an interval"),
        ("", "5 fields"),
        (0.5, "at least 1 second"),
        (0, "at least 1 second"),
        (-10, "at least 1 second"),
        (timedelta(milliseconds=999), "at least 1 second"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        # Past a century, and past what timedelta() or int() can even take.
        (1e20, "at most 36,600 days"),
        (10**20, "at most 36,600 days"),
        (-(10**400), "at least 1 second"),
        (3_162_240_001, "at most 36,600 days"),
        (timedelta(days=36_601), "at most 36,600 days"),
        ("every 36601 days", "at most 36,600 days"),
        ("every 99999999999999 days", "at most 36,600 days"),
        ("every " + "9" * 5000 + " seconds", "at most 36,600 days"),
        (True, "not True"),
        (None, "not NoneType"),
        (["0 3 * * *"], "not list"),
    ],
    ids=lambda value: repr(value)[:40],
)
def test_bad_schedules_are_refused_with_the_reason(value, message):
    with pytest.raises(ScheduleError, match=message):
        parse_schedule(value)


def test_a_century_is_the_longest_interval_and_its_ticks_are_datetimes():
    for value in ("every 36600 days", 36_600 * 86400, timedelta(days=36_600)):
        schedule = parse_schedule(value)
        now = datetime.now(UTC)
        assert schedule.latest(now) <= now < schedule.next(now) <= now + timedelta(days=36_600)


def test_an_unknown_time_zone_is_refused():
    with pytest.raises(ScheduleError, match="unknown time zone 'Mars/Olympus'"):
        parse_schedule("0 3 * * *", "Mars/Olympus")


def test_cron_runs_at_local_time_and_follows_the_dst_change():
    """03:00 in Paris is 02:00 UTC in winter and 01:00 UTC in summer: across the spring
    change (29 March 2026) the UTC instant moves by an hour, the local time does not."""
    schedule = parse_schedule("0 3 * * *", "Europe/Paris")
    found = ticks(schedule, utc(2026, 3, 27, 12), 4)
    assert found == [
        utc(2026, 3, 28, 2),  # CET, UTC+1
        utc(2026, 3, 29, 1),  # CEST from 02:00 that night, UTC+2
        utc(2026, 3, 30, 1),
        utc(2026, 3, 31, 1),
    ]
    assert all(t.astimezone(PARIS).hour == 3 for t in found)


def test_cron_in_the_spring_gap_runs_once_right_after_it():
    """02:30 does not exist in Paris on 29 March 2026: Debian cron runs it at 03:00."""
    schedule = parse_schedule("30 2 * * *", "Europe/Paris")
    found = ticks(schedule, utc(2026, 3, 28, 0), 3)
    assert found == [utc(2026, 3, 28, 1, 30), utc(2026, 3, 29, 1), utc(2026, 3, 30, 0, 30)]


def test_cron_in_the_autumn_fold_runs_once():
    """02:00-02:59 happens twice in Paris on 25 October 2026: a fixed-time job runs once."""
    schedule = parse_schedule("0 2 * * *", "Europe/Paris")
    found = ticks(schedule, utc(2026, 10, 24, 12), 2)
    assert found == [utc(2026, 10, 25, 0), utc(2026, 10, 26, 1)]


@pytest.mark.parametrize(
    ("expression", "zone", "moment", "latest"),
    [
        # 01:30 EDT (05:30 UTC) is that day's tick; at 06:15 UTC the clock reads 01:15 EST.
        ("30 1 * * *", "America/New_York", utc(2025, 11, 2, 6, 15), utc(2025, 11, 2, 5, 30)),
        ("0 2 * * *", "Europe/Paris", utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 0)),
    ],
)
def test_the_latest_tick_inside_the_autumn_fold_is_todays(expression, zone, moment, latest):
    """Reverse iteration alone gave the day before's tick here (a review found it)."""
    schedule = parse_schedule(expression, zone)
    assert schedule.latest(moment) == latest
    assert schedule.next(latest - timedelta(seconds=1)) == latest


def test_an_hourly_cron_ticks_every_real_hour_through_the_fold():
    schedule = parse_schedule("30 * * * *", "Europe/Paris")
    found = ticks(schedule, utc(2026, 10, 24, 23), 4)
    assert found == [utc(2026, 10, 24, 23, 30), *(utc(2026, 10, 25, h, 30) for h in (0, 1, 2))]


@pytest.mark.parametrize(
    "text", ["0 3 * * *", "30 2 * * *", "0 2 * * *", "*/7 * * * *", "every 90 seconds", 2.5]
)
def test_latest_and_next_agree_around_every_tick(text):
    """latest(t) <= t < next(t), and a tick is its own latest, across both DST changes."""
    schedule = parse_schedule(text, "Europe/Paris")
    for start in (utc(2026, 3, 28, 23), utc(2026, 10, 24, 23)):
        for tick in ticks(schedule, start, 30):
            assert schedule.latest(tick) == tick
            assert schedule.latest(tick + timedelta(microseconds=999_999)) == tick
            before = schedule.latest(tick - timedelta(seconds=1))
            assert before < tick and schedule.next(before) == tick
            assert schedule.next(tick - timedelta(microseconds=1)) == tick


def test_intervals_are_anchored_to_the_epoch_whenever_computed():
    """Two schedulers started at different instants compute the very same ticks."""
    schedule = parse_schedule("every 5 minutes")
    a = ticks(schedule, utc(2026, 5, 17, 10, 2, 13), 3)
    b = ticks(schedule, utc(2026, 5, 17, 10, 4, 59, 999_999), 3)
    assert a == b == [utc(2026, 5, 17, 10, 5), utc(2026, 5, 17, 10, 10), utc(2026, 5, 17, 10, 15)]
    assert parse_schedule("every day").next(utc(2026, 5, 17, 10)) == utc(2026, 5, 18)
    # 7 s does not divide a day: ticks follow the epoch, not midnight.
    seven = parse_schedule(7)
    tick = seven.next(utc(2026, 5, 17))
    assert int(tick.timestamp()) % 7 == 0


def test_fractional_intervals_give_whole_second_ticks_that_stay_distinct():
    schedule = parse_schedule(1.5)
    found = ticks(schedule, utc(2026, 1, 1), 4)  # the epoch offset is a multiple of 1.5 s
    assert found == [utc(2026, 1, 1, 0, 0, s) for s in (1, 3, 4, 6)]
    assert all(t.microsecond == 0 and t.tzinfo == UTC for t in found)


def test_ticks_are_aware_utc_whole_seconds():
    for schedule in (parse_schedule("*/5 * * * *", "Asia/Kolkata"), parse_schedule(3)):
        now = datetime(2026, 5, 17, 10, 2, 13, 123456, tzinfo=ZoneInfo("America/New_York"))
        for tick in (schedule.latest(now), schedule.next(now)):
            assert tick.tzinfo == UTC and tick.microsecond == 0
        assert schedule.latest(now) <= now < schedule.next(now)


def test_cron_in_a_half_hour_zone():
    """Kolkata is UTC+5:30: an hourly cron there ticks at half past each UTC hour."""
    schedule = parse_schedule("0 * * * *", "Asia/Kolkata")
    assert schedule.next(utc(2026, 5, 17, 10)) == utc(2026, 5, 17, 10, 30)


def test_naive_datetimes_are_refused():
    with pytest.raises(ValueError, match="aware"):
        parse_schedule("every minute").next(datetime(2026, 5, 17))
