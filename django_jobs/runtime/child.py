"""What a child process of the supervisor runs, once ``entry.child_main`` has set Django up.

Apart from ``entry.py`` (the spawn target, which must import nothing of Django's models) and
from the supervisor (which starts children and never runs one): the supervisor imports the
entry, the entry imports this module, and this module imports neither.
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

from django_jobs.conf import JobsSettings
from django_jobs.models import Process
from django_jobs.runtime.dispatcher import Dispatcher
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.logs import configure_logging, flush_buffered_lines
from django_jobs.runtime.recycling import ABANDONED_EXIT_CODE, RECYCLE_EXIT_CODE
from django_jobs.runtime.registration import registered
from django_jobs.runtime.scheduler import run_scheduler
from django_jobs.runtime.wakeup import WakeFeed
from django_jobs.runtime.worker import Worker
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.supervisor")


def run_role(
    kind: str,
    conf: JobsSettings,
    lifecycle: Lifecycle,
    supervisor_id: int | None,
    wake: Connection | None = None,
) -> None:
    """Register as ``kind``, run its loop until stopped, then deregister."""
    if kind == Process.Kind.SCHEDULER:
        run_scheduler(conf, lifecycle, supervisor_id=supervisor_id)
        return
    with registered(conf, lifecycle, kind, supervisor_id=supervisor_id) as process:
        if process is None:
            return
        logger.info(
            "%s started: %s queues=%s threads=%d",
            kind,
            process.name,
            ",".join(conf.queues),
            conf.threads,
        )
        if kind == Process.Kind.WORKER:
            feed = WakeFeed(wake, lifecycle) if wake is not None else None
            Worker(conf, process.pk, process.name, lifecycle, recycle=True, wake_feed=feed).run()
        else:
            Dispatcher(conf, lifecycle, alive=(process.pk, supervisor_id)).run()
    logger.info("%s stopped: %s", kind, process.name)


def exit_now() -> None:
    """A second stop signal: exit without waiting for anything but the log's last lines."""
    flush_buffered_lines()
    os._exit(1)


def run_child(
    kind: str,
    overrides: dict[str, Any],
    supervisor_id: int,
    verbosity: int,
    wake: Connection | None = None,
) -> None:
    """Body of a spawned child process (see ``entry.child_main``); exits the process."""
    os.setpgrp()
    configure_logging(verbosity)
    conf = JobsSettings.load(**overrides)
    lifecycle = Lifecycle()
    lifecycle.on_immediate = exit_now
    lifecycle.install_signal_handlers()
    parent = os.getppid()

    def watch_parent() -> None:
        while not lifecycle.stopping.wait(1.0):
            if os.getppid() != parent:
                lifecycle.request_stop("supervisor is gone")

    threading.Thread(target=watch_parent, daemon=True, name="django-jobs-parent-watch").start()
    code = 1  # unless run_role returns: then as it ended
    try:
        run_role(kind, conf, lifecycle, supervisor_id, wake)
        if lifecycle.leaves_claims:
            code = ABANDONED_EXIT_CODE
        elif lifecycle.broken:
            code = 1  # replaced, and its claims recovered, like a crash
        elif lifecycle.recycling and not lifecycle.signalled.is_set():
            code = RECYCLE_EXIT_CODE
        else:
            code = 0
    except BaseException:
        logger.exception("the %s process failed", kind)
    finally:
        logging.shutdown()
        # Threads of jobs cut off at the shutdown timeout must not keep us alive.
        os._exit(code)
