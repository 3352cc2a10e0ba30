"""What a job waits for and what waits for it, as its page and its workflow's page show it.

A job may wait for ten thousand others (a batch's items) and be waited for by as many:
each side is read with a LIMIT and counted up to the paginator's cap, never in full.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from django_jobs.admin.pagination import COUNT_CAP
from django_jobs.core import operator
from django_jobs.models import AwaitingExecution, Job, JobDependency, JobStatus, Workflow

# Jobs listed on each side of a job's page; the rest are counted.
LINKS_SHOWN = 50
# A job no row has any more (pruned): what a page says in place of its status.
PRUNED = "pruned"


@dataclass(frozen=True)
class Linked:
    """A job on the other end of an edge."""

    id: int
    status: str


@dataclass
class Side:
    """One side of a job's edges: the first ``LINKS_SHOWN`` and how many in all (counted
    up to ``COUNT_CAP + 1``, which means "more than")."""

    jobs: list[Linked] = field(default_factory=list)
    count: int = 0

    @property
    def more(self) -> int:
        return max(0, self.count - len(self.jobs))

    @property
    def capped(self) -> bool:
        return self.count > COUNT_CAP


@dataclass
class JobEdges:
    waits_for: Side
    waited_by: Side
    # How many of its dependencies have not ended yet, while it is awaiting them.
    remaining: int | None
    workflow: Workflow | None
    # The workflow it names, when its row is gone (pruned).
    workflow_id: int | None


def statuses(db: str, ids: Collection[int]) -> dict[int, str]:
    """The status of each job of ``ids`` (a pruned one is missing)."""
    if not ids:
        return {}
    return dict(Job.objects.using(db).filter(pk__in=list(ids)).values_list("pk", "status"))


def side(db: str, ids: list[int], counted: int | None = None) -> Side:
    """``ids`` (read with a LIMIT of ``LINKS_SHOWN + 1``) with their statuses."""
    shown = ids[:LINKS_SHOWN]
    known = statuses(db, shown)
    return Side(
        jobs=[Linked(pk, known.get(pk, PRUNED)) for pk in shown],
        count=len(ids) if counted is None else counted,
    )


def job_edges(db: str, job: Job) -> JobEdges:
    """A fixed number of queries, however many jobs are on either side."""
    parents = JobDependency.objects.using(db).filter(job_id=job.pk)
    parent_ids = list(
        parents.order_by("position", "pk").values_list("depends_on_id", flat=True)[
            : LINKS_SHOWN + 1
        ]
    )
    children = JobDependency.objects.using(db).filter(depends_on_id=job.pk)
    child_ids = list(
        children.order_by("job_id").values_list("job_id", flat=True)[: LINKS_SHOWN + 1]
    )
    remaining = None
    if job.status == JobStatus.AWAITING:
        remaining = (
            AwaitingExecution.objects.using(db)
            .filter(job_id=job.pk)
            .values_list("remaining", flat=True)
            .first()
        )
    workflow = None
    if job.workflow_id is not None:
        workflow = Workflow.objects.using(db).filter(pk=job.workflow_id).first()
    return JobEdges(
        waits_for=side(db, parent_ids, capped_count(parents, parent_ids)),
        waited_by=side(db, child_ids, capped_count(children, child_ids)),
        remaining=remaining,
        workflow=workflow,
        workflow_id=job.workflow_id,
    )


def capped_count(rows, read: list[int]) -> int:
    """How many ``rows`` there are: ``read`` said it when it was not cut by its LIMIT."""
    if len(read) <= LINKS_SHOWN:
        return len(read)
    return rows.order_by()[: COUNT_CAP + 1].count()


def retry_refusal(db: str, job_id: int) -> str:
    """Why ``retry_failed_job`` said no (``operator.retry_refusal``), as a page says it."""
    reason = operator.retry_refusal(db, job_id)
    return f"{reason}; reload the page" if reason == operator.RETRY_RACED else reason
