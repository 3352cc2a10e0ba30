"""The common ground of the jobs admin pages: permissions, page rendering, breadcrumbs,
dates, the auto-refresh, and what a request may bring (ids, filters, no NUL)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import django
from django.contrib import admin
from django.core.exceptions import BadRequest, PermissionDenied
from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.template.response import SimpleTemplateResponse, TemplateResponse
from django.urls import URLPattern, path, register_converter, reverse
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.html import format_html
from django.utils.translation import gettext

from django_jobs.admin.permissions import can_act_on_jobs, can_view_jobs
from django_jobs.conf import JobsSettings
from django_jobs.db import ops
from django_jobs.limits import as_id

if TYPE_CHECKING:
    # The mixins below are only ever combined with a ModelAdmin: typed as one, at run
    # time plain classes (the admin classes' MRO is theirs).
    ModelAdminMixin = admin.ModelAdmin
else:
    ModelAdminMixin = object

# Django 6.1's admin draws breadcrumbs as <ol class="breadcrumbs"><li>…, and its CSS styles
# only that; 6.0's as <div class="breadcrumbs"> with &rsaquo; between links. Each gets its own.
BREADCRUMBS_AS_LIST = django.VERSION >= (6, 1)

# Every date and time on the jobs pages, in the current time zone (which each page names):
# numeric, so the same in every language, with seconds, which a job's timeline needs.
# The <time> element's title holds the full ISO 8601 value, microseconds and offset.
# Its day and its time are two spans, so that a narrow list breaks between them only.
# templates/admin/django_jobs/time.html renders the same markup in templates.
DATETIME_FORMAT = "Y-m-d H:i:s"  # the day, a space, the time: see format_datetime

# What a page shows for no value: an en dash, as the templates do.
EMPTY = "\u2013"

# Seconds between two refreshes of a page that refreshes itself (0: never).
REFRESH_SECONDS = 10

# Seconds any one statement of a jobs page (a GET) may run on the jobs database before it is
# interrupted and the page says so (``statement_timeout`` on an admin class; 0: no limit).
STATEMENT_TIMEOUT = 5.0


class IdConverter:
    """A row's id in a path (``jobs_id``): like Django's ``int``, but a number past
    ``limits.MAX_ID`` does not match (404) instead of reaching the database."""

    regex = "[0-9]{1,19}"

    def to_python(self, value: str) -> int:
        number = as_id(value)
        if number is None:
            raise ValueError(value)
        return number

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(IdConverter, "jobs_id")


def refuse_nul(data: QueryDict) -> None:
    """400 for a NUL in a request's names or values. PostgreSQL refuses one in any text
    parameter of a query (a 500), and no queue, key, task or id can hold one there."""
    for name, values in data.lists():
        if "\x00" in name or any("\x00" in value for value in values):
            raise BadRequest("A NUL character in the request.")


def local_time(value: datetime) -> datetime:
    """``value`` in the current time zone, as a template shows it (with ``USE_TZ``)."""
    # django-stubs 6.1 declares no template_localtime; django.utils.timezone has it.
    return timezone.template_localtime(value)  # type: ignore[attr-defined]


def format_datetime(value: datetime | None, empty: str = EMPTY) -> str:
    """``value`` as every jobs page shows a date: a ``<time>`` in DATETIME_FORMAT, whose
    day and time may go on two lines (in a narrow list) but never break inside."""
    if value is None:
        return empty
    local = local_time(value)
    iso = format_date(local, "c")
    day, _, time = format_date(local, DATETIME_FORMAT).partition(" ")
    return format_html(
        '<time datetime="{}" title="{}"><span>{}</span> <span>{}</span></time>',
        iso,
        iso,
        day,
        time,
    )


def short_key(key: str | None, prefix: str) -> str:
    """A concurrency key without the task path it starts with (``task.path/acct:1`` →
    ``acct:1``). A key of a ``concurrency_group`` keeps its group: it is shared by tasks."""
    if not key:
        return ""
    if prefix and key.startswith(prefix + "/"):
        return key[len(prefix) + 1 :]
    return key


def key_html(key: str | None, task_path: str) -> str:
    """The key's own part, the whole key in its title (the list's cells stay narrow)."""
    if not key:
        return EMPTY
    short = short_key(key, task_path)
    return format_html('<span class="jobs-key" title="{}">{}</span>', key, short)


def page_context(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    title: str,
    *,
    trail: tuple[tuple[str, str | None], ...] = (),
    here: str | None = None,
    refresh: int = 0,
) -> dict[str, Any]:
    """What every jobs page's template needs besides its own facts: the admin's context,
    the breadcrumbs (home, the app, ``trail``, then ``here`` or the title), the time zone
    the dates are in, and the auto-refresh interval (0: the page does not refresh)."""
    site = model_admin.admin_site.name
    opts = model_admin.model._meta
    crumbs = [
        (gettext("Home"), reverse(f"{site}:index")),
        (opts.app_config.verbose_name, reverse(f"{site}:app_list", args=[opts.app_label])),
        *trail,
        (here or title, None),
    ]
    return {
        **model_admin.admin_site.each_context(request),
        "opts": opts,
        "title": title,
        "jobs_crumbs": crumbs,
        "jobs_breadcrumbs_as_list": BREADCRUMBS_AS_LIST,
        "jobs_time_zone": timezone.get_current_timezone_name(),
        "jobs_refresh": refresh,
    }


def bounded_view(model_admin: admin.ModelAdmin, view: Callable[..., HttpResponse]):
    """``view`` with every statement it runs on the jobs database, rendering included,
    limited to the admin class's ``statement_timeout`` seconds (``ops(db).statement_timeout``:
    PostgreSQL's ``statement_timeout`` local to a transaction, MariaDB's
    ``max_statement_time``, a progress handler on SQLite). A statement that runs out answers
    a page that says so (503), not a 500. GET and HEAD only: an action (POST) runs the
    operations' own short transactions, which a timeout must not cut in the middle."""

    @functools.wraps(view)
    def bounded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        seconds = getattr(model_admin, "statement_timeout", STATEMENT_TIMEOUT)
        if request.method not in ("GET", "HEAD") or not seconds:
            return view(request, *args, **kwargs)
        db = JobsSettings.load().database
        try:
            with ops(db).statement_timeout(db, seconds):
                response = view(request, *args, **kwargs)
                # A TemplateResponse runs its queries as it renders: inside the limit.
                if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
                    response.render()
                return response
        except DatabaseError as error:
            if not ops(db).is_statement_timeout(error):
                raise
            return timed_out(model_admin, request, seconds)

    return bounded


def timed_out(model_admin: admin.ModelAdmin, request: HttpRequest, seconds: float):
    """The page of a request whose statement ran past the limit: what happened and what to
    do (narrow the list), with the admin's navigation."""
    context = {
        **page_context(model_admin, request, "This page took too long"),
        "seconds": seconds,
        "back": request.get_full_path(),
    }
    response = TemplateResponse(request, "admin/django_jobs/timed_out.html", context, status=503)
    return response.render()


class JobsPermissionsMixin(ModelAdminMixin):
    """Delegates every permission to the ``Job`` model's; nothing is added or deleted here.

    Nothing is *changed* either, in the admin's sense of a form saving a row: a job, a
    batch, a recurring task or a key moves only through the pages' actions, which keep
    the execution rows and semaphores consistent. So the change permission is False
    (the app index says "View", the lists are not "Select job to change"), and an action
    asks ``has_act_permission``: the ``change_job`` permission.
    """

    # Seconds one statement of a page may run (``bounded_view``); 0: no limit.
    statement_timeout = STATEMENT_TIMEOUT

    @property
    def urls(self) -> list[Any]:
        """Every URL of the admin class, whatever its ``get_urls`` adds, through
        ``bounded_view``: each jobs page is bounded without opting in."""
        return [
            bounded_pattern(self, pattern) if isinstance(pattern, URLPattern) else pattern
            for pattern in self.get_urls()
        ]

    def has_module_permission(self, request: HttpRequest) -> bool:
        return can_view_jobs(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return can_view_jobs(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_act_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return can_act_on_jobs(request)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def require_act_permission(self, request: HttpRequest) -> None:
        if not self.has_act_permission(request):
            raise PermissionDenied

    def check_can_act(self, request: HttpRequest) -> None:
        """For an action's view: a POST from a user allowed to act, or 403; 400 if a
        value holds a NUL (the action looks its queue or key up)."""
        self.require_act_permission(request)
        if request.method != "POST":
            raise PermissionDenied
        refuse_nul(request.POST)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None):
        """The row, by its primary key for an empty ``?_to_field=`` too: Django's change
        form looks an empty field name up (FieldDoesNotExist, a 500)."""
        return super().get_object(request, object_id, from_field or None)

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


def bounded_pattern(model_admin: admin.ModelAdmin, pattern: URLPattern) -> URLPattern:
    return URLPattern(
        pattern.pattern,
        bounded_view(model_admin, pattern.callback),
        pattern.default_args,
        pattern.name,
    )


def filter_parameters(list_filter: Sequence[Any]) -> set[str]:
    """The query-string parameters of a list's filters: a field's own (``status``, the
    ``__exact`` and ``__isnull`` of Django's field filters) or a filter class's."""
    names: set[str] = set()
    for spec in list_filter:
        if isinstance(spec, str):
            names |= {spec, f"{spec}__exact", f"{spec}__isnull"}
        else:
            names.add(spec.parameter_name)
    return names


class ListTitleMixin(ModelAdminMixin):
    """A list titled by its name ("Jobs"), not "Select job to change": rows are opened to
    be read, and acted on through buttons. Its status line names the time zone of its dates.

    It filters by its own filters' parameters only (any other answers 400): Django's admin
    otherwise takes any lookup on the model's fields from the URL, and a value the database
    refuses (``?attempts__regex=[``, ``?args__contains=`` on SQLite) answered 500.
    """

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        allowed = lookup in filter_parameters(self.list_filter)
        return allowed and super().lookup_allowed(lookup, value, request)

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        refuse_nul(request.GET)
        context = {
            "title": self.model._meta.verbose_name_plural.capitalize(),
            "now": timezone.now(),
            "jobs_time_zone": timezone.get_current_timezone_name(),
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)


class PageAdmin(JobsPermissionsMixin, admin.ModelAdmin):
    """An admin entry that is one page (dashboard, stuck, blocked), not a table's list."""

    template_name = ""
    title = ""
    # Seconds between the page's own refreshes (0: it never refreshes by itself).
    refresh_seconds = 0

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
        refuse_nul(request.GET)
        context = {
            **page_context(self, request, self.title, refresh=self.refresh_seconds),
            "can_act": self.has_act_permission(request),
            **self.page_context(request),
            **(extra_context or {}),
        }
        return TemplateResponse(request, self.template_name, context)
