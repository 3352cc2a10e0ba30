"""Single-process mode: a worker and a dispatcher as threads of one process.

For small deployments and SQLite, and for ``--once``, which drains what is
ready (and due) and exits.
"""

from __future__ import annotations

import logging
import threading

from ..conf import JobsSettings
from ..models import Process
from ..processes import deregister_process, register_process
from .db_retry import retry_until_done
from .dispatcher import Dispatcher
from .heartbeat import Heartbeat
from .lifecycle import Lifecycle
from .supervisor import process_metadata
from .worker import Worker

logger = logging.getLogger("django_jobs.supervisor")


def run_single_process(conf: JobsSettings, lifecycle: Lifecycle, *, once: bool = False) -> bool:
    """Run until stopped; True if job threads were abandoned at the shutdown timeout."""
    db = conf.database
    process = retry_until_done(
        db,
        "registering the worker",
        lambda: register_process(
            db, Process.Kind.WORKER, metadata={**process_metadata(conf), "single_process": True}
        ),
        give_up=lifecycle.stopping.is_set,
        max_delay=conf.db_retry_max_delay,
    )
    if process is None:
        return False
    beat = Heartbeat(db, process.pk, conf.heartbeat_interval, lifecycle)
    beat.start()
    dispatcher_lifecycle = Lifecycle()
    dispatcher = threading.Thread(
        target=Dispatcher(conf, dispatcher_lifecycle).run,
        name="django-jobs-dispatcher",
        daemon=True,
    )
    dispatcher.start()
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
        dispatcher_lifecycle.request_stop()
        dispatcher.join(conf.shutdown_timeout + 5)
        beat.stop()
        if not lifecycle.immediate.is_set():
            retry_until_done(
                db,
                "deregistering the worker",
                lambda: deregister_process(db, process.pk, f"{process.name} stopped"),
                give_up=lifecycle.immediate.is_set,
                max_delay=conf.db_retry_max_delay,
            )
        logger.info("worker stopped: %s", process.name)
    return bool(worker.abandoned)
