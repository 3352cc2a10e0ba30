"""``manage.py jobs_health``: exit 0 when this host's ``run_jobs`` heartbeats are recent.

For liveness and health checks (Kubernetes ``exec`` probes, Docker ``HEALTHCHECK``,
a monitoring cron): every ``run_jobs`` process writes its row in the process table
every ``heartbeat_interval`` seconds, so a recent heartbeat says the process is
there and reaches the jobs database. Read from the database, not from a port, so
it needs no server in the worker and works the same with any number of processes.

It does not prove that a worker's loop makes progress: heartbeats come from a
thread of their own. ``manage.py jobs`` (stuck jobs) and the admin's stuck page
answer that question.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.models import Process
from django_jobs.observability.process_metadata import is_single_process

KINDS = [kind.value for kind in Process.Kind]
DEFAULT_KINDS = [Process.Kind.WORKER.value, Process.Kind.DISPATCHER.value]
UNHEALTHY = 1
DATABASE_UNREACHABLE = 2


def provides(row: Mapping[str, Any], kind: str) -> bool:
    """Whether the process of ``row`` does the work of ``kind``.

    ``run_jobs --single-process`` registers one worker row; its dispatcher is a
    thread of that process.
    """
    if row["kind"] == kind:
        return True
    single = is_single_process(row["metadata"])
    return kind == Process.Kind.DISPATCHER and row["kind"] == Process.Kind.WORKER and single


def seconds_since(moment: datetime, now: datetime) -> float:
    return max(0.0, (now - moment).total_seconds())


class Command(BaseCommand):
    help = (
        "Exit 0 if this host runs a django-jobs worker and dispatcher whose heartbeats are "
        "recent; 1 if not; 2 if the jobs database cannot be read. For liveness probes."
    )
    # A probe runs often: it reads one small table, and skips the system checks.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--max-age",
            type=float,
            metavar="SECONDS",
            help="Oldest acceptable heartbeat (default: DJANGO_JOBS['alive_threshold'], the "
            "age at which the dispatcher declares a process dead).",
        )
        parser.add_argument(
            "--kind",
            action="append",
            choices=KINDS,
            help="A kind of process that must be there; repeat for several (default: worker "
            "and dispatcher; the worker of --single-process counts as both).",
        )
        where = parser.add_mutually_exclusive_group()
        where.add_argument(
            "--host",
            help="Look for processes of this host name (default: this machine's, "
            "socket.gethostname(), which in a container is the container's or the pod's).",
        )
        where.add_argument(
            "--any-host",
            action="store_true",
            help="Healthy if such processes run anywhere (a check of the whole deployment).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        conf = JobsSettings.load()
        max_age = options["max_age"] if options["max_age"] is not None else conf.alive_threshold
        kinds = options["kind"] or DEFAULT_KINDS
        host = None if options["any_host"] else options["host"] or socket.gethostname()
        where = f"on host {host}" if host else "on any host"
        rows_query = Process.objects.using(conf.database).values(
            "kind", "pid", "hostname", "last_heartbeat_at", "metadata"
        )
        if host is not None:
            rows_query = rows_query.filter(hostname=host)
        try:
            rows = list(rows_query)
        except DatabaseError as exc:
            self.stderr.write(f"unhealthy: cannot read the jobs database: {exc}".strip())
            raise SystemExit(DATABASE_UNREACHABLE) from exc
        now = timezone.now()
        found, missing = [], []
        for kind in kinds:
            candidates = [row for row in rows if provides(row, kind)]
            fresh = [
                row for row in candidates if seconds_since(row["last_heartbeat_at"], now) <= max_age
            ]
            if fresh:
                row = max(fresh, key=lambda row: row["last_heartbeat_at"])
                age = seconds_since(row["last_heartbeat_at"], now)
                found.append(f"{kind} pid {row['pid']} (heartbeat {age:.0f}s ago)")
            elif candidates:
                latest = max(candidates, key=lambda row: row["last_heartbeat_at"])
                age = seconds_since(latest["last_heartbeat_at"], now)
                missing.append(f"{kind}: last heartbeat {age:.0f}s ago")
            else:
                missing.append(f"no {kind}")
        if missing:
            self.stderr.write(
                f"unhealthy {where}: {'; '.join(missing)} "
                f"(heartbeats must be at most {max_age:g}s old)"
            )
            raise SystemExit(UNHEALTHY)
        self.stdout.write(f"ok {where}: {', '.join(found)}")
