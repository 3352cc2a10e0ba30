"""The process registry, read-only: rows belong to running ``run_jobs`` processes."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin
from django.utils import timezone

from ..conf import JobsSettings
from ..models import Process
from .base import JobsPermissionsMixin


@admin.register(Process)
class ProcessAdmin(JobsPermissionsMixin, admin.ModelAdmin):
    list_display = ("name", "kind", "hostname", "pid", "last_heartbeat_at", "alive", "running")
    list_filter = ("kind", "hostname")
    ordering = ("kind", "pk")
    readonly_fields = (
        "kind",
        "name",
        "hostname",
        "pid",
        "supervisor",
        "metadata",
        "created_at",
        "last_heartbeat_at",
    )

    def get_queryset(self, request):
        return super().get_queryset(request).using(JobsSettings.load().database)

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(boolean=True)
    def alive(self, process: Process) -> bool:
        threshold = timedelta(seconds=JobsSettings.load().alive_threshold)
        return process.last_heartbeat_at >= timezone.now() - threshold

    @admin.display(description="jobs held")
    def running(self, process: Process) -> int:
        return process.claims.using(JobsSettings.load().database).count()
