"""The scheduler loop: enqueue each recurring task's ticks as they come due.

Catch-up policy (docs/recurring.md):

- while running, every tick that comes due is enqueued, each at most once
  (``enqueue_tick``'s unique row), however many schedulers run;
- on start, and again after the database was unreachable, only the *latest*
  due tick is enqueued, if it is after the task's ``active_since`` and has no
  execution row yet (a tick whose commit was lost when a scheduler died is
  enqueued then); older missed ticks are skipped and counted in the log;
- ticks at or before ``active_since`` (when the task was first seen, or
  re-enabled) are never enqueued, and disabled tasks are skipped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core.recurring import (
    RecurringEntry,
    enqueue_tick,
    has_execution,
    parse_entries,
    sync_recurring_tasks,
    task_rows,
)
from django_jobs.db.retry import DB_ERRORS
from django_jobs.models import Process, RecurringTask
from django_jobs.runtime.lifecycle import Lifecycle, loop_until_stopped
from django_jobs.runtime.registration import registered
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.scheduler")

# Missed ticks are counted for the log up to this many (an every-second task
# down for a day would otherwise mean 86,400 steps just to say so).
COUNT_LIMIT = 1000
# Waking this much after a tick, not exactly on it, so the clock reads past it.
LATE = 0.002
# A pass that starts this much later than the sleep allowed (a suspended process, a
# stalled machine) is a restart in all but name: it gets the start-up rule (latest tick
# only), not a burst of every tick missed meanwhile.
STALL_SECONDS = 60.0


class Scheduler:
    def __init__(
        self,
        conf: JobsSettings,
        lifecycle: Lifecycle,
        entries: list[RecurringEntry] | None = None,
    ) -> None:
        self.conf = conf
        self.db = conf.database
        self.lifecycle = lifecycle
        self.entries = parse_entries(conf.recurring) if entries is None else entries
        # Per task key: the latest tick this scheduler has dealt with.
        self.seen: dict[str, datetime] = {}
        self.started = False

    def run(self) -> None:
        loop_until_stopped(
            self.db,
            self.lifecycle,
            self.step,
            on_outage=self.restart,
            max_delay=self.conf.db_retry_max_delay,
            log=logger,
        )

    def step(self) -> float:
        """One pass; returns the seconds to sleep before the next."""
        if self.started and self.stalled(timezone.now()):
            logger.warning("scheduler stalled; catching up the latest ticks only")
            self.restart()
        if self.started:
            self.fire_due(timezone.now())
        else:
            self.start_up(timezone.now())
            self.started = True
        return self.delay(timezone.now())

    def restart(self) -> None:
        """Ticks that came due meanwhile (an outage, a stall) get the start-up rule."""
        self.started = False

    def start_up(self, now: datetime) -> None:
        """Sync the rows, then enqueue each task's latest due tick if it is still free."""
        sync_recurring_tasks(self.db, self.entries)
        rows = task_rows(self.db, self.keys())
        for entry in self.entries:
            latest = entry.schedule.latest(now)
            self.seen[entry.key] = latest
            row = rows[entry.key]
            if not row.enabled or latest <= row.active_since:
                continue
            since = max(row.active_since, row.last_run_at or row.active_since)
            skipped = count_ticks(entry, since, latest)
            if skipped:
                logger.warning(
                    "%s: skipping %s missed tick(s) before %s (only the latest is caught up)",
                    entry.key,
                    f"{skipped}+" if skipped >= COUNT_LIMIT else skipped,
                    latest.isoformat(),
                )
            self.fire(entry, latest)

    def stalled(self, now: datetime) -> bool:
        """Whether some task's next tick is overdue by more than a stall."""
        limit = STALL_SECONDS + self.conf.dispatcher_interval
        return any(
            (now - entry.schedule.next(self.seen[entry.key])).total_seconds() > limit
            for entry in self.entries
            if entry.key in self.seen
        )

    def fire_due(self, now: datetime) -> None:
        """Enqueue every tick that came due since the last pass."""
        rows = self.current_rows()
        for entry in self.entries:
            tick = entry.schedule.next(self.seen[entry.key])
            while tick <= now and not self.lifecycle.stopping.is_set():
                self.seen[entry.key] = tick
                row = rows[entry.key]
                if row.enabled and tick > row.active_since:
                    self.fire(entry, tick)
                tick = entry.schedule.next(tick)

    def fire(self, entry: RecurringEntry, tick: datetime) -> int | None:
        if has_execution(self.db, entry.key, tick):
            return None  # another scheduler was first; skip the doomed insert
        try:
            return enqueue_tick(self.db, entry, tick)
        except DB_ERRORS:
            raise
        except Exception:
            # A task that no longer imports, arguments it refuses: this tick is
            # lost, the next ones are tried again.
            logger.exception("could not enqueue %s for %s", entry.key, tick.isoformat())
            return None

    def current_rows(self) -> dict[str, RecurringTask]:
        """This pass's view of enabled/active_since (an operator may have changed them)."""
        rows = task_rows(self.db, self.keys())
        missing = [entry for entry in self.entries if entry.key not in rows]
        if missing:  # deleted by hand: recreate, active from now on
            sync_recurring_tasks(self.db, missing)
            rows.update(task_rows(self.db, [entry.key for entry in missing]))
        return rows

    def delay(self, now: datetime) -> float:
        """Seconds until the next tick of any task, at most ``dispatcher_interval``."""
        delay = self.conf.dispatcher_interval
        for entry in self.entries:
            if entry.key in self.seen:
                until = (entry.schedule.next(self.seen[entry.key]) - now).total_seconds()
                delay = min(delay, max(0.0, until + LATE))
        return delay

    def keys(self) -> list[str]:
        return [entry.key for entry in self.entries]


def count_ticks(entry: RecurringEntry, after: datetime, before: datetime) -> int:
    """Ticks strictly between ``after`` and ``before``, counted up to ``COUNT_LIMIT``."""
    count = 0
    tick = entry.schedule.next(after)
    while tick < before and count < COUNT_LIMIT:
        count += 1
        tick = entry.schedule.next(tick)
    return count


def run_scheduler(
    conf: JobsSettings,
    lifecycle: Lifecycle,
    *,
    supervisor_id: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Register as a scheduler process, run until stopped, deregister."""
    with registered(
        conf,
        lifecycle,
        Process.Kind.SCHEDULER,
        supervisor_id=supervisor_id,
        metadata={"recurring": sorted(conf.recurring), **(metadata or {})},
    ) as process:
        if process is None:
            return
        logger.info(
            "scheduler started: %s, %d recurring task(s)", process.name, len(conf.recurring)
        )
        Scheduler(conf, lifecycle).run()
    logger.info("scheduler stopped: %s", process.name)
