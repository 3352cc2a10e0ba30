"""Workflows: the list with each one's state, and one workflow's page (its graph, drawn on
the server, a table of its jobs, and the operator's actions: cancel it, retry a failed job).

A workflow's state is never counted here: ``workflow_states`` (core/workflows.py) is the
one place it is computed, for a page of the list in one grouped query. A workflow may have
100,000 jobs, so its page reads the first ``NODES_SHOWN`` and draws them only when that is
all of them and no more than ``graph.MAX_DRAWN``; the full list is the job list filtered
by workflow.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import ShowFacets
from django.contrib.admin.views.main import ChangeList
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from django_jobs.admin import graph, pagination
from django_jobs.admin.base import (
    REFRESH_SECONDS,
    JobsPermissionsMixin,
    ListTitleMixin,
    format_datetime,
    page_context,
)
from django_jobs.admin.dependencies import PRUNED, retry_refusal, statuses
from django_jobs.conf import JobsSettings
from django_jobs.core import operator as operations
from django_jobs.core.workflows import (
    CANCELLED,
    FAILED,
    RUNNING,
    SUCCEEDED,
    WORKFLOW_STATUSES,
    WorkflowState,
    end_workflow,
    workflow_states,
)
from django_jobs.models import (
    FINISHED_STATUSES,
    AwaitingExecution,
    Job,
    JobDependency,
    JobStatus,
    Workflow,
)

# The jobs a workflow's page lists (and draws, when they are all of them).
NODES_SHOWN = graph.MAX_DRAWN
NODE_FIELDS = ("id", "task_path", "status", "attempts", "max_attempts", "finished_at")
# Edges read for the jobs shown: a job may wait for thousands. Past it the graph is not
# drawn and the rows it cut say so.
EDGES_READ = 5_000
# Jobs a row of the table names as what it waits for.
WAITS_SHOWN = 10
# Where the list keeps each row's state (read for its page of rows, in one query).
STATE = "_jobs_workflow_state"


def jobs_db() -> str:
    return JobsSettings.load().database


def state_of(workflow: Workflow) -> WorkflowState:
    return getattr(workflow, STATE)


class StatusFilter(admin.SimpleListFilter):
    """By the state ``workflow_states`` gives, as a query: an ending written on the row,
    else whether the workflow has jobs that have not ended, or that did not succeed. Each
    test is one probe of the ``(workflow, status)`` index per workflow, so a page costs
    what its rows do; tests/test_admin_workflows.py checks it agrees with
    ``workflow_states`` for every state."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin):
        return [(status, status.capitalize()) for status in WORKFLOW_STATUSES]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        jobs = Job.objects.filter(workflow_id=OuterRef("pk"))
        unfinished = Exists(jobs.exclude(status__in=FINISHED_STATUSES))
        not_succeeded = Exists(jobs.exclude(status=JobStatus.SUCCEEDED))
        open_ = Q(ended_as__isnull=True)
        wanted = {
            RUNNING: open_ & unfinished,
            SUCCEEDED: open_ & ~not_succeeded,
            FAILED: Q(ended_as=Workflow.Ending.FAILED) | (open_ & ~unfinished & not_succeeded),
            CANCELLED: Q(ended_as=Workflow.Ending.CANCELLED),
        }.get(self.value() or "")
        return queryset if wanted is None else queryset.filter(wanted)


class WorkflowChangeList(ChangeList):
    """The list, each row's state read for the page's rows in one grouped query."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        rows = list(self.result_list)
        states = workflow_states(jobs_db(), rows)
        for workflow in rows:
            setattr(workflow, STATE, states[workflow.pk])


def id_urls(name: str, *leading: Any) -> Callable[[int], str]:
    """``reverse(name, args=[*leading, pk])`` for any ``pk``, at the cost of one ``reverse``:
    a workflow's page links each of up to 600 jobs, and 600 ``{% url %}`` tags took a
    third of its time."""
    marker = "9" * 19  # a valid id (``jobs_id``) no pattern part contains
    head, _, tail = reverse(name, args=[*leading, marker]).rpartition(marker)
    return lambda pk: f"{head}{int(pk)}{tail}"


@dataclass
class Link:
    """A job a row of the table names: its id, status and page."""

    id: int
    status: str
    url: str


@dataclass
class NodeRow:
    """A row of a workflow's table of jobs."""

    job: Job
    url: str = ""
    # Its finished time as every page shows a date (``format_datetime``).
    finished: str = ""
    waits_for: list[Link] = field(default_factory=list)
    # How many more it waits for than ``waits_for`` names; None: unknown, its edges were
    # cut by ``EDGES_READ`` (its own page lists them).
    more: int | None = 0
    remaining: int | None = None


@dataclass
class Nodes:
    rows: list[NodeRow]
    edges: list[tuple[int, int]]
    # The workflow has more jobs than the table lists.
    more_jobs: bool
    # Some job has more edges than were read.
    edges_cut: bool


def first_jobs(db: str, workflow_id: int, of_statuses: Iterable[str], limit: int) -> list[Job]:
    """The workflow's first ``limit`` jobs by id, among those of ``of_statuses``: the first
    ``limit`` of each status, merged, each read from an index range of
    ``jobs_job_workflow_nodes`` (workflow, status, id). One read ordered by id alone found
    no such range on PostgreSQL, which walked the primary key from the table's first job
    instead: 2.4 s for a 100,000-job workflow behind 3,000,000 finished jobs."""
    found: dict[int, Job] = {}
    for status in sorted(set(of_statuses)):
        rows = (
            Job.objects.using(db)
            .filter(workflow_id=workflow_id, status=status)
            .order_by("pk")
            .only(*NODE_FIELDS)[:limit]
        )
        found.update((job.pk, job) for job in rows)
    return [found[pk] for pk in sorted(found)[:limit]]


def read_nodes(
    db: str, workflow_id: int, of_statuses: Iterable[str], job_url: Callable[[int], str]
) -> Nodes:
    """The first ``NODES_SHOWN`` jobs (of ``of_statuses``: those its jobs have), their
    edges (at most ``EDGES_READ``), the status of the jobs outside them they wait for,
    and the remaining count of those awaiting: four queries and one per status."""
    jobs = first_jobs(db, workflow_id, of_statuses, NODES_SHOWN + 1)
    more_jobs = len(jobs) > NODES_SHOWN
    jobs = jobs[:NODES_SHOWN]
    ids = [job.pk for job in jobs]
    edges = list(
        JobDependency.objects.using(db)
        .filter(job_id__in=ids)
        .order_by("job_id", "position", "pk")
        .values_list("depends_on_id", "job_id")[: EDGES_READ + 1]
    )
    edges_cut = len(edges) > EDGES_READ
    edges = edges[:EDGES_READ]
    # A job whose edges may continue past the cut: the last one read.
    cut_at = edges[-1][1] if edges_cut and edges else None
    own = {job.pk: job.status for job in jobs}
    known = {**statuses(db, {parent for parent, _ in edges} - set(own)), **own}
    parents: dict[int, list[int]] = defaultdict(list)
    for parent, child in edges:
        parents[child].append(parent)
    remaining = dict(
        AwaitingExecution.objects.using(db)
        .filter(job_id__in=[job.pk for job in jobs if job.status == JobStatus.AWAITING])
        .values_list("job_id", "remaining")
    )
    rows = []
    for job in jobs:
        listed = parents[job.pk]
        cut = cut_at is not None and job.pk >= cut_at
        rows.append(
            NodeRow(
                job=job,
                url=job_url(job.pk),
                finished=format_datetime(job.finished_at),
                waits_for=[
                    Link(pk, known.get(pk, PRUNED), job_url(pk)) for pk in listed[:WAITS_SHOWN]
                ],
                more=None if cut else max(0, len(listed) - WAITS_SHOWN),
                remaining=remaining.get(job.pk),
            )
        )
    return Nodes(rows=rows, edges=edges, more_jobs=more_jobs, edges_cut=edges_cut)


@admin.register(Workflow)
class WorkflowAdmin(ListTitleMixin, JobsPermissionsMixin, admin.ModelAdmin):
    list_display = ("label", "id", "status", "done", "jobs", "created", "finished")
    list_display_links = ("label", "id")
    list_filter = (StatusFilter,)
    ordering = ("-id",)
    list_per_page = 50
    list_max_show_all = 200
    show_full_result_count = False
    # Facets (``?_facets=1``) count each filter's choices over the whole table.
    show_facets = ShowFacets.NEVER
    paginator = pagination.CappedCountPaginator
    actions = None
    change_list_template = "admin/django_jobs/workflow/change_list.html"
    refresh_seconds = REFRESH_SECONDS

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).using(jobs_db())

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return WorkflowChangeList

    # --- list columns -----------------------------------------------------------------

    @admin.display(description="name", ordering="name")
    def label(self, workflow: Workflow) -> str:
        return workflow.name or "(no name)"

    @admin.display(description="status")
    def status(self, workflow: Workflow) -> str:
        status = state_of(workflow).status
        return format_html('<span class="jobs-state jobs-{}">{}</span>', status, status)

    @admin.display(description="done")
    def done(self, workflow: Workflow) -> str:
        """Its jobs that have ended (whatever their outcome), of all its jobs."""
        state = state_of(workflow)
        return f"{state.total - state.unfinished}/{state.total}"

    @admin.display(description="jobs")
    def jobs(self, workflow: Workflow) -> str:
        return counts_html(state_of(workflow))

    @admin.display(description="created", ordering="created_at")
    def created(self, workflow: Workflow) -> str:
        return format_datetime(workflow.created_at)

    @admin.display(description="finished")
    def finished(self, workflow: Workflow) -> str:
        return format_datetime(state_of(workflow).finished_at)

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        """The list follows its workflows' states by itself (no rows to tick: swapped)."""
        context = {"jobs_refresh": self.refresh_seconds, **(extra_context or {})}
        return super().changelist_view(request, context)

    # --- one workflow's page ---------------------------------------------------------------

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None
    ):
        """Read-only: a workflow moves only through its jobs and the page's actions."""
        workflow = self.object_to_show(request, object_id, "use the workflow's action buttons")
        return TemplateResponse(
            request,
            "admin/django_jobs/workflow/detail.html",
            self.workflow_context(request, workflow),
        )

    def workflow_context(self, request: HttpRequest, workflow: Workflow) -> dict[str, Any]:
        """A fixed number of queries whatever the workflow's size."""
        db = jobs_db()
        state = workflow_states(db, [workflow])[workflow.pk]
        job_url = id_urls(f"{self.admin_site.name}:django_jobs_job_change")
        nodes = read_nodes(db, workflow.pk, state.counts, job_url)
        drawable = not nodes.more_jobs and not nodes.edges_cut and state.total <= graph.MAX_DRAWN
        drawing = None
        if drawable and nodes.rows:
            drawing = graph.layout(
                [
                    graph.GraphJob(row.job.pk, row.job.task_path, row.job.status, row.url)
                    for row in nodes.rows
                ],
                nodes.edges,
            )
        can_act = self.has_act_permission(request, workflow)
        parent = None
        if workflow.parent_job_id is not None:
            parent = (
                Job.objects.using(db)
                .filter(pk=workflow.parent_job_id)
                .only("id", "task_path", "status")
                .first()
            )
        name = workflow.name or "(no name)"
        return {
            **page_context(
                self,
                request,
                f"Workflow #{workflow.pk}: {name}",
                trail=(("Workflows", self.list_url()),),
                here=f"#{workflow.pk}",
                refresh=self.refresh_seconds if state.unfinished else 0,
            ),
            "now": timezone.now(),
            "workflow": workflow,
            "state": state,
            "counts": counts_html(state),
            "done": state.total - state.unfinished,
            "drawing": drawing,
            "too_large": not drawable,
            "edges_read": EDGES_READ,
            "rows": nodes.rows,
            "more_jobs": nodes.more_jobs,
            "edges_cut": nodes.edges_cut,
            "nodes_shown": NODES_SHOWN,
            "parent": parent,
            "can_act": can_act,
            "can_cancel": can_act and state.unfinished > 0,
        }

    def get_urls(self):
        def wrap(view):
            return self.admin_site.admin_view(view)

        return [
            path(
                "<jobs_id:workflow_id>/cancel/",
                wrap(self.cancel_view),
                name="django_jobs_workflow_cancel",
            ),
            path(
                "<jobs_id:workflow_id>/retry/<jobs_id:job_id>/",
                wrap(self.retry_view),
                name="django_jobs_workflow_retry",
            ),
            *super().get_urls(),
        ]

    def list_url(self) -> str:
        return reverse(f"{self.admin_site.name}:django_jobs_workflow_changelist")

    def workflow_url(self, workflow_id: int) -> str:
        return reverse(f"{self.admin_site.name}:django_jobs_workflow_change", args=[workflow_id])

    def cancel_view(self, request: HttpRequest, workflow_id: int) -> HttpResponse:
        """End the workflow as cancelled: its waiting jobs end now, its running ones are
        asked to stop (``end_workflow``). Refused once every job has ended: the mark
        would turn a finished workflow's outcome into "cancelled"."""
        self.check_can_act(request)
        db = jobs_db()
        workflow = Workflow.objects.using(db).filter(pk=workflow_id).first()
        if workflow is None:
            messages.warning(request, f"Workflow #{workflow_id} was not cancelled: there is none.")
            return HttpResponseRedirect(self.list_url())
        state = workflow_states(db, [workflow])[workflow_id]
        if not state.unfinished:
            messages.warning(
                request,
                f"Workflow #{workflow_id} was not cancelled: every job of it has ended "
                f"({state.status}).",
            )
            return HttpResponseRedirect(self.workflow_url(workflow_id))
        left = end_workflow(db, workflow_id, Workflow.Ending.CANCELLED)
        ended = f"had already ended ({state.ended_as})" if state.ended_as else "cancelled"
        messages.success(
            request,
            f"Workflow #{workflow_id} {ended}: {left} job{'' if left == 1 else 's'} not yet "
            "ended were cancelled, or asked to stop if running; nothing of it starts now.",
        )
        return HttpResponseRedirect(self.workflow_url(workflow_id))

    def retry_view(self, request: HttpRequest, workflow_id: int, job_id: int) -> HttpResponse:
        """Retry a failed job of this workflow (``retry_failed_job``), which also brings
        back the jobs its failure ended; it refuses while a job it waits for is failed."""
        self.check_can_act(request)
        db = jobs_db()
        if not Job.objects.using(db).filter(pk=job_id, workflow_id=workflow_id).exists():
            messages.warning(
                request,
                f"Job #{job_id} was not retried: it is not a job of workflow #{workflow_id}.",
            )
        elif operations.retry_failed_job(db, job_id):
            messages.success(
                request,
                f"Job #{job_id} will be retried, and the jobs its failure ended wait for it again.",
            )
        else:
            messages.warning(
                request, f"Job #{job_id} was not retried: {retry_refusal(db, job_id)}."
            )
        return HttpResponseRedirect(self.workflow_url(workflow_id))


def counts_html(state: WorkflowState) -> str:
    """Its jobs per status, in the order a job moves through them; a status no job has
    is left out."""
    shown = [
        (status, state.counts[status]) for status in JobStatus.values if state.counts.get(status)
    ]
    shown += [(status, n) for status, n in state.counts.items() if status not in JobStatus.values]
    if not shown:
        return "no jobs (pruned)"
    return format_html_join(
        " ", '<span class="jobs-state jobs-{}">{} {}</span>', ((s, n, s) for s, n in shown)
    )
