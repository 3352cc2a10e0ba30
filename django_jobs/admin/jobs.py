"""The job list (filters, search, bulk actions) and one job's page (timeline, attempts, what
it waits for, actions)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import ShowFacets
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import BadRequest
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.html import format_html

from django_jobs.admin import pagination, search
from django_jobs.admin.base import (
    DATETIME_FORMAT,
    REFRESH_SECONDS,
    JobsPermissionsMixin,
    ListTitleMixin,
    as_id,
    format_datetime,
    key_html,
    local_time,
    page_context,
)
from django_jobs.admin.dependencies import job_edges, retry_refusal
from django_jobs.admin.filters import (
    BatchFilter,
    ConcurrencyKeyFilter,
    FinishedSinceFilter,
    QueueFilter,
    TaskFilter,
    WorkflowFilter,
)
from django_jobs.conf import JobsSettings
from django_jobs.core import operator as operations
from django_jobs.core.operator import (
    CANCELLABLE,
    CANCELLED,
    DISCARDABLE,
    RETRYABLE,
    cancel_job,
)
from django_jobs.core.progress import Progress, amount, from_row
from django_jobs.db.json_values import Unreadable
from django_jobs.exceptions import JobAlreadyFinished, JobNotFound
from django_jobs.models import (
    FINISHED_STATUSES,
    AwaitingExecution,
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    ScheduledExecution,
)

# What a job's page shows of what is unbounded: a job may fail a million times, and each
# failure keeps a 2,000-character message and a 64 KiB traceback; its arguments and its
# return value may take 1 MiB of JSON each; it keeps the id of the worker of each attempt.
FAILURES_SHOWN = 20
WORKERS_SHOWN = 10
JSON_SHOWN = 20_000  # characters of each of args, kwargs and the return value
MESSAGE_SHOWN = 2_000
TRACEBACK_SHOWN = 10_000
# The columns the list never shows, left unread: 50 rows of them could weigh 150 MiB.
LIST_DEFERRED = ("args", "kwargs", "return_value", "worker_ids", "backoff", "trace_context")


def jobs_db() -> str:
    return JobsSettings.load().database


def shortened(text: str, limit: int) -> str:
    """``text`` whole, or its start and its end (where a traceback names its error) with
    how much of it is left out between them: a page stays usable whatever a job stored."""
    if len(text) <= limit:
        return text
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[… {cut:,} of {len(text):,} characters not shown …]\n{text[-half:]}"


def as_json(value: Any) -> str:
    if isinstance(value, Unreadable):  # a hand-written row's text, shown as stored
        return shortened(f"(cannot be read: {value.reason})\n{value.text}", JSON_SHOWN)
    return shortened(json.dumps(value, indent=2, ensure_ascii=False), JSON_SHOWN)


def recent_failures(job: Job) -> tuple[list[FailedExecution], int]:
    """The job's last ``FAILURES_SHOWN`` failed attempts, oldest first, and how many it
    has in all (counted up to the list's cap, past which the page says "more than")."""
    failures = job.failures.using(jobs_db())
    shown = list(failures.order_by("-attempt", "-pk")[:FAILURES_SHOWN])[::-1]
    for failure in shown:
        failure.message = shortened(failure.message, MESSAGE_SHOWN)
        failure.traceback = shortened(failure.traceback, TRACEBACK_SHOWN)
    if len(shown) < FAILURES_SHOWN:
        return shown, len(shown)
    return shown, failures[: pagination.COUNT_CAP + 1].count()


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def no_execution(job: Job) -> str:
    """Why the job's page shows no execution row, in a sentence."""
    outcomes: dict[str, str] = {
        JobStatus.SUCCEEDED: "it succeeded",
        JobStatus.FAILED: "it failed",
        JobStatus.DISCARDED: "it was discarded",
    }
    outcome = outcomes.get(job.status)
    if outcome:
        return f"None: the job has finished ({outcome}), and a finished job keeps no execution row."
    return (
        f"None, although the job is {job.get_status_display().lower()}: it may have just "
        "moved on; reload the page."
    )


def shown(value: Any) -> Any:
    """A value of the execution row as the page shows it (dates in the pages' one format)."""
    return format_datetime(value) if isinstance(value, datetime) else value


def job_progress(job: Job) -> Progress | None:
    """The progress the job last reported (``set_progress``), None if it reported none."""
    return from_row(job.progress_done, job.progress_total, job.progress_message, job.progress_at)


def progress_cell(progress: Progress) -> str:
    """The list's compact form: a small bar and the percentage, or the count done; the
    numbers, the message and when it was reported in the title."""
    title = progress.summary + (f": {progress.message}" if progress.message else "")
    reported = format_date(local_time(progress.updated_at), DATETIME_FORMAT)
    title += f" (reported {reported})"
    if progress.fraction is None:
        return format_html(
            '<span class="jobs-progress" title="{}">{} done</span>', title, amount(progress.done)
        )
    return format_html(
        '<span class="jobs-progress" title="{}"><progress max="100" value="{}"></progress> '
        "{}%</span>",
        title,
        progress.percent,
        progress.percent,
    )


def retried(db: str, job_id: int) -> str:
    """Where a retried job went: back in its queue, or waiting for its dependencies again."""
    status = Job.objects.using(db).filter(pk=job_id).values_list("status", flat=True).first()
    if status == JobStatus.AWAITING:
        return "it waits again for the jobs it depends on, then runs"
    return "it is queued again"


def current_execution(job: Job) -> dict[str, Any] | None:
    """The execution row the job is in now, as label/value pairs for the detail page."""
    db = jobs_db()
    claims = ClaimedExecution.objects.using(db).filter(job_id=job.pk)
    claim = claims.select_related("process").first()
    if claim is not None:
        process = claim.process
        return {
            "table": "claimed",
            "rows": [
                (
                    "Process",
                    f"{process.name} on {process.hostname} (pid {process.pid})"
                    if process
                    else f"#{claim.process_id} (no longer registered)",
                ),
                ("Claimed at", shown(claim.created_at)),
                ("Lease expires at", shown(claim.lease_expires_at or "no lease")),
            ],
        }
    for table, model, fields in (
        ("ready", ReadyExecution, [("Ready since", "created_at")]),
        ("scheduled", ScheduledExecution, [("Due at", "scheduled_at")]),
        (
            "blocked",
            BlockedExecution,
            [("Blocked since", "created_at"), ("Waiting on key", "concurrency_key")],
        ),
        (
            "awaiting",
            AwaitingExecution,
            [("Awaiting since", "created_at"), ("Dependencies not ended", "remaining")],
        ),
    ):
        row = model.objects.using(db).filter(job_id=job.pk).first()
        if row is not None:
            return {
                "table": table,
                "rows": [("Queue", row.queue_name), ("Priority", row.priority)]
                + [(label, shown(getattr(row, name))) for label, name in fields],
            }
    return None


class JobChangeList(ChangeList):
    """The job list, without the columns it does not show (``LIST_DEFERRED``)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        return super().get_queryset(request, exclude_parameters).defer(*LIST_DEFERRED)


@admin.register(Job)
class JobAdmin(ListTitleMixin, JobsPermissionsMixin, admin.ModelAdmin):
    list_display = (
        "job",
        "queue",
        "state",
        "key",
        "enqueued",
        "finished",
    )
    list_display_links = ("job",)
    list_filter = (
        "status",
        QueueFilter,
        TaskFilter,
        ConcurrencyKeyFilter,
        FinishedSinceFilter,
        BatchFilter,
        WorkflowFilter,
    )
    search_fields = ("id",)  # replaced by get_search_results; enables the search box
    search_help_text = (
        "An id (123), task:shop.tasks.sync (a prefix), queue:emails, key:account:42 "
        "(key:account:* a prefix), workflow:12, batch:7, customer_id=4242 (a keyword "
        "argument), arg:4242 (any argument), text:needle (the newest jobs' arguments); "
        "a bare word: task prefix, queue or key."
    )
    ordering = ("-id",)
    list_per_page = 50
    list_max_show_all = 200
    show_full_result_count = False
    # Facets (``?_facets=1``) count each filter's choices over the whole table.
    show_facets = ShowFacets.NEVER
    paginator = pagination.CappedCountPaginator
    actions = ("retry_selected", "discard_selected", "cancel_selected", "run_selected_now")
    change_list_template = "admin/django_jobs/job/change_list.html"
    # Reloaded, not swapped in place: Django's actions script binds the rows' checkboxes
    # once, when the page loads.
    refresh_seconds = REFRESH_SECONDS

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).using(jobs_db())

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return JobChangeList

    # --- list columns -----------------------------------------------------------------

    @admin.display(description="job", ordering="pk")
    def job(self, job: Job) -> str:
        """``#id name``: the job's id and its task's name, the task's path in the title."""
        name = job.task_path.rsplit(".", 1)[-1]
        return format_html(
            '#{} <span class="jobs-task" title="{}">{}</span>', job.pk, job.task_path, name
        )

    # Sortable only by what an index serves bounded by the page (docs/admin.md, "Sorting"):
    # the id, and the enqueue time as the id (ids are given in enqueue order). Queue, state,
    # key and finished time have no index that yields them in order with the id after
    # them, so a sort by one read and sorted every job; their filters narrow the list.
    @admin.display(description="queue")
    def queue(self, job: Job) -> str:
        return job.queue_name

    @admin.display(description="key")
    def key(self, job: Job) -> str:
        """The key without the task path it repeats; the whole key in the title."""
        return key_html(job.concurrency_key, job.task_path)

    @admin.display(description="enqueued", ordering="pk")
    def enqueued(self, job: Job) -> str:
        return format_datetime(job.enqueued_at)

    @admin.display(description="finished")
    def finished(self, job: Job) -> str:
        return format_datetime(job.finished_at)

    @admin.display(description="state")
    def state(self, job: Job) -> str:
        """The state, then attempts made of those allowed (one column: the list fits), then
        a running job's progress, when its task reports one."""
        html = format_html(
            '<span class="jobs-state jobs-{}">{}</span> '
            '<span title="attempt {} of {}">{}/{}</span>',
            job.status,
            job.status,
            job.attempts,
            job.max_attempts,
            job.attempts,
            job.max_attempts,
        )
        progress = job_progress(job) if job.status == JobStatus.RUNNING else None
        if progress is not None:
            html = format_html("{} {}", html, progress_cell(progress))
        return html

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str):
        """The search box's syntax (admin/search.py): each form from an index, or a scan of
        the newest jobs that the page names."""
        found = search.parse(search_term, queryset.db)
        if found is None:
            return queryset, False
        return found.apply(queryset), False

    def response_action(self, request: HttpRequest, queryset: QuerySet, *args, **kwargs):
        """Django filters by the ticked ids as they were posted: one that is no id ("²",
        past the bigint range) raised there, a 500. A browser only posts the list's own."""
        ticked = request.POST.getlist(ACTION_CHECKBOX_NAME)
        if any(as_id(value) is None for value in ticked):
            raise BadRequest("A selected job id is not an id.")
        return super().response_action(request, queryset, *args, **kwargs)

    # --- one job's page ------------------------------------------------------------------

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None
    ):
        job = self.object_to_show(request, object_id, "use the job's action buttons")
        can_act = self.has_act_permission(request, job)
        progress = job_progress(job)
        failures, failure_count = recent_failures(job)
        workers = job.worker_ids if isinstance(job.worker_ids, list) else []
        context = {
            **page_context(
                self,
                request,
                f"Job #{job.pk}: {job.task_path}",
                trail=(("Jobs", self.list_url()),),
                here=f"#{job.pk}",
                # An unfinished job's page follows it (its state, its progress) by itself.
                refresh=0 if job.status in FINISHED_STATUSES else self.refresh_seconds,
            ),
            "now": timezone.now(),
            "job": job,
            "args_json": as_json(job.args),
            "kwargs_json": as_json(job.kwargs),
            "return_json": as_json(job.return_value),
            "attempts": failures,
            "failure_count": failure_count,
            "failures_capped": failure_count > pagination.COUNT_CAP,
            "count_cap": pagination.COUNT_CAP,
            "workers": workers[-WORKERS_SHOWN:],
            "earlier_workers": max(0, len(workers) - WORKERS_SHOWN),
            "execution": current_execution(job),
            "edges": job_edges(jobs_db(), job),
            "no_execution": no_execution(job),
            "can_retry": can_act and job.status in RETRYABLE,
            "can_discard": can_act and job.status in DISCARDABLE,
            "can_run_now": can_act and job.status == JobStatus.BLOCKED,
            "can_cancel": can_act and job.status in CANCELLABLE,
            "progress": progress,
        }
        return TemplateResponse(request, "admin/django_jobs/job/detail.html", context)

    def get_urls(self):
        def wrap(view):
            return self.admin_site.admin_view(view)

        return [
            path("<jobs_id:job_id>/retry/", wrap(self.retry_view), name="django_jobs_job_retry"),
            path(
                "<jobs_id:job_id>/discard/", wrap(self.discard_view), name="django_jobs_job_discard"
            ),
            path("<jobs_id:job_id>/cancel/", wrap(self.cancel_view), name="django_jobs_job_cancel"),
            path(
                "<jobs_id:job_id>/run-now/", wrap(self.run_now_view), name="django_jobs_job_run_now"
            ),
            *super().get_urls(),
        ]

    def job_url(self, job_id: int) -> str:
        return reverse(f"{self.admin_site.name}:django_jobs_job_change", args=[job_id])

    def list_url(self) -> str:
        return reverse(f"{self.admin_site.name}:django_jobs_job_changelist")

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        """The list, with the line saying which time zone its dates are in, what a search
        searched, and its auto-refresh, which a scan turns off (it reads up to
        ``search.SCAN_WINDOW`` jobs)."""
        # Parsing reads nothing: a NUL in the term is refused (400) by the list itself.
        found = search.parse(request.GET.get("q", ""), jobs_db())
        scanning = found is not None and found.scan
        context = {
            "jobs_search": found,
            "jobs_refresh": 0 if scanning else self.refresh_seconds,
            "jobs_refresh_mode": "reload",
            "jobs_refresh_off": "Not refreshed by itself while it shows a scan of the arguments."
            if scanning
            else "",
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)

    def retry_view(self, request: HttpRequest, job_id: int) -> HttpResponse:
        self.require_act_permission(request)
        if request.method != "POST":
            return HttpResponse(status=405)
        db = jobs_db()
        if operations.retry_failed_job(db, job_id):
            messages.success(request, f"Job #{job_id} will be retried: {retried(db, job_id)}.")
        else:
            messages.warning(
                request, f"Job #{job_id} was not retried: {retry_refusal(db, job_id)}."
            )
        return HttpResponseRedirect(self.job_url(job_id))

    def discard_view(self, request: HttpRequest, job_id: int) -> HttpResponse:
        self.require_act_permission(request)
        if request.method != "POST":
            return HttpResponse(status=405)
        if operations.discard(jobs_db(), job_id):
            messages.success(request, f"Job #{job_id} was discarded.")
        else:
            messages.warning(
                request,
                f"Job #{job_id} was not discarded: it is running or claimed, or already finished.",
            )
        return HttpResponseRedirect(self.job_url(job_id))

    def cancel_view(self, request: HttpRequest, job_id: int) -> HttpResponse:
        """Cancel a waiting job at once, or ask a running one's worker to stop it."""
        self.require_act_permission(request)
        if request.method != "POST":
            return HttpResponse(status=405)
        try:
            outcome = cancel_job(jobs_db(), job_id)
        except JobNotFound:
            messages.warning(request, f"Job #{job_id} was not cancelled: there is no such job.")
            return HttpResponseRedirect(self.list_url())
        except JobAlreadyFinished:
            messages.warning(request, f"Job #{job_id} was not cancelled: it has already ended.")
        else:
            if outcome == CANCELLED:
                messages.success(request, f"Job #{job_id} was cancelled: it will not run.")
            else:
                messages.success(
                    request,
                    f"Job #{job_id}: stop requested. Its worker stops it within seconds; it "
                    "then ends failed (JobCancelled), never retried.",
                )
        return HttpResponseRedirect(self.job_url(job_id))

    def run_now_view(self, request: HttpRequest, job_id: int) -> HttpResponse:
        """GET asks for confirmation (it bypasses the limit); POST does it."""
        self.require_act_permission(request)
        job = get_object_or_404(Job.objects.using(jobs_db()), pk=job_id)
        if request.method == "POST":
            self.run_now(request, [job_id])
            return HttpResponseRedirect(self.job_url(job_id))
        return self.confirm_run_now(request, [job], single=True)

    # --- bulk actions --------------------------------------------------------------------

    @admin.action(description="Retry selected failed jobs", permissions=["act"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet) -> None:
        ids = list(queryset.values_list("pk", flat=True))
        done = operations.retry_failed_jobs(jobs_db(), ids)
        self.report(request, done, len(ids), "retried", "they were not failed")

    @admin.action(description="Discard selected waiting or failed jobs", permissions=["act"])
    def discard_selected(self, request: HttpRequest, queryset: QuerySet) -> None:
        ids = list(queryset.values_list("pk", flat=True))
        done = operations.discard_many(jobs_db(), ids)
        self.report(request, done, len(ids), "discarded", "they were running or finished")

    @admin.action(description="Cancel selected waiting or running jobs", permissions=["act"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Each through ``cancel_job``, one at a time in id order (one lock at a time)."""
        db = jobs_db()
        outcomes = {"cancelled": 0, "requested": 0, "not": 0}
        for job_id in sorted(set(queryset.values_list("pk", flat=True))):
            try:
                outcomes[cancel_job(db, job_id)] += 1
            except (JobNotFound, JobAlreadyFinished):
                outcomes["not"] += 1
        if outcomes["cancelled"]:
            messages.success(request, f"{plural(outcomes['cancelled'], 'job')} cancelled.")
        if outcomes["requested"]:
            messages.success(
                request,
                f"{plural(outcomes['requested'], 'running job')}: stop requested (their "
                "workers stop them within seconds).",
            )
        if outcomes["not"]:
            messages.warning(
                request,
                f"{plural(outcomes['not'], 'job')} not cancelled: they had already ended.",
            )

    @admin.action(
        description="Run selected blocked jobs now, past their limit", permissions=["act"]
    )
    def run_selected_now(self, request: HttpRequest, queryset: QuerySet) -> TemplateResponse | None:
        if request.POST.get("confirmed") == "yes":
            self.run_now(request, list(queryset.values_list("pk", flat=True)))
            return None
        return self.confirm_run_now(request, list(queryset[:200]))

    def run_now(self, request: HttpRequest, ids: list[int]) -> None:
        db = jobs_db()
        done = sum(operations.run_blocked_now(db, job_id) for job_id in sorted(set(ids)))
        self.report(request, done, len(ids), "made ready past their limit", "they were not blocked")

    def confirm_run_now(
        self, request: HttpRequest, jobs: list[Job], single: bool = False
    ) -> TemplateResponse:
        """The confirmation page: of one job's page (``single``) or of the list's action."""
        context = {
            **page_context(
                self, request, "Run blocked jobs now?", trail=(("Jobs", self.list_url()),)
            ),
            "jobs": jobs,
            "blocked": [job for job in jobs if job.status == JobStatus.BLOCKED],
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "single": single,
        }
        return TemplateResponse(request, "admin/django_jobs/job/run_now_confirm.html", context)

    def report(self, request: HttpRequest, done: int, asked: int, verb: str, why: str) -> None:
        if done:
            messages.success(request, f"{plural(done, 'job')} {verb}.")
        if asked - done:
            messages.warning(request, f"{plural(asked - done, 'job')} not {verb}: {why}.")
