"""The test project's settings with Sentry initialised as a project would (in its settings),
for the ``run_jobs`` processes of tests/test_sentry.py only.

Nothing is sent: every event and transaction is appended, one JSON line each, to the file
``JOBS_SENTRY_EVENTS`` names. A process of any kind (the supervisor, a spawned or forked
worker) imports these settings and so writes there too.
"""

import fcntl
import json
import os
from typing import Any

import sentry_sdk
from sentry_sdk.envelope import Envelope
from sentry_sdk.transport import Transport

from django_jobs.contrib.sentry import DjangoJobsIntegration
from testproject.settings import *  # noqa: F403

SENTRY_EVENTS = os.environ["JOBS_SENTRY_EVENTS"]


class FileTransport(Transport):
    """Sentry's transport interface, writing to a file instead of the network."""

    def capture_envelope(self, envelope: Envelope) -> None:
        lines = [
            json.dumps({"type": item.type, "payload": item.payload.json}, default=str)
            for item in envelope.items
            if item.type in ("event", "transaction") and item.payload.json is not None
        ]
        if not lines:
            return
        with open(SENTRY_EVENTS, "a") as events:
            fcntl.flock(events, fcntl.LOCK_EX)  # processes append whole lines, never halves
            events.write("".join(f"{line}\n" for line in lines))

    def flush(self, timeout: float, callback: Any = None) -> None:
        pass  # written as captured


sentry_sdk.init(
    dsn="https://public@sentry.invalid/1",
    transport=FileTransport,
    integrations=[DjangoJobsIntegration()],
    traces_sample_rate=1.0,
)
