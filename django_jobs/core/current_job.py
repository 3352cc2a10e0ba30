"""Whether the job running in this context has been asked to stop.

The one fact of the runtime that a task's own code reads (``django_jobs.cancel_requested()``).
It lives here, below the runtime, so that the public API reads it without importing the
runtime: the worker's executor puts the running attempt's ``Control``
(``django_jobs.runtime.watchdog``) in :data:`current_control` around the task's body, and
the watchdog sets that control's ``requested`` event when it decides the job must stop (a
cancel request, a timeout). This module knows the control only by that event.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Protocol


class StopFlag(Protocol):
    """What the code of a running job may see of its attempt: set once it must stop."""

    requested: threading.Event


# A context variable, not a thread-local: an ``async def`` body runs in an event loop of
# another thread, in a copy of this context (``async_to_sync``), and must see it too.
current_control: contextvars.ContextVar[StopFlag | None] = contextvars.ContextVar(
    "django_jobs_current_control", default=None
)


def cancel_requested() -> bool:
    """True inside a running job once it has been cancelled or has timed out.

    A task that checks it between steps can stop cleanly (return or raise)
    before it is interrupted by force. Outside a job it is always False.
    """
    control = current_control.get()
    return control is not None and control.requested.is_set()
