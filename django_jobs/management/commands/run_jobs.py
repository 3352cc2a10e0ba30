"""``manage.py run_jobs``: run the supervisor, or a single process with ``--single-process``."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_jobs.checks import known_queues, unknown_queue_patterns
from django_jobs.conf import JobsSettings
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.logs import configure_logging
from django_jobs.runtime.reloader import (
    ReloadedLifecycle,
    ReloadUnavailable,
    run_reloading,
    under_reloader,
    watch_reloader,
)
from django_jobs.runtime.single import run_single_process
from django_jobs.runtime.supervisor import Supervisor, prune_stale


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(value)
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = "Run background jobs: a supervisor with worker processes and a dispatcher."
    requires_system_checks = "__all__"

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--queues",
            help="Comma-separated queues in the order to serve them; '*' and 'prefix*' "
            "wildcards. Default: DJANGO_JOBS['queues'] or '*'.",
        )
        parser.add_argument("--processes", type=positive_int, help="Worker processes.")
        parser.add_argument("--threads", type=positive_int, help="Threads per worker process.")
        parser.add_argument(
            "--async-jobs",
            type=non_negative_int,
            help="async def jobs each worker process runs at once on its event loop "
            "(0: run them on the threads).",
        )
        parser.add_argument(
            "--polling-interval", type=positive_float, help="Seconds between polls when idle."
        )
        parser.add_argument(
            "--batch-size", type=positive_int, help="Most jobs claimed in one query."
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=positive_float,
            help="Seconds running jobs get to finish after SIGTERM.",
        )
        parser.add_argument(
            "--max-jobs-per-child",
            type=positive_int,
            help="Replace a worker process (gracefully) after it has run this many jobs.",
        )
        parser.add_argument(
            "--max-memory-per-child",
            type=positive_int,
            metavar="MB",
            help="Replace a worker process (gracefully) once its resident memory passes MB.",
        )
        parser.add_argument(
            "--single-process",
            action="store_true",
            default=None,
            help="Run worker threads and the dispatcher in this one process.",
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="Run what is ready (and due) in one process, then exit.",
        )
        parser.add_argument(
            "--reload",
            action="store_true",
            help="Development: restart (gracefully) when a Python file of the project changes.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["reload"]:
            refuse_with_reload(options, getattr(self, "_called_from_command_line", False))
        overrides = {
            "queues": options["queues"],
            "processes": options["processes"],
            "threads": options["threads"],
            "async_jobs": options["async_jobs"],
            "polling_interval": options["polling_interval"],
            "batch_size": options["batch_size"],
            "shutdown_timeout": options["shutdown_timeout"],
            "single_process": options["single_process"],
            "max_jobs_per_child": options["max_jobs_per_child"],
            "max_memory_per_child": options["max_memory_per_child"],
        }
        overrides = {key: value for key, value in overrides.items() if value is not None}
        try:
            conf = JobsSettings.load(**overrides)
        except (TypeError, ValueError) as exc:
            raise CommandError(f"Invalid DJANGO_JOBS settings: {exc}") from exc
        refuse_unknown_queues(conf, "--queues" if "queues" in overrides else None)
        verbosity = options["verbosity"]
        configure_logging(verbosity)
        reloaded = options["reload"] and under_reloader()
        lifecycle = ReloadedLifecycle() if reloaded else Lifecycle()
        lifecycle.install_signal_handlers()
        if options["reload"]:
            if not reloaded:
                self.reload(conf, lifecycle)
                return
            watch_reloader(lifecycle)  # the reloaded command itself
        prune_stale(conf)
        # Pruned as dead by another process: exit non-zero, for a process manager to restart.
        if options["once"] or conf.single_process:
            if conf.max_jobs_per_child or conf.max_memory_per_child:
                self.stderr.write(
                    "max_jobs_per_child and max_memory_per_child apply to the supervisor's "
                    "worker processes only; this single process is not recycled."
                )
            abandoned = run_single_process(conf, lifecycle, once=options["once"])
            # Pruned as dead, or left a job it could not interrupt: a process manager
            # should start a fresh one.
            code = 1 if lifecycle.pruned or lifecycle.stuck_jobs or lifecycle.broken else 0
            if abandoned:
                # Threads of jobs cut off at the shutdown timeout cannot be joined.
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        else:
            Supervisor(conf, lifecycle, overrides, verbosity).run()
            code = 1 if lifecycle.pruned else 0
        if code:
            why = lifecycle.broken or "this process was pruned as dead"
            raise CommandError(f"stopped: {why}", returncode=code)

    def reload(self, conf: JobsSettings, lifecycle: Lifecycle) -> None:
        """Run this command line again as a child, restarted when the code changes."""
        try:
            code = run_reloading(conf, lifecycle)
        except ReloadUnavailable as exc:
            raise CommandError(f"--reload: {exc}; run_jobs without --reload works") from exc
        if code:
            raise CommandError(f"run_jobs exited with code {code}", returncode=code)


def refuse_with_reload(options: dict[str, Any], from_command_line: bool) -> None:
    """What ``--reload`` cannot work with, refused before anything starts.

    Every other option is handed to the reloaded command as it was given
    (``--single-process`` and recycling included: each run is reloaded whole).
    """
    if options["once"]:
        raise CommandError(
            "--reload and --once exclude each other: --once drains the queues and exits, "
            "so there is nothing to restart; use --reload alone (or with --single-process)"
        )
    if not from_command_line:
        raise CommandError(
            "--reload runs this command again from its command line: start it as "
            "`manage.py run_jobs --reload`, not through call_command()"
        )


def refuse_unknown_queues(conf: JobsSettings, flag: str | None) -> None:
    """Refuse queue patterns that match no declared queue, as check E005 does.

    Such a worker would poll forever and never find a job (an enqueue into an
    undeclared queue is refused), which looks exactly like a healthy idle one.
    The check covers ``DJANGO_JOBS['queues']``; this covers the flag, and the
    setting too when checks are skipped.
    """
    source = flag or "DJANGO_JOBS['queues']"
    problems = unknown_queue_patterns(conf.queues, conf.database, source)
    if problems:
        raise CommandError(" ".join([*problems, known_queues(conf.database)]))
