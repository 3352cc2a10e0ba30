"""``manage.py prune_jobs``: delete finished jobs older than an age, in small transactions.

The dispatcher already prunes on its own, every ``maintenance_interval``, what is older
than ``clear_finished_jobs_after``. This command runs the same pruning
(:func:`django_jobs.core.maintenance.prune_finished_jobs`) on demand: from cron when
``clear_finished_jobs_after`` is ``None``, with a shorter age after an incident
that piled up failures, for one status only, with an age per status, resting between
transactions beside busy workers (``--rest``), or as a dry run to see what would go.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core.maintenance import (
    PruneCounts,
    Retention,
    prune_finished_jobs,
    retention_cutoffs,
)
from django_jobs.limits import is_number
from django_jobs.models import FINISHED_STATUSES

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
# Older than any job: past it an age is a typo (and past timedelta's range a crash).
MAX_AGE = timedelta(days=100 * 366)
# Sleeping more than this per second of work would make a prune of millions last days.
MAX_REST = 100.0


def parse_age(value: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"``; a bare number is seconds. Zero is
    refused: it would take jobs that finished a moment ago, whose results a caller may be
    about to read."""
    match = AGE.match(value.lower())
    if match is None:
        raise ValueError(
            f"{value!r} is not an age: a number and a unit, e.g. 7d, 12h, 30m, 90s, 2w"
        )
    seconds = float(match[1]) * UNITS[match[2] or "s"]
    if seconds > MAX_AGE.total_seconds():
        raise ValueError(
            f"an age of {value!r} is more than {MAX_AGE.days:,} days: nothing is that old"
        )
    age = timedelta(seconds=seconds)
    if not age:
        raise ValueError(
            f"an age of {value!r} would delete jobs that finished a moment ago: "
            "give one above zero, e.g. 1h"
        )
    return age


def parse_ages(value: str) -> timedelta | dict[str, timedelta]:
    """One age for every status (``"7d"``), or one per status
    (``"succeeded=1d,failed=30d"``: a status left out is not pruned)."""
    if "=" not in value:
        return parse_age(value)
    ages = {}
    for part in value.split(","):
        status, sep, age = part.partition("=")
        if not sep:
            raise ValueError(f"{part.strip()!r} names no status: write status=age, e.g. failed=30d")
        [status] = parse_statuses(status)
        if status in ages:
            raise ValueError(f"{status} is given two ages")
        ages[status] = parse_age(age)
    return ages


def parse_statuses(value: str) -> list[str]:
    statuses = [status.strip().lower() for status in value.split(",") if status.strip()]
    unknown = sorted(set(statuses) - set(FINISHED_STATUSES))
    if unknown or not statuses:
        named = ", ".join(unknown) if unknown else repr(value)
        raise ValueError(
            f"not a finished status: {named} (choose from {', '.join(FINISHED_STATUSES)})"
        )
    return statuses


def describe_age(age: timedelta) -> str:
    seconds = age.total_seconds()
    for unit, size in (("day", UNITS["d"]), ("hour", UNITS["h"])):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


def describe_cutoffs(cutoffs: dict[str, datetime], counts: PruneCounts, now: datetime) -> str:
    """`` finished before <time> (older than 7 days): succeeded 3, failed 2`` when every
    status had the same age, else each status with its own."""

    def when(cutoff: datetime) -> str:
        local = f"{timezone.localtime(cutoff):%Y-%m-%d %H:%M:%S %Z}"
        return f"finished before {local} (older than {describe_age(now - cutoff)})"

    if not cutoffs:
        return ": no status to prune"
    if len(set(cutoffs.values())) == 1:
        by_status = ", ".join(f"{status} {counts.jobs[status]}" for status in cutoffs)
        return f" {when(next(iter(cutoffs.values())))}: {by_status}"
    return ": " + ", ".join(
        f"{status} {counts.jobs[status]} {when(cutoff)}" for status, cutoff in cutoffs.items()
    )


class Command(BaseCommand):
    help = (
        "Delete finished jobs (succeeded, failed, discarded), their failure rows and completed "
        "batches older than an age, a few hundred rows per transaction."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            metavar="AGE",
            help="Jobs finished longer ago than this go: 7d, 12h, 30m, 90s, 2w (a bare number "
            "is seconds), or an age per status, e.g. succeeded=1d,failed=30d (a status left "
            "out is kept). Default: DJANGO_JOBS['clear_finished_jobs_after'].",
        )
        parser.add_argument(
            "--status",
            metavar="STATUS[,STATUS]",
            help="Only jobs of these statuses: succeeded, failed, discarded (default: all "
            "three). Batches are pruned only when all three are.",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            help="Jobs deleted per transaction (default 5,000 on PostgreSQL, 1,000 elsewhere).",
        )
        parser.add_argument(
            "--rest",
            type=float,
            default=0.0,
            metavar="RATIO",
            help="After each transaction, sleep RATIO times as long as it took: 0 (default) "
            "runs flat out; 2 leaves the database to the workers two thirds of the time.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        conf = JobsSettings.load()
        try:
            ages = self.ages(options["older_than"], conf)
            statuses = (
                parse_statuses(options["status"]) if options["status"] else list(FINISHED_STATUSES)
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        rest = options["rest"]
        if not is_number(rest) or not 0 <= rest <= MAX_REST:
            raise CommandError(f"--rest must be a number from 0 to {MAX_REST}, not {rest}")
        now = timezone.now()
        cutoffs = retention_cutoffs(ages, now)
        statuses = [status for status in statuses if status in cutoffs]
        everything = set(statuses) == set(FINISHED_STATUSES)
        verbosity = options["verbosity"]

        def progress(counts: PruneCounts) -> None:
            if verbosity >= 2:
                self.stdout.write(
                    f"  ... {counts.total_jobs} job(s), {counts.batches} batch(es) deleted so far"
                )

        counts = prune_finished_jobs(
            conf.database,
            cutoffs,
            statuses=statuses,
            batch_size=options["batch_size"],
            batches=everything,
            dry_run=options["dry_run"],
            on_batch=progress,
            rest=rest,
        )
        verb = "Would delete" if options["dry_run"] else "Deleted"
        line = f"{verb} {counts.total_jobs} job(s)" + describe_cutoffs(
            {status: cutoffs[status] for status in statuses}, counts, now
        )
        line += f"; {counts.failures} failure row(s)"
        line += f"; {counts.batches} completed batch(es)." if everything else "."
        if verbosity >= 1:
            self.stdout.write(line)

    def ages(self, option: str | None, conf: JobsSettings) -> Retention:
        """Seconds for every status or per status, as ``clear_finished_jobs_after`` says."""
        if option is not None:
            ages = parse_ages(option)
            if isinstance(ages, dict):
                # A status left out is kept (None), not given the default retention.
                return {
                    status: ages[status].total_seconds() if status in ages else None
                    for status in FINISHED_STATUSES
                }
            return ages.total_seconds()
        if conf.clear_finished_jobs_after is None:
            raise ValueError(
                "DJANGO_JOBS['clear_finished_jobs_after'] is None (finished jobs are kept "
                "forever): say how old a job must be with --older-than, e.g. --older-than 30d"
            )
        return conf.clear_finished_jobs_after
