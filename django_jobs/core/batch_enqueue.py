"""``enqueue_batch()``: a batch's row and its items' jobs in one transaction of the enqueue's own
tries (``core.attempts``). Apart from ``core/batches.py``, which the enqueue's own modules
import (the batches' counts): this one imports the enqueue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import transaction
from django.tasks import Task, TaskResult
from django.tasks.exceptions import InvalidTask

from django_jobs.core.attempts import retried
from django_jobs.core.batches import (
    BatchResult,
    backend_of,
    callback_spec,
    complete,
    current_job_id,
)
from django_jobs.core.enqueue import announce, write_calls
from django_jobs.models import Batch
from django_jobs.tasks.job_task import checked_calls


def enqueue_batch(
    calls: Iterable[tuple[Task, Sequence[Any], Mapping[str, Any]]],
    *,
    on_finish: Task | None = None,
    on_success: Task | None = None,
    on_failure: Task | None = None,
    concurrency_limit: int | None = None,
    description: str = "",
) -> BatchResult:
    """Enqueue ``calls`` as the items of one batch, in one transaction.

    Callbacks are tasks called with keyword arguments ``batch_id``,
    ``succeeded`` and ``failed`` (a discarded item counts as failed):
    ``on_finish`` always, ``on_success`` when no item failed, ``on_failure``
    when at least one did. ``concurrency_limit``: at most this many items of
    the batch hold a slot (ready or running) at a time.
    """
    calls = checked_calls(calls, "enqueue_batch()")
    callbacks = {"on_finish": on_finish, "on_success": on_success, "on_failure": on_failure}
    specs = {name: callback_spec(name, cb) for name, cb in callbacks.items() if cb is not None}
    backend = backend_of(calls, callbacks)
    if concurrency_limit is not None and (
        isinstance(concurrency_limit, bool)
        or not isinstance(concurrency_limit, int)
        or concurrency_limit < 1
    ):
        raise InvalidTask("a batch's concurrency_limit must be an integer >= 1")
    db = backend.database

    def attempt(wait_for_parents: bool) -> tuple[Batch, list[TaskResult], list[TaskResult]]:
        with transaction.atomic(using=db):
            batch = Batch.objects.using(db).create(
                description=description[:255],
                total=len(calls),
                pending=len(calls),
                callbacks=specs,
                concurrency_limit=concurrency_limit,
                parent_job_id=current_job_id.get(),
            )
            if not calls:
                # Nothing to wait for: complete now (the row is ours until this commits).
                complete(db, batch)
                batch.save(using=db, update_fields=["finished_at", "callback_jobs"])
                return batch, [], []
            return batch, *write_calls(backend, calls, batch, None, wait_for_parents)

    # Its tries run here, around the batch's row (core.attempts); the jobs announced after.
    batch, results, new = retried(db, attempt)
    announce(backend, new)
    return BatchResult(id=batch.pk, results=results)
