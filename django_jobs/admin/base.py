"""The common ground of the jobs admin pages: permissions and page rendering."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest
from django.template.response import TemplateResponse
from django.urls import path

from ..conf import JobsSettings
from .permissions import can_act_on_jobs, can_view_jobs


class JobsPermissionsMixin:
    """Delegates every permission to the ``Job`` model's; nothing is added or deleted here."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return can_view_jobs(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return can_view_jobs(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return can_act_on_jobs(request)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def object_to_show(self, request: HttpRequest, object_id: str, refusal: str) -> Any:
        """The row a read-only detail page shows: GET only (``refusal`` says what to do
        instead), 404 for a missing row, 403 without the view permission."""
        if request.method != "GET":
            raise PermissionDenied(refusal)
        obj = self.get_object(request, object_id)
        if obj is None:
            raise Http404(f"no {self.model._meta.verbose_name} {object_id}")
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        return obj


class PageAdmin(JobsPermissionsMixin, admin.ModelAdmin):
    """An admin entry that is one page (dashboard, stuck, blocked), not a table's list."""

    template_name = ""
    title = ""

    def jobs_db(self) -> str:
        return JobsSettings.load().database

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        raise NotImplementedError

    def get_urls(self):
        """The page alone: the stock add, change and delete views of the model behind the
        proxy would edit a job's (or a semaphore's) row past the operations' locks."""
        opts = self.model._meta
        return [
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name=f"{opts.app_label}_{opts.model_name}_changelist",
            )
        ]

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": self.title,
            "can_act": self.has_change_permission(request),
            **self.page_context(request),
            **(extra_context or {}),
        }
        return TemplateResponse(request, self.template_name, context)
