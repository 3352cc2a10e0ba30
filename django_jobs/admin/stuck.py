"""Every way a job can be stuck, with how many and which, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone

from django_jobs.admin.base import REFRESH_SECONDS, PageAdmin, key_html
from django_jobs.admin.processes import ProcessRow, process_rows
from django_jobs.conf import JobsSettings
from django_jobs.models import Job, StuckJob
from django_jobs.observability import inspection

KINDS = {
    "claimed_by_dead_process": (
        "Claimed by a dead process",
        "Its process stopped heartbeating. A running dispatcher recovers these claims once "
        "the process is past the alive threshold: never started, the job is handed back; "
        "started, the attempt fails and is retried if attempts remain.",
    ),
    "blocked_behind_free_slot": (
        "Blocked although its key has a free slot",
        "The key's free count has drifted. Reconcile the key on the blocked page: it "
        "recounts the holders under the key's lock and promotes what fits.",
    ),
    "ready_in_unserved_queue": (
        "Ready in a queue no live worker serves",
        "No running worker lists this queue. Start one with --queues naming it (or '*').",
    ),
    "scheduled_long_past_due": (
        "Scheduled, long past due",
        "Due jobs are promoted by the dispatcher.",
    ),
    "running_far_too_long": (
        "Running far longer than usual",
        "Running over five times its task's median duration: of its last 50 successes "
        "among the latest 5,000 of every task, else of its successes among 500 of its "
        "jobs. It may be hung; it cannot be discarded while it runs.",
    ),
}


FREE_SLOT = "blocked_behind_free_slot"
SHOWN_FIELDS = ("id", "task_path", "queue_name", "status", "concurrency_key", "enqueued_at")


@dataclass
class StuckJobRow:
    """A stuck job as its list shows it: the columns shown (not the job's arguments or
    return value, a MiB each at most), its key as a cell."""

    pk: int
    task_path: str
    queue_name: str
    status: str
    key_html: str
    enqueued_at: datetime


def stuck_rows(db: str, ids: set[int]) -> dict[int, StuckJobRow]:
    rows = Job.objects.using(db).filter(pk__in=ids).values_list(*SHOWN_FIELDS)
    return {
        pk: StuckJobRow(pk, task_path, queue, status, key_html(key, task_path), enqueued_at)
        for pk, task_path, queue, status, key, enqueued_at in rows
    }


def keys_note(read: int, count: int) -> str:
    """Which keys the free-slot check covered, when not all: only the first keys with
    blocked jobs are read (``inspection.KEYS_READ``), whatever the backlog."""
    if count <= read:
        return ""
    cap = inspection.COUNT_CAP
    total = f"more than {cap:,}" if count > cap else f"{count:,}"
    return (
        f"Only the first {read:,} of {total} keys with blocked jobs (by name) were checked; "
        "the blocked page lists every key."
    )


def dispatcher_status(dispatchers: list[ProcessRow]) -> str:
    """Whether a dispatcher is alive: two kinds of stuck job wait for one."""
    if not dispatchers:
        return (
            "No dispatcher is running: nothing promotes due scheduled jobs or recovers the "
            "claims of dead processes. Start run_jobs."
        )
    names = ", ".join(row.info.name for row in dispatchers)
    return f"A dispatcher is running: {names}."


def kind_status(name: str, running: bool) -> str:
    """What the dispatcher's presence or absence says about one kind of stuck job."""
    if name == "scheduled_long_past_due":
        if running:
            return (
                "A dispatcher is running: a job listed here means it is falling behind or "
                "failing (see its log)."
            )
        return "No dispatcher is running: start run_jobs."
    if name == "claimed_by_dead_process" and not running:
        return "No dispatcher is running: start run_jobs."
    return ""


@admin.register(StuckJob)
class StuckJobAdmin(PageAdmin):
    template_name = "admin/django_jobs/stuck.html"
    title = "Stuck jobs"
    refresh_seconds = REFRESH_SECONDS

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        conf = JobsSettings.load()
        db = conf.database
        now = timezone.now()
        procs = inspection.processes(db, now, conf)
        keys, key_count = inspection.first_blocked_keys(db, now)
        stuck = inspection.stuck_jobs(db, now, conf, procs, keys)
        ids = {job_id for found in stuck.values() for job_id in found}
        jobs = stuck_rows(db, ids)
        # A dispatcher is a process of that kind, or a single-process worker (whose
        # dispatcher is a thread), with a heartbeat within the alive threshold.
        dispatchers = [row for row in process_rows(db, procs) if row.dispatches and row.info.alive]
        return {
            "now": now,
            "dispatchers": dispatchers,
            "dispatcher_status": dispatcher_status(dispatchers),
            "sample": inspection.STUCK_SAMPLE,
            "kinds": [
                {
                    "name": name,
                    "title": title,
                    "help": help_text,
                    "status": kind_status(name, bool(dispatchers)),
                    "note": keys_note(len(keys), key_count) if name == FREE_SLOT else "",
                    "count": len(stuck[name]),
                    "capped": len(stuck[name]) >= inspection.STUCK_SAMPLE,
                    "jobs": [jobs[i] for i in stuck[name] if i in jobs],
                }
                for name, (title, help_text) in KINDS.items()
            ],
            "total": len(ids),
        }
