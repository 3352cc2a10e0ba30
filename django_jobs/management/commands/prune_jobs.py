"""``manage.py prune_jobs``: delete finished jobs older than an age, in small transactions.

The dispatcher already prunes on its own, every ``maintenance_interval``, what is older
than ``clear_finished_jobs_after``. This command runs the same pruning
(:func:`django_jobs.core.maintenance.prune_finished_jobs`) on demand: from cron when
``clear_finished_jobs_after`` is ``None``, with a shorter age after an incident
that piled up failures, for one status only, or as a dry run to see what would go.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core.maintenance import PRUNE_BATCH_SIZE, PruneCounts, prune_finished_jobs
from django_jobs.models import FINISHED_STATUSES

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_age(value: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"``; a bare number is seconds."""
    match = AGE.match(value.lower())
    if match is None:
        raise ValueError(
            f"{value!r} is not an age: a number and a unit, e.g. 7d, 12h, 30m, 90s, 2w"
        )
    return timedelta(seconds=float(match[1]) * UNITS[match[2] or "s"])


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
            "is seconds). Default: DJANGO_JOBS['clear_finished_jobs_after'].",
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
            default=PRUNE_BATCH_SIZE,
            help=f"Jobs deleted per transaction (default {PRUNE_BATCH_SIZE}).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        conf = JobsSettings.load()
        try:
            age = self.age(options["older_than"], conf)
            statuses = (
                parse_statuses(options["status"]) if options["status"] else list(FINISHED_STATUSES)
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        cutoff = timezone.now() - age
        everything = set(statuses) == set(FINISHED_STATUSES)
        verbosity = options["verbosity"]

        def progress(counts: PruneCounts) -> None:
            if verbosity >= 2:
                self.stdout.write(
                    f"  ... {counts.total_jobs} job(s), {counts.batches} batch(es) deleted so far"
                )

        counts = prune_finished_jobs(
            conf.database,
            cutoff,
            statuses=statuses,
            batch_size=options["batch_size"],
            batches=everything,
            dry_run=options["dry_run"],
            on_batch=progress,
        )
        verb = "Would delete" if options["dry_run"] else "Deleted"
        by_status = ", ".join(f"{status} {counts.jobs[status]}" for status in statuses)
        when = f"{timezone.localtime(cutoff):%Y-%m-%d %H:%M:%S %Z}"
        line = (
            f"{verb} {counts.total_jobs} job(s) finished before {when} "
            f"(older than {describe_age(age)}): {by_status}; "
            f"{counts.failures} failure row(s)"
        )
        line += f"; {counts.batches} completed batch(es)." if everything else "."
        if verbosity >= 1:
            self.stdout.write(line)

    def age(self, option: str | None, conf: JobsSettings) -> timedelta:
        if option is not None:
            return parse_age(option)
        if conf.clear_finished_jobs_after is None:
            raise ValueError(
                "DJANGO_JOBS['clear_finished_jobs_after'] is None (finished jobs are kept "
                "forever): say how old a job must be with --older-than, e.g. --older-than 30d"
            )
        return timedelta(seconds=conf.clear_finished_jobs_after)
