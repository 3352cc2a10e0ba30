"""``manage.py jobs``: the state of the queues in a terminal, or as JSON for scripts.

Every value a job or a process brought (a queue, a key, a task path, a host, a progress
message) is printed through ``printable``: a newline in it cannot forge a line of the
report, nor an escape sequence rewrite the operator's terminal.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand

from django_jobs.core.progress import summary
from django_jobs.observability.inspection import (
    COUNT_CAP,
    STATES,
    WORKFLOWS_SHOWN,
    Snapshot,
    snapshot,
)
from django_jobs.text import printable


class Command(BaseCommand):
    help = (
        "Show per-queue counts, blocked concurrency keys, stuck jobs, live processes, the "
        "progress of running jobs and the latest workflows."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--json", action="store_true", help="Print one JSON document.")

    def handle(self, *args: Any, **options: Any) -> None:
        state = snapshot()
        if options["json"]:
            self.stdout.write(json.dumps(state.as_json(), indent=2, sort_keys=True))
            return
        self.render(state)

    def render(self, state: Snapshot) -> None:
        """The snapshot as text, one section per part of the queue."""
        for section in (
            self.render_queues,
            self.render_blocked_keys,
            self.render_stuck,
            self.render_processes,
            self.render_progress,
            self.render_workflows,
        ):
            section(state)

    def render_queues(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING(f"Queues (at {state.taken_at:%Y-%m-%d %H:%M:%S %Z})"))
        header = ["queue", *STATES]
        rows = [
            [
                printable(queue) + (" (paused)" if queue in state.paused else ""),
                *map(str, counts.values()),
            ]
            for queue, counts in state.queues.items()
        ]
        out(table(header, rows) if rows else "  no jobs")

    def render_blocked_keys(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Blocked concurrency keys"))
        key_rows = [
            [
                printable(key.key),
                str(key.limit),
                str(key.holders),
                str(key.blocked),
                f"{key.oldest_blocked_at:%Y-%m-%d %H:%M:%S}" if key.oldest_blocked_at else "",
            ]
            for key in state.blocked_keys
        ]
        out(
            table(["key", "limit", "holders", "blocked", "oldest blocked"], key_rows)
            if key_rows
            else "  none"
        )
        total = state.blocked_key_count
        if total > len(key_rows):
            in_all = f"more than {COUNT_CAP:,}" if total > COUNT_CAP else f"{total:,}"
            out(
                f"  ... the first {len(key_rows):,} of {in_all} keys (by name); the admin's "
                "blocked page lists every key"
            )

    def render_stuck(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Stuck jobs"))
        for kind, job_ids in state.stuck.items():
            label = kind.replace("_", " ")
            listed = ", ".join(map(str, job_ids[:10])) + (" ..." if len(job_ids) > 10 else "")
            line = f"  {label}: {len(job_ids)}" + (f"  [{listed}]" if job_ids else "")
            out(self.style.WARNING(line) if job_ids else line)

    def render_processes(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Processes"))
        proc_rows = [
            [
                printable(p.kind),
                printable(p.hostname),
                str(p.pid),
                f"{p.last_heartbeat_at:%H:%M:%S}",
                "alive" if p.alive else "DEAD",
                ", ".join(map(str, p.running_jobs)),
            ]
            for p in state.processes
        ]
        out(
            table(["kind", "host", "pid", "heartbeat", "state", "running jobs"], proc_rows)
            if proc_rows
            else "  none running"
        )

    def render_progress(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Progress of running jobs"))
        progress_rows = [
            [
                str(p.job_id),
                printable(p.task_path),
                summary(p.done, p.total),
                f"{p.updated_at:%H:%M:%S}",
                printable(p.message),
            ]
            for p in state.progress
        ]
        out(
            table(["job", "task", "progress", "reported", "message"], progress_rows)
            if progress_rows
            else "  none reported"
        )

    def render_workflows(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING(f"Workflows (the latest {WORKFLOWS_SHOWN})"))
        rows = [
            [
                str(w.id),
                printable(w.name) or "-",
                w.status,
                f"{w.total - w.unfinished}/{w.total}",
                f"{w.created_at:%Y-%m-%d %H:%M:%S}" if w.created_at else "",
            ]
            for w in state.workflows
        ]
        out(table(["id", "name", "status", "done", "created"], rows) if rows else "  none")
        if len(rows) >= WORKFLOWS_SHOWN:
            out("  ... the admin's workflows page lists every workflow")


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    ]
    return "\n".join(lines)
