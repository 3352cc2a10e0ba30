"""Single-process mode: a worker, a dispatcher and (with recurring tasks) a scheduler
as threads of one process.

For small deployments and SQLite, and for ``--once``, which drains what is
ready (and due) and exits, without a scheduler: a one-off drain must not
enqueue ticks as a side effect.
"""

from __future__ import annotations

import threading

from django_jobs.conf import JobsSettings
from django_jobs.models import Process
from django_jobs.runtime.dispatcher import Dispatcher
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.registration import registered
from django_jobs.runtime.scheduler import run_scheduler
from django_jobs.runtime.worker import Worker
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.supervisor")


def run_single_process(conf: JobsSettings, lifecycle: Lifecycle, *, once: bool = False) -> bool:
    """Run until stopped; True if job threads were abandoned (shutdown timeout, immediate stop)."""
    with registered(
        conf, lifecycle, Process.Kind.WORKER, metadata={"single_process": True}
    ) as process:
        if process is None:
            return False
        dispatcher_lifecycle = Lifecycle()
        dispatcher = threading.Thread(
            target=Dispatcher(conf, dispatcher_lifecycle, alive=(process.pk,)).run,
            name="django-jobs-dispatcher",
            daemon=True,
        )
        dispatcher.start()
        scheduler_lifecycle = Lifecycle()
        scheduler: threading.Thread | None = None
        if conf.recurring and not once:
            scheduler = threading.Thread(
                target=run_scheduler,
                args=(conf, scheduler_lifecycle),
                kwargs={"metadata": {"single_process": True}},
                name="django-jobs-scheduler",
                daemon=True,
            )
            scheduler.start()
        logger.info(
            "single-process worker started: %s queues=%s threads=%d%s",
            process.name,
            ",".join(conf.queues),
            conf.threads,
            " (--once)" if once else "",
        )
        worker = Worker(conf, process.pk, process.name, lifecycle, once=once)
        try:
            worker.run()
        finally:
            if lifecycle.immediate.is_set():
                scheduler_lifecycle.immediate.set()
            for helper in (dispatcher_lifecycle, scheduler_lifecycle):
                helper.stopping.set()
                helper.wake.set()
            timeout = 1.0 if lifecycle.immediate.is_set() else conf.shutdown_timeout + 5
            dispatcher.join(timeout)
            if scheduler is not None:
                scheduler.join(timeout)
    logger.info("worker stopped: %s", process.name)
    return bool(worker.abandoned)
