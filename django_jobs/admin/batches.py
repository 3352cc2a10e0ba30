"""Batches: the list with progress, and one batch's page (counts, items, callbacks, nesting).

A batch may hold 100,000 items, so nothing here reads them all: the counts are
the batch row's own counters (moved under its lock as items finish), the page
shows the first items only, and the full list is the job list filtered by batch.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin import ShowFacets
from django.db.models import Exists, OuterRef, Q, QuerySet, TextField
from django.db.models.functions import Cast, Left
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from django_jobs.admin import pagination
from django_jobs.admin.base import (
    REFRESH_SECONDS,
    JobsPermissionsMixin,
    ListTitleMixin,
    format_datetime,
    page_context,
)
from django_jobs.conf import JobsSettings
from django_jobs.core.batches import CALLBACK_NAMES
from django_jobs.models import Batch, Job

ITEMS_SHOWN = 50
CHILDREN_SHOWN = 50
ITEM_FIELDS = ("id", "task_path", "status", "attempts", "max_attempts", "finished_at")
# Characters of an item's arguments (as JSON) read: the page shows their start, and each
# item's may take 1 MiB.
ARGS_READ = 100


def jobs_db() -> str:
    return JobsSettings.load().database


class FinishedFilter(admin.SimpleListFilter):
    title = "finished"
    parameter_name = "finished"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin):
        return [("yes", "Finished"), ("no", "Unfinished")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "yes":
            return queryset.filter(finished_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(finished_at__isnull=True)
        return queryset


def callback_states(batch: Batch, jobs: dict[int, Job]) -> list[dict[str, Any]]:
    """Each declared callback: its job once enqueued, else why it is not (yet)."""
    states = []
    for name in CALLBACK_NAMES:
        spec = batch.callbacks.get(name)
        if not spec:
            continue
        job_id = batch.callback_jobs.get(name)
        if job_id is not None:
            job = jobs.get(int(job_id))
            state = job.status if job else "pruned"
        elif batch.finished_at is None:
            state = "not yet enqueued"
        elif name == "on_success":
            state = "not run: an item failed"
        elif name == "on_failure":
            state = "not run: no item failed"
        else:
            state = "not enqueued"
        states.append(
            {
                "name": name,
                "task_path": spec.get("task_path", "?"),
                "job_id": int(job_id) if job_id is not None else None,
                "state": state,
            }
        )
    return states


@admin.register(Batch)
class BatchAdmin(ListTitleMixin, JobsPermissionsMixin, admin.ModelAdmin):
    list_display = (
        "label",
        "id",
        "progress",
        "succeeded",
        "failed",
        "pending",
        "created",
        "finished",
    )
    list_display_links = ("label", "id")
    list_filter = (FinishedFilter,)
    ordering = ("-id",)
    list_per_page = 50
    list_max_show_all = 200
    show_full_result_count = False
    # Facets (``?_facets=1``) count each filter's choices over the whole table.
    show_facets = ShowFacets.NEVER
    paginator = pagination.CappedCountPaginator
    actions = None
    # A batch's own page follows its progress by itself; the list does not.
    refresh_seconds = REFRESH_SECONDS

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).using(jobs_db())

    @admin.display(description="description", ordering="description")
    def label(self, batch: Batch) -> str:
        return batch.description or "(no description)"

    @admin.display(description="done")
    def progress(self, batch: Batch) -> str:
        return f"{batch.total - batch.pending}/{batch.total}"

    @admin.display(description="created", ordering="created_at")
    def created(self, batch: Batch) -> str:
        return format_datetime(batch.created_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, batch: Batch) -> str:
        return format_datetime(batch.finished_at)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None
    ):
        """Read-only: a batch's counters move only as its items finish."""
        batch = self.object_to_show(request, object_id, "a batch cannot be edited")
        return TemplateResponse(
            request, "admin/django_jobs/batch/detail.html", self.batch_context(request, batch)
        )

    def batch_context(self, request: HttpRequest, batch: Batch) -> dict[str, Any]:
        """A fixed number of queries whatever the batch's size: the first items, the
        callback and parent jobs in one query, the child batches in one."""
        db = jobs_db()
        items = list(
            Job.objects.using(db)
            .filter(batch_id=batch.pk)
            .order_by("pk")
            .only(*ITEM_FIELDS)
            .annotate(args_start=Left(Cast("args", TextField()), ARGS_READ))[: ITEMS_SHOWN + 1]
        )
        callback_ids = {int(i) for i in batch.callback_jobs.values() if i is not None}
        linked = {*callback_ids, *([batch.parent_job_id] if batch.parent_job_id else [])}
        jobs = Job.objects.using(db).only("id", "task_path", "status").in_bulk(linked)
        # Batches enqueued by this batch's callbacks or items (a stage enqueuing the next):
        # always created after it, and their parent is checked by primary key, so the
        # batch's items are never read in bulk.
        item_parent = Exists(
            Job.objects.using(db).filter(pk=OuterRef("parent_job_id"), batch_id=batch.pk)
        )
        children = list(
            Batch.objects.using(db)
            .filter(pk__gt=batch.pk, parent_job_id__isnull=False)
            .filter(Q(parent_job_id__in=callback_ids) | item_parent)
            .order_by("pk")[:CHILDREN_SHOWN]
        )
        done = batch.total - batch.pending
        batches = reverse(f"{self.admin_site.name}:django_jobs_batch_changelist")
        return {
            **page_context(
                self,
                request,
                f"Batch #{batch.pk}: {batch.description or '(no description)'}",
                trail=(("Batches", batches),),
                here=f"#{batch.pk}",
                refresh=self.refresh_seconds,
            ),
            "now": timezone.now(),
            "batch": batch,
            "done": done,
            "percent": round(100 * done / batch.total) if batch.total else 100,
            "items": items[:ITEMS_SHOWN],
            "more_items": len(items) > ITEMS_SHOWN,
            "items_shown": ITEMS_SHOWN,
            "callbacks": callback_states(batch, jobs),
            "parent": jobs.get(batch.parent_job_id) if batch.parent_job_id else None,
            "children": children,
            "children_shown": CHILDREN_SHOWN,
        }
