"""Schedules of recurring tasks: parse one, find its latest tick <= t and its next tick > t.

Two forms:

- **cron**: five fields (minute hour day-of-month month day-of-week) or an @-alias,
  evaluated by ``cronsim`` in a time zone, with Debian cron's rules across DST changes
  (a fixed-time job skipped by a spring-forward runs at the first minute after the
  gap; one in an autumn fold runs once, at the first occurrence);
- **interval**: ``"every 30 seconds"``, ``"every 5 minutes"``, ``"every 2 hours"``,
  ``"every day"``, a number of seconds or a ``timedelta`` (>= 1 s). Ticks are
  whole multiples of the interval since the Unix epoch (UTC), so every scheduler,
  wherever and whenever it started, computes the same instants.

Every tick is an aware UTC datetime truncated to whole seconds: that instant is
the ``run_at`` of the unique ``RecurringExecution`` row, so two schedulers must
agree on it to the microsecond.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from django_jobs.limits import MAX_SECONDS

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SECOND = timedelta(seconds=1)
MICROSECONDS = 1_000_000

# cronsim has no @-aliases; these are cron(8)'s. @reboot has no meaning here.
CRON_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
EVERY = re.compile(r"^every\s+(?:(\d+)\s+)?(second|minute|hour|day)(s?)$", re.IGNORECASE)


class ScheduleError(ValueError):
    """A schedule or time zone that cannot be understood."""


def parse_time_zone(name: str) -> ZoneInfo:
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"time zone must be a non-empty string, not {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ScheduleError(f"unknown time zone {name!r}") from exc


def whole_second(moment: datetime) -> datetime:
    """``moment`` in UTC without its microseconds (refuses naive datetimes)."""
    if moment.tzinfo is None:
        raise ValueError("schedules work on aware datetimes only")
    return moment.astimezone(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class CronSchedule:
    expression: str
    zone: ZoneInfo

    @property
    def text(self) -> str:
        return self.expression

    def latest(self, moment: datetime) -> datetime:
        """The latest tick at or before ``moment``."""
        limit = whole_second(moment)
        # cronsim's reverse iteration yields ticks strictly before its start.
        for tick in CronSim(self.cron, (limit + SECOND).astimezone(self.zone), reverse=True):
            found = whole_second(tick)
            # The DST fix-up can move a tick forward past the start; skip those.
            if found <= limit:
                # In an autumn fold, reverse iteration can skip today's tick of a
                # fixed-time cron and give yesterday's: step forward to the real latest.
                following = self.next(found)
                while following <= limit:
                    found, following = following, self.next(following)
                return found
        raise AssertionError("unreachable: cronsim iterates forever")  # pragma: no cover

    def next(self, moment: datetime) -> datetime:
        """The first tick strictly after ``moment``."""
        limit = whole_second(moment)
        for tick in CronSim(self.cron, limit.astimezone(self.zone)):
            found = whole_second(tick)
            if found > limit:
                return found
        raise AssertionError("unreachable: cronsim iterates forever")  # pragma: no cover

    @property
    def cron(self) -> str:
        return CRON_ALIASES.get(self.expression.lower(), self.expression)


@dataclass(frozen=True)
class IntervalSchedule:
    """Ticks at ``floor(k * interval)`` seconds after the epoch, in integer microseconds.

    Integer arithmetic (not floats) so that a tick is the same instant on every
    machine; truncating to whole seconds keeps ticks distinct since interval >= 1 s.
    """

    interval: timedelta

    @property
    def text(self) -> str:
        seconds = self.interval / SECOND
        return f"every {seconds:g} seconds" if seconds != 1 else "every 1 second"

    @property
    def step(self) -> int:
        return self.interval // timedelta(microseconds=1)

    def tick(self, k: int) -> datetime:
        return EPOCH + timedelta(seconds=(k * self.step) // MICROSECONDS)

    def latest(self, moment: datetime) -> datetime:
        # floor(k*step / 1e6) <= s  <=>  k*step < (s+1)*1e6
        seconds = int((whole_second(moment) - EPOCH) / SECOND)
        return self.tick(((seconds + 1) * MICROSECONDS - 1) // self.step)

    def next(self, moment: datetime) -> datetime:
        # floor(k*step / 1e6) > s  <=>  k*step >= (s+1)*1e6
        seconds = int((whole_second(moment) - EPOCH) / SECOND)
        return self.tick(-(-((seconds + 1) * MICROSECONDS) // self.step))


type Schedule = CronSchedule | IntervalSchedule


def parse_schedule(value: object, time_zone: str = "UTC") -> Schedule:
    """A schedule from settings; ``time_zone`` matters to cron expressions only."""
    if isinstance(value, bool):
        raise ScheduleError(f"schedule must be a cron expression or an interval, not {value!r}")
    if isinstance(value, timedelta):
        return interval(value)
    if isinstance(value, int | float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ScheduleError(f"interval must be a finite number of seconds, not {value!r}")
        # Before timedelta(), which overflows (or cannot even print the int) first.
        if isinstance(value, int) and value.bit_length() > 64:
            shown = f"an integer of {value.bit_length()} bits"
        else:
            shown = f"{value:g} seconds"
        if value < 1:
            raise ScheduleError(f"interval must be at least 1 second, not {shown}")
        if value > MAX_SECONDS:
            raise too_long(shown)
        return interval(timedelta(seconds=value))
    if not isinstance(value, str):
        raise ScheduleError(
            f"schedule must be a cron expression, an 'every ...' interval, a number of "
            f"seconds or a timedelta, not {type(value).__name__}"
        )
    text = " ".join(value.split())
    match = EVERY.match(text)
    if match:
        count, unit, plural = match.groups()
        if count is None and plural:
            raise ScheduleError(f"{value!r}: say 'every N {unit}s' or 'every {unit}'")
        digits = (count or "1").lstrip("0") or "0"
        # More digits than a century has seconds: too long, and past int()'s digit limit.
        if len(digits) > 10:
            raise too_long(f"{text[:40]!r}")
        seconds = int(digits) * UNITS[unit.lower()]
        if seconds > MAX_SECONDS:
            raise too_long(repr(text))
        return interval(timedelta(seconds=seconds))
    if text.lower().startswith("every"):
        raise ScheduleError(
            f"{value!r} is not an interval; use 'every N seconds|minutes|hours|days'"
        )
    return cron(text, time_zone)


def interval(value: timedelta) -> IntervalSchedule:
    if value < SECOND:
        raise ScheduleError(f"interval must be at least 1 second, not {value}")
    if value.total_seconds() > MAX_SECONDS:
        raise too_long(str(value))
    return IntervalSchedule(value)


def too_long(what: str) -> ScheduleError:
    """Every tick is a datetime: one more than a century away is a mistake, and past
    year 9999 one that no scheduler could compute."""
    return ScheduleError(
        f"interval must be at most {MAX_SECONDS / 86400:,.0f} days (about a century), not {what}"
    )


def cron(expression: str, time_zone: str) -> CronSchedule:
    zone = parse_time_zone(time_zone)
    if expression.startswith("@"):
        if expression.lower() not in CRON_ALIASES:
            raise ScheduleError(
                f"unknown cron alias {expression!r}; known: {', '.join(sorted(CRON_ALIASES))}"
            )
    elif len(expression.split()) != 5:
        raise ScheduleError(
            f"cron expression {expression!r} must have 5 fields "
            "(minute hour day-of-month month day-of-week)"
        )
    schedule = CronSchedule(expression, zone)
    try:
        CronSim(schedule.cron, datetime.now(zone))
    except CronSimError as exc:
        raise ScheduleError(f"bad cron expression {expression!r}: {exc}") from exc
    return schedule
