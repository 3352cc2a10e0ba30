"""The process registry, read-only: rows belong to running ``run_jobs`` processes.

What a process serves is in its row's ``metadata``, written when it registers
(``runtime/registration.py``): ``queues`` (its ``--queues``) and ``threads``;
``single_process`` for the worker of ``run_jobs --single-process`` (or ``--once``), which runs the
dispatcher (and the scheduler, registered apart) as threads of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from django_jobs.admin.base import EMPTY, JobsPermissionsMixin, ListTitleMixin, format_datetime
from django_jobs.conf import JobsSettings
from django_jobs.models import Process
from django_jobs.observability.inspection import ProcessInfo


def serves(kind: str, metadata: Any) -> str:
    """The queues a worker claims from, with its threads ("emails, reports* · 3 threads");
    a dash for the other kinds, which claim nothing, or a worker that did not say."""
    metadata = metadata if isinstance(metadata, dict) else {}
    queues = metadata.get("queues")
    if kind != Process.Kind.WORKER or not queues:
        return EMPTY
    text = ", ".join(str(queue) for queue in queues)
    threads = metadata.get("threads")
    if threads:
        text += f" · {threads} thread{'' if threads == 1 else 's'}"
    return text


def dispatches(kind: str, metadata: Any) -> bool:
    """True for a dispatcher, and for a single-process worker (its dispatcher is a thread)."""
    single = isinstance(metadata, dict) and bool(metadata.get("single_process"))
    return kind == Process.Kind.DISPATCHER or (kind == Process.Kind.WORKER and single)


@dataclass
class ProcessRow:
    """A registered process as the dashboard and the stuck page show it."""

    info: ProcessInfo
    serves: str
    single_process: bool
    dispatches: bool


def process_rows(db: str, processes: list[ProcessInfo]) -> list[ProcessRow]:
    """``processes`` with what each serves, from their rows' metadata (one query)."""
    metadata = dict(
        Process.objects.using(db)
        .filter(pk__in=[p.id for p in processes])
        .values_list("pk", "metadata")
    )
    rows = []
    for process in processes:
        meta = metadata.get(process.id) or {}
        rows.append(
            ProcessRow(
                info=process,
                serves=serves(process.kind, meta),
                single_process=bool(isinstance(meta, dict) and meta.get("single_process")),
                dispatches=dispatches(process.kind, meta),
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
    def queues(self, process: Process) -> str:
        return serves(process.kind, process.metadata)

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
