"""The process registry, read-only: rows belong to running ``run_jobs`` processes.

What a process serves is in its row's ``metadata``, written when it registers
(``runtime/registration.py``): ``queues`` (its ``--queues``), ``threads`` and
``async_jobs`` (its event loop's ``async def`` jobs at once); ``single_process`` for the
worker of ``run_jobs --single-process`` (or ``--once``), which runs the dispatcher (and the
scheduler, registered apart) as threads of its own. A worker's loop monitor adds how often
its event loop was blocked (``loop_stalls``, ``loop_stalled_seconds``), which both pages
flag. Every value is read through ``observability/process_metadata.py``: a row edited by
hand shows "unknown", never an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from django_jobs.admin.base import EMPTY, JobsPermissionsMixin, ListTitleMixin, format_datetime
from django_jobs.conf import JobsSettings
from django_jobs.models import Process
from django_jobs.observability.inspection import ProcessInfo
from django_jobs.observability.process_metadata import (
    AsyncLoop,
    as_mapping,
    async_loop,
    is_single_process,
)

UNKNOWN = "unknown"
STALLED_TITLE = (
    "Times this worker's event loop of async def jobs was blocked longer than "
    "event_loop_block_threshold since the process started, and for how long in all: an "
    "async job did blocking work (time.sleep, a blocking client, a long computation) and "
    "every other async job of the process waited. The worker's log names each job that did "
    "it; do such work in a sync task or through sync_to_async."
)


def serves(kind: str, metadata: Any) -> str:
    """The queues a worker claims from, with its threads and its event loop's async jobs
    ("emails, reports* · 3 threads · 200 async"; nothing about async when it runs none);
    a dash for the other kinds, which claim nothing, or a worker that did not say."""
    metadata = as_mapping(metadata)
    queues = metadata.get("queues")
    if kind != Process.Kind.WORKER or not queues:
        return EMPTY
    text = ", ".join(str(queue) for queue in queues) if isinstance(queues, list) else str(queues)
    threads = metadata.get("threads")
    if threads:
        text += f" · {threads} thread{'' if threads == 1 else 's'}"
    loop = async_loop(kind, metadata)
    if loop is not None and loop.async_jobs:
        text += f" · {loop.async_jobs} async"
    return text


def stalls_text(loop: AsyncLoop) -> str:
    """ "3 stalls, 4.2 s blocked" ("seconds unknown" when the row does not hold them)."""
    seconds = (
        f"{loop.stalled_seconds:,.1f} s blocked"
        if loop.stalled_seconds is not None
        else f"seconds {UNKNOWN}"
    )
    return f"{loop.stalls or 0:,} stall{'' if loop.stalls == 1 else 's'}, {seconds}"


def loop_note(loop: AsyncLoop | None) -> SafeString:
    """The line under a worker's queues, on the dashboard and the process list: flagged
    when its event loop was blocked ("event loop: 3 stalls, 4.2 s blocked"), a quiet
    "unknown" when its row does not say; nothing for a loop never blocked, or another kind.
    A line, not a column of its own: both tables already fill a 1280-pixel page beside the
    admin's sidebar when names are as long as a Kubernetes pod's."""
    if loop is None or loop.stalls == 0:
        return mark_safe("")
    if loop.stalls is None:
        return format_html(
            '<span class="jobs-help" title="{}">event loop stalls: {}</span>',
            STALLED_TITLE,
            UNKNOWN,
        )
    return format_html(
        '<span class="jobs-stalled" title="{}">event loop: {}</span>',
        STALLED_TITLE,
        stalls_text(loop),
    )


def dispatches(kind: str, metadata: Any) -> bool:
    """True for a dispatcher, and for a single-process worker (its dispatcher is a thread)."""
    return kind == Process.Kind.DISPATCHER or (
        kind == Process.Kind.WORKER and is_single_process(metadata)
    )


@dataclass
class ProcessRow:
    """A registered process as the dashboard and the stuck page show it."""

    info: ProcessInfo
    serves: str
    single_process: bool
    dispatches: bool
    # The line under its queues about its event loop (``loop_note``), from ``info``.
    loop_note: SafeString


def process_rows(db: str, processes: list[ProcessInfo]) -> list[ProcessRow]:
    """``processes`` with what each serves, from their rows' metadata (one query)."""
    metadata = dict(
        Process.objects.using(db)
        .filter(pk__in=[p.id for p in processes])
        .values_list("pk", "metadata")
    )
    rows = []
    for process in processes:
        meta = metadata.get(process.id)
        loop = None
        if process.kind == Process.Kind.WORKER:
            loop = AsyncLoop(process.async_jobs, process.loop_stalls, process.loop_stalled_seconds)
        rows.append(
            ProcessRow(
                info=process,
                serves=serves(process.kind, meta),
                single_process=is_single_process(meta),
                dispatches=dispatches(process.kind, meta),
                loop_note=loop_note(loop),
            )
        )
    return rows


@admin.register(Process)
class ProcessAdmin(ListTitleMixin, JobsPermissionsMixin, admin.ModelAdmin):
    list_display = (
        "name",
        "kind_display",
        "queues",
        "hostname",
        "pid",
        "heartbeat",
        "alive",
        "running",
    )
    list_filter = ("kind", "hostname")
    ordering = ("kind", "pk")
    # The row, read-only: its dates in the pages' one format, not the model fields' own.
    fields = readonly_fields = (
        "kind",
        "name",
        "hostname",
        "pid",
        "supervisor",
        "metadata",
        "created",
        "heartbeat",
    )

    def get_queryset(self, request: HttpRequest):
        return super().get_queryset(request).using(JobsSettings.load().database)

    @admin.display(description="kind", ordering="kind")
    def kind_display(self, process: Process) -> str:
        if dispatches(process.kind, process.metadata) and process.kind == Process.Kind.WORKER:
            return format_html(
                '{}<br><span class="jobs-help">single process: dispatches too</span>',
                process.get_kind_display(),
            )
        return process.get_kind_display()

    @admin.display(description="queues")
    def queues(self, process: Process) -> SafeString:
        note = loop_note(async_loop(process.kind, process.metadata))
        text = serves(process.kind, process.metadata)
        return format_html("{}<br>{}", text, note) if note else format_html("{}", text)

    @admin.display(description="registered", ordering="created_at")
    def created(self, process: Process) -> str:
        return format_datetime(process.created_at)

    @admin.display(description="last heartbeat", ordering="last_heartbeat_at")
    def heartbeat(self, process: Process) -> str:
        return format_datetime(process.last_heartbeat_at)

    @admin.display(boolean=True)
    def alive(self, process: Process) -> bool:
        threshold = timedelta(seconds=JobsSettings.load().alive_threshold)
        return process.last_heartbeat_at >= timezone.now() - threshold

    @admin.display(description="jobs held")
    def running(self, process: Process) -> int:
        return process.claims.using(JobsSettings.load().database).count()
