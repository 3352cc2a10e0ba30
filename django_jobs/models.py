"""Tables: one durable ``Job`` row, and one execution row per state it can be in.

A job's state is *which execution row exists* (ready, scheduled, blocked,
claimed); ``Job.status`` mirrors it and is only ever written in the same
transaction that moves the execution row, so the two never disagree. Workers
poll only ``ReadyExecution``, which stays small however many finished jobs the
``Job`` table keeps.
"""

from __future__ import annotations

from django.db import models
from django.tasks import TaskResultStatus
from django.utils import timezone

from django_jobs.db.indexes import FlagIndex, NotNullIndex, NotNullUniqueConstraint, PostgresIndex
from django_jobs.db.json_values import TolerantJSONField
from django_jobs.db.lookups import exact_prefixes


class JobStatus(models.TextChoices):
    SCHEDULED = "scheduled", "Scheduled"
    READY = "ready", "Ready"
    BLOCKED = "blocked", "Blocked"
    # Waiting for the jobs it depends on (a workflow's node): an ``AwaitingExecution`` row.
    AWAITING = "awaiting", "Awaiting dependencies"
    CLAIMED = "claimed", "Claimed"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    DISCARDED = "discarded", "Discarded"


WAITING_STATUSES = (JobStatus.SCHEDULED, JobStatus.READY, JobStatus.BLOCKED, JobStatus.AWAITING)
FINISHED_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DISCARDED)

TASK_RESULT_STATUS = {
    JobStatus.SCHEDULED: TaskResultStatus.READY,
    JobStatus.READY: TaskResultStatus.READY,
    JobStatus.BLOCKED: TaskResultStatus.READY,
    JobStatus.AWAITING: TaskResultStatus.READY,
    # Claimed but not yet started: the function has not run, so not RUNNING.
    JobStatus.CLAIMED: TaskResultStatus.READY,
    JobStatus.RUNNING: TaskResultStatus.RUNNING,
    JobStatus.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    JobStatus.FAILED: TaskResultStatus.FAILED,
    JobStatus.DISCARDED: TaskResultStatus.FAILED,
}


class UniqueUntil(models.TextChoices):
    """How long a unique job keeps its ``unique_key`` from other enqueues."""

    START = "start", "until it starts (waiting jobs only)"
    FINISH = "finish", "until it finishes (waiting and running jobs)"


class Batch(models.Model):
    """A fan-in group: items count down ``pending``; the item that reaches 0 fires the callbacks.

    Every item's terminal transition updates this row under its lock in that
    item's own finalisation transaction, so exactly one transaction sees the
    batch complete, whichever workers finish the last items at once.
    """

    id = models.BigAutoField(primary_key=True)
    description = models.CharField(max_length=255, blank=True)
    total = models.PositiveIntegerField(default=0)
    pending = models.PositiveIntegerField(default=0)
    succeeded = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # {"on_finish": {"task_path", "queue_name", "priority", "backend"}, ...}
    callbacks = models.JSONField(default=dict, blank=True)
    # {"on_finish": job id, ...}: the callback jobs, once enqueued.
    callback_jobs = models.JSONField(default=dict, blank=True)
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)
    # The job that enqueued this batch, when a task (e.g. another batch's callback) did.
    parent_job_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        label = self.description or "batch"
        return f"{label} #{self.pk} ({self.total - self.pending}/{self.total} done)"

    @property
    def concurrency_key(self) -> str | None:
        return f"django_jobs.batch/{self.pk}" if self.concurrency_limit else None


class DependencyFailure(models.TextChoices):
    """What becomes of a job when one of the jobs it waits for fails for good (failed,
    cancelled or discarded): ``core/dependencies.py``."""

    CANCEL = "cancel", "cancel it (and, in turn, what waits for it)"
    RUN = "run", "run it anyway, once every dependency has ended"
    FAIL = "fail", "fail the whole workflow"


class Workflow(models.Model):
    """A graph of jobs that wait for one another, enqueued together (``workflow()``) or
    grown by ``using(after=...)``.

    Its state is read from its jobs (``core/workflows.py``), never counted here:
    a row every node's finish updated would serialise every finish of a wide workflow.
    Only an end decided for the whole graph (an operator's cancel, a node's
    ``on_dependency_failure="fail"``) is written, as ``ended_as``.
    """

    class Ending(models.TextChoices):
        CANCELLED = "cancelled", "Cancelled"
        FAILED = "failed", "Failed"

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=255, blank=True)
    ended_as = models.CharField(max_length=16, choices=Ending.choices, null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # The job that enqueued it, when a task did.
    parent_job_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"{self.name or 'workflow'} #{self.pk}"


class Job(models.Model):
    """One enqueued call, kept after it ends until pruned (docs/design.md section 2).

    No table points at a job with a database foreign key (``db_constraint=False``):
    PostgreSQL checks each such constraint with one query per deleted job row, which
    was 45 of the 52 microseconds of database time the prune spent per job (six
    execution tables, issue 37). The references are kept whole by the code instead:
    a job row is deleted only by the prune, which takes finished jobs (they have no
    ready, scheduled, blocked, claimed or awaiting row) with their failure rows and
    edges in the same transaction, rechecking the status under the row's lock; or by
    the ORM, whose ``on_delete=CASCADE`` still deletes the rows that point at it.
    tests/test_prune_jobs.py races a retry against the prune to prove the first.
    """

    id = models.BigAutoField(primary_key=True)
    backend = models.CharField(max_length=64, default="default")
    task_path = models.CharField(max_length=255)
    queue_name = models.CharField(max_length=128)
    priority = models.SmallIntegerField(default=0)
    args = TolerantJSONField(default=list)
    kwargs = TolerantJSONField(default=dict)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.READY)
    # An ``async def`` task's job: it runs on a worker's event loop, and a claim for room
    # on the loop alone takes only these (core/lanes.py). The database's default too: SQL
    # that writes job rows without naming it (older procedures) writes sync jobs.
    is_async = models.BooleanField(default=False, db_default=False)

    run_after = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    attempts = models.PositiveIntegerField(default=0)
    # Seconds one attempt may run before it is interrupted (JobTimeout); None: no limit.
    timeout = models.FloatField(null=True, blank=True)
    # Set by django_jobs.cancel(): a waiting job is cancelled at once, a running one is
    # asked to stop; read by its worker (and by recovery, if that worker dies).
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    max_attempts = models.PositiveIntegerField(default=1)
    backoff = TolerantJSONField(null=True, blank=True)
    worker_ids = TolerantJSONField(default=list)
    return_value = TolerantJSONField(null=True, blank=True)

    concurrency_key = models.CharField(max_length=255, null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)
    # Seconds a running holder keeps its slot even if it runs longer (a lease); None: for
    # as long as it runs.
    concurrency_duration = models.FloatField(null=True, blank=True)
    on_conflict = models.CharField(
        max_length=8, choices=[("block", "Block"), ("discard", "Discard")], default="block"
    )
    # At most ``rate_limit`` starts of ``rate_key`` in any ``rate_period`` seconds
    # (django_jobs/core/rate_limits.py); NULL: no rate limit.
    rate_key = models.CharField(max_length=255, null=True, blank=True)
    rate_limit = models.PositiveIntegerField(null=True, blank=True)
    rate_period = models.FloatField(null=True, blank=True)
    # The start time planned for it while it waits for its key's window; set while it
    # waits, cleared when it starts.
    rate_reserved_at = models.DateTimeField(null=True, blank=True)

    # The job's group among its queue's ready jobs (docs/fairness.md): its resolved
    # ``fair_key`` in a queue of ``DJANGO_JOBS["fair_queues"]`` ('' for a job of no key,
    # the group of those), NULL in any other queue; and its weight (NULL: 1).
    fair_key = models.CharField(max_length=255, null=True, blank=True)
    fair_weight = models.FloatField(null=True, blank=True)

    # The resolved ``unique_key`` of a unique task, kept for the record.
    unique_key = models.CharField(max_length=255, null=True, blank=True)
    # The same key while the job is covered (see ``unique_until``), NULL after: the unique
    # index on this column, not a read-then-insert, is what refuses a second such job.
    unique_lock = models.CharField(max_length=255, null=True, blank=True)
    unique_until = models.CharField(
        max_length=8, choices=UniqueUntil.choices, null=True, blank=True
    )
    batch = models.ForeignKey(
        Batch,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,  # jobs_job_batch, of the jobs that have one
        null=True,
        blank=True,
        related_name="jobs",
    )
    # The workflow it is a node of; set on every job that has dependents, which is how
    # a finish knows (under the job's lock) that it has dependents to release.
    workflow = models.ForeignKey(
        Workflow,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,  # jobs_job_workflow_nodes leads with it
        null=True,
        blank=True,
        related_name="jobs",
    )
    # For a job with dependencies: what happens to it when one fails for good.
    on_dependency_failure = models.CharField(
        max_length=8, choices=DependencyFailure.choices, null=True, blank=True
    )
    # The last progress its task reported (``django_jobs.set_progress``): written only by
    # the worker's progress writer, one UPDATE of these four columns by primary key
    # (django_jobs/core/progress.py), never by a transition. NULL until it reports.
    progress_done = models.FloatField(null=True, blank=True)
    progress_total = models.FloatField(null=True, blank=True)
    progress_message = models.CharField(max_length=255, null=True, blank=True)
    progress_at = models.DateTimeField(null=True, blank=True)
    # The enqueuer's trace context as propagation headers (W3C ``traceparent``, ``tracestate``;
    # Sentry's ``sentry-trace``, ``baggage``), so the run continues the enqueuing request's
    # trace. NULL without OpenTelemetry or a tracing hook such as
    # ``django_jobs.contrib.sentry`` (``django_jobs.observability.tracing``).
    trace_context = TolerantJSONField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["status", "finished_at"], name="jobs_job_status_finished"),
            models.Index(fields=["queue_name", "status"], name="jobs_job_queue_status"),
            # The job list filtered by state, newest first (``status = %s ORDER BY id DESC
            # LIMIT 50``): one ordered range, bounded by the page, for a rare state and a
            # common one alike; by the primary key a rare one read every job, by
            # (status, finished_at) a common one sorted all of its jobs (SQLite: 5.9 s
            # for the failed jobs of a million). Migration 0020.
            models.Index(fields=["status", "-id"], name="jobs_job_status_newest"),
            # Declared here, not with ``db_index=True``: on PostgreSQL that adds a second
            # index per column (``varchar_pattern_ops``, for LIKE), which no query of ours
            # uses and every enqueue wrote.
            models.Index(fields=["task_path"], name="jobs_job_task_path"),
            # Of the jobs that have one: see NotNullIndex.
            NotNullIndex(fields=["concurrency_key"], name="jobs_job_concurrency_keyed"),
            NotNullIndex(fields=["unique_key"], name="jobs_job_unique_keyed"),
            # Ending with the id: a workflow's jobs of a status, and a batch's items, in id
            # order from an index range (a page's first rows). MySQL, MariaDB and SQLite end
            # every index with the primary key anyway; PostgreSQL read the first items of a
            # batch by walking the primary key from the table's first job (0021).
            NotNullIndex(fields=["workflow", "status", "id"], name="jobs_job_workflow_nodes"),
            NotNullIndex(fields=["batch", "id"], name="jobs_job_batch"),
            # The admin's search (django_jobs/admin/search.py), PostgreSQL only: a task path
            # prefix (LIKE 'prefix%' in any collation; jobs_job_task_path serves it on
            # the others), and the arguments' values (GIN, jsonb_ops: ``@>`` and a
            # jsonpath ``@?`` with a wildcard key). Built by migration 0020, concurrently.
            PostgresIndex(
                fields=["task_path"],
                name="jobs_job_task_prefix",
                opclasses=["varchar_pattern_ops"],
            ),
            PostgresIndex(fields=["kwargs"], name="jobs_job_kwargs_gin", method="gin"),
            PostgresIndex(fields=["args"], name="jobs_job_args_gin", method="gin"),
        ]
        constraints = [
            # A constraint, not ``unique=True``: on PostgreSQL that adds a LIKE index too.
            NotNullUniqueConstraint(fields=["unique_lock"], name="jobs_job_unique_lock"),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} #{self.pk}"

    @property
    def task_result_status(self) -> TaskResultStatus:
        return TASK_RESULT_STATUS[JobStatus(self.status)]


class ReadyExecution(models.Model):
    """A job that may run now; the one table workers poll."""

    job = models.OneToOneField(
        Job,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="ready_execution",
        db_constraint=False,  # see Job's docstring
    )
    queue_name = models.CharField(max_length=128)
    priority = models.SmallIntegerField(default=0)
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # The job's ``is_async``: what a claim for one lane filters on.
    is_async = models.BooleanField(default=False, db_default=False)
    # Its place in claim order among the ready rows of its priority (claims take priority
    # descending, then turn, then id): the job's id times ``core.fairness.TURN_SCALE`` in a
    # queue that is not fair, so that the order is the ids' as before; in a fair queue the
    # virtual start time its group's stamp gave it (core/fairness.py).
    turn = models.BigIntegerField(default=0, db_default=0)

    class Meta:
        indexes = [
            models.Index(fields=["queue_name", "-priority", "turn", "job"], name="jobs_ready_poll"),
            # The claim order of a worker serving "*": no queue to narrow by.
            models.Index(fields=["-priority", "turn", "job"], name="jobs_ready_order"),
            NotNullIndex(fields=["concurrency_key"], name="jobs_ready_keyed"),
            # The claim of a worker with room on its event loop only: the async rows on
            # PostgreSQL and SQLite; on MySQL/MariaDB every row, led by is_async, which
            # serves the claim of either lane (see FlagIndex).
            FlagIndex(
                fields=["-priority", "turn", "job"], name="jobs_ready_async", flag="is_async"
            ),
        ]

    def __str__(self) -> str:
        return f"ready #{self.job_id} ({self.queue_name})"


class ScheduledExecution(models.Model):
    """A job due later: a ``run_after`` in the future or a retry's backoff."""

    job = models.OneToOneField(
        Job,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="scheduled_execution",
        db_constraint=False,  # see Job's docstring
    )
    queue_name = models.CharField(max_length=128)
    priority = models.SmallIntegerField(default=0)
    scheduled_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["scheduled_at", "-priority", "job"], name="jobs_scheduled_due"),
        ]

    def __str__(self) -> str:
        return f"scheduled #{self.job_id} at {self.scheduled_at:%Y-%m-%d %H:%M:%S}"


class BlockedExecution(models.Model):
    """A job waiting for a slot of its concurrency key."""

    job = models.OneToOneField(
        Job,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="blocked_execution",
        db_constraint=False,  # see Job's docstring
    )
    queue_name = models.CharField(max_length=128)
    priority = models.SmallIntegerField(default=0)
    concurrency_key = models.CharField(max_length=255)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["concurrency_key", "-priority", "job"], name="jobs_blocked_next"),
        ]

    def __str__(self) -> str:
        return f"blocked #{self.job_id} on {self.concurrency_key}"


class AwaitingExecution(models.Model):
    """A job waiting for the jobs it depends on; ``remaining``: how many have not ended yet.

    ``remaining`` only moves under this row's lock, in the transaction that settles one
    of the job's dependency edges (``core/dependencies.py``): the one that takes it to
    zero makes the job runnable, exactly once, whatever else ends at the same instant.
    """

    job = models.OneToOneField(
        Job,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="awaiting_execution",
        db_constraint=False,  # see Job's docstring
    )
    queue_name = models.CharField(max_length=128)
    priority = models.SmallIntegerField(default=0)
    remaining = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"awaiting #{self.job_id} ({self.remaining} left)"


class JobDependency(models.Model):
    """An edge: ``job`` waits for ``depends_on``.

    ``settled``: the end of ``depends_on`` has been applied to ``job`` (its count moved,
    or the job ended by its policy). Flipped once, under this row's lock, so an edge is
    settled exactly once however many paths (the parent's end, the follow-up, the
    dispatcher's sweep) race for it.
    """

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(
        Job,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,  # led by jobs_dependency_once
        related_name="dependencies",
    )
    depends_on = models.ForeignKey(
        Job,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,  # led by jobs_dependency_parent
        related_name="dependents",
    )
    # Its place in the job's ``after`` list: dependency_results() keeps that order.
    position = models.PositiveIntegerField(default=0)
    settled = models.BooleanField(default=False)

    class Meta:
        verbose_name_plural = "job dependencies"
        constraints = [
            models.UniqueConstraint(fields=["job", "depends_on"], name="jobs_dependency_once")
        ]
        indexes = [
            models.Index(fields=["depends_on", "settled"], name="jobs_dependency_parent"),
        ]

    def __str__(self) -> str:
        return f"#{self.job_id} after #{self.depends_on_id}"


class Process(models.Model):
    """A live ``run_jobs`` process; dead once its heartbeat is older than the threshold."""

    class Kind(models.TextChoices):
        SUPERVISOR = "supervisor", "Supervisor"
        WORKER = "worker", "Worker"
        DISPATCHER = "dispatcher", "Dispatcher"
        SCHEDULER = "scheduler", "Scheduler"

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    name = models.CharField(max_length=128, unique=True)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    supervisor = models.ForeignKey(
        "self",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="children",
    )
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        verbose_name_plural = "processes"

    def __str__(self) -> str:
        return self.name


class ClaimedExecution(models.Model):
    """A job a worker process holds; the row whose deletion finalises the job exactly once."""

    job = models.OneToOneField(
        Job,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="claimed_execution",
        db_constraint=False,  # see Job's docstring
    )
    # No database constraint: a pruned process row must never cascade away its claims,
    # which recovery still has to handle one by one.
    process = models.ForeignKey(
        Process,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        related_name="claims",
    )
    queue_name = models.CharField(max_length=128, default="default")
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)
    # When a concurrency_duration lease runs out: from then on this holder no longer
    # counts toward its key's limit. None: it counts until it is gone.
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The job's batch, copied at claim time, so finalisation (which already holds this
    # row's lock) knows which batch to count the outcome in without reading the job.
    batch_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            NotNullIndex(fields=["concurrency_key"], name="jobs_claimed_keyed"),
            models.Index(fields=["queue_name"], name="jobs_claimed_queue"),
        ]

    def __str__(self) -> str:
        return f"claimed #{self.job_id} by process {self.process_id}"


class FailedExecution(models.Model):
    """One failed attempt of a job, with the error it raised."""

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(
        Job,
        on_delete=models.CASCADE,
        related_name="failures",
        db_constraint=False,  # see Job's docstring
    )
    attempt = models.PositiveIntegerField()
    worker_id = models.CharField(max_length=128, blank=True)
    exception_class_path = models.CharField(max_length=255)
    message = models.TextField(blank=True)
    traceback = models.TextField(blank=True)
    failed_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        indexes = [models.Index(fields=["job", "attempt"], name="jobs_failed_job_attempt")]

    def __str__(self) -> str:
        return f"#{self.job_id} attempt {self.attempt}: {self.exception_class_path}"


class Semaphore(models.Model):
    """The lock row of one concurrency key; ``value`` is the number of free slots."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=255, unique=True)
    limit = models.PositiveIntegerField(default=1)
    value = models.IntegerField(default=1)
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.key} ({self.value}/{self.limit} free)"


class FairTurn(models.Model):
    """The stamp of one fair group (a queue, a priority, a fair key): the turn its
    newest ready job was given. Locked (``select_for_update``) by every write that makes a
    job of the group ready, so that two transactions never give two of its jobs the same
    turn (core/fairness.py). A row whose ``last_turn`` is NULL or absurd (edited by hand)
    is read as none, with a warning, and written again."""

    id = models.BigAutoField(primary_key=True)
    queue_name = models.CharField(max_length=128)
    priority = models.SmallIntegerField(default=0)
    fair_key = models.CharField(max_length=255, blank=True)
    last_turn = models.BigIntegerField(null=True, blank=True)
    # The job given ``last_turn`` (the newest of the group's last enqueue): the group "still
    # waits" while this job's ready row exists, one read by primary key however many other
    # groups' jobs share its turn.
    last_job_id = models.BigIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["queue_name", "priority", "fair_key"], name="jobs_fair_turn_group"
            )
        ]

    def __str__(self) -> str:
        return f"{self.queue_name}/{self.priority}/{self.fair_key!r} at {self.last_turn}"


class RateLimit(models.Model):
    """The lock row of one rate-limited key, with its recent starts and its plan.

    ``starts``: the times (seconds since the epoch) of the key's last starts
    within one period, at most ``limit`` of them. ``planned``: the last
    ``limit`` start times planned, the real starts and the times promised to
    jobs waiting for the window. Both are only read and written under this
    row's lock, in a start transaction (django_jobs/core/rate_limits.py).
    """

    key = models.CharField(max_length=255, unique=True)
    # The rate of the key's last start, for the admin; each job carries its own.
    limit = models.PositiveIntegerField(default=1)
    period = models.FloatField(default=1.0)
    starts = models.JSONField(default=list, blank=True)
    planned = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"{self.key} ({self.limit} per {self.period:g}s)"


class QueueLock(models.Model):
    """The row a claim locks to enforce a queue's ``max_concurrency`` across all workers."""

    queue_name = models.CharField(max_length=128, unique=True)

    def __str__(self) -> str:
        return self.queue_name


class Pause(models.Model):
    queue_name = models.CharField(max_length=128, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.queue_name


class RecurringTask(models.Model):
    """A recurring task from ``DJANGO_JOBS["recurring"]``, as the scheduler last synced it.

    Settings are the source of truth for what runs; this row adds what only the
    database can hold: whether an operator disabled it, since when it may be
    caught up, and when it last ran.
    """

    key = models.CharField(max_length=128, unique=True)
    task_path = models.CharField(max_length=255)
    schedule = models.CharField(max_length=255)
    time_zone = models.CharField(max_length=64, default="UTC")
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    queue_name = models.CharField(max_length=128, null=True, blank=True)
    priority = models.SmallIntegerField(null=True, blank=True)
    enabled = models.BooleanField(default=True)
    # Ticks at or before this are never caught up (first seen, or re-enabled, here).
    active_since = models.DateTimeField(default=timezone.now)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_job_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.key} ({self.schedule})"


class RecurringExecution(models.Model):
    """One tick of a recurring task, enqueued: the unique row that makes each tick run once."""

    id = models.BigAutoField(primary_key=True)
    task_key = models.CharField(max_length=128)
    run_at = models.DateTimeField()
    job_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task_key", "run_at"], name="jobs_recurring_tick_once")
        ]

    def __str__(self) -> str:
        return f"{self.task_key} at {self.run_at:%Y-%m-%d %H:%M:%S}"


# Admin pages that are not a plain list of one table. Proxies give each page an
# entry in the admin's app index; their permissions are the ``Job`` model's
# (see ``django_jobs.admin.permissions``), so they create none of their own.


class Dashboard(Job):
    class Meta:
        proxy = True
        verbose_name = verbose_name_plural = "dashboard"
        default_permissions = ()


class StuckJob(Job):
    class Meta:
        proxy = True
        verbose_name = "stuck job"
        default_permissions = ()


class BlockedKey(Semaphore):
    class Meta:
        proxy = True
        verbose_name = "blocked key"
        default_permissions = ()


class RateLimitedKey(RateLimit):
    class Meta:
        proxy = True
        verbose_name = "rate-limited key"
        default_permissions = ()


# A queue name compares exactly on every database, a ``prefix*`` pattern's too (db/lookups.py).
exact_prefixes(
    *(
        model._meta.get_field("queue_name")
        for model in (
            Job,
            ReadyExecution,
            ScheduledExecution,
            BlockedExecution,
            AwaitingExecution,
            ClaimedExecution,
            QueueLock,
            Pause,
            RecurringTask,
            FairTurn,
        )
    )
)
