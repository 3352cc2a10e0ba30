"""A process's row in the registry for as long as it runs: register, heartbeat, deregister."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django_jobs.conf import JobsSettings
from django_jobs.core.processes import deregister_process, register_process
from django_jobs.db.retry import retry_until_done
from django_jobs.models import Process
from django_jobs.runtime.heartbeat import Heartbeat
from django_jobs.runtime.lifecycle import Lifecycle


def capacity(conf: JobsSettings) -> dict[str, Any]:
    """What the row says the process serves, for the admin, ``manage.py jobs`` and the
    metrics (``observability/process_metadata.py`` reads it back): its ``--queues``, its
    threads for sync jobs and how many ``async def`` jobs its event loop runs at once (0:
    none, they run on the threads). A worker's loop monitor later merges its stall counts
    into the same metadata (``runtime/loop_monitor.py``)."""
    return {"queues": list(conf.queues), "threads": conf.threads, "async_jobs": conf.async_jobs}


@contextmanager
def registered(
    conf: JobsSettings,
    lifecycle: Lifecycle,
    kind: str,
    *,
    supervisor_id: int | None = None,
    metadata: dict[str, Any] | None = None,
    settle_when_immediate: bool = False,
) -> Iterator[Process | None]:
    """Yield this process's row (None if stopped before the database answered).

    On the way out the heartbeat stops and the row is removed after its claims
    are settled. After an immediate stop a child leaves that to its supervisor
    (or to pruning); the supervisor itself settles anyway (``settle_when_immediate``).
    """
    db = conf.database
    process = retry_until_done(
        db,
        f"registering the {kind}",
        lambda: register_process(
            db,
            kind,
            supervisor_id=supervisor_id,
            metadata={**capacity(conf), **(metadata or {})},
        ),
        give_up=lifecycle.stopping.is_set,
        max_delay=conf.db_retry_max_delay,
    )
    if process is None:
        yield None
        return
    beat = Heartbeat(db, process.pk, conf.heartbeat_interval, lifecycle)
    beat.start()
    try:
        yield process
    finally:
        beat.stop()
        # The claim of a body that may still run (stuck, or left running at the
        # shutdown deadline) must outlive this process, and so must the row: without
        # it the claim would be an orphan that any dispatcher's prune settles at once.
        # Its supervisor (or pruning, once the heartbeat has aged) settles it when the
        # process, and so the job's thread, is gone.
        abandoning = lifecycle.leaves_claims and not settle_when_immediate
        if not abandoning and (settle_when_immediate or not lifecycle.immediate.is_set()):
            retry_until_done(
                db,
                f"deregistering the {kind}",
                lambda: deregister_process(db, process.pk, f"{process.name} stopped"),
                give_up=lifecycle.immediate.is_set,
                max_delay=conf.db_retry_max_delay,
            )
