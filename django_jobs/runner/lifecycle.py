"""Shutdown state shared by a process's threads, driven by POSIX signals.

First SIGTERM/SIGINT: graceful (stop taking work, finish or hand back what is
running). A second one, or SIGQUIT: immediate.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger("django_jobs.runner")


class Lifecycle:
    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.immediate = threading.Event()
        self.wake = threading.Event()
        self.on_immediate: Callable[[], None] | None = None
        # Set when this process found its registry row deleted (pruned as dead by
        # someone else): it stops, and ``run_jobs`` exits non-zero so that a process
        # manager starts a fresh one.
        self.pruned = False

    def request_stop(self, reason: str = "") -> None:
        if not self.stopping.is_set():
            logger.info("shutting down gracefully%s", f" ({reason})" if reason else "")
        self.stopping.set()
        self.wake.set()

    def request_immediate(self, reason: str = "") -> None:
        logger.warning("stopping immediately%s", f" ({reason})" if reason else "")
        self.stopping.set()
        self.immediate.set()
        self.wake.set()
        if self.on_immediate is not None:
            self.on_immediate()

    def install_signal_handlers(self) -> None:
        def graceful(signum: int, frame: object) -> None:
            name = signal.Signals(signum).name
            if self.stopping.is_set():
                self.request_immediate(f"second {name}")
            else:
                self.request_stop(name)

        def immediate(signum: int, frame: object) -> None:
            self.request_immediate(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, graceful)
        signal.signal(signal.SIGINT, graceful)
        signal.signal(signal.SIGQUIT, immediate)

    def sleep(self, seconds: float) -> None:
        """Sleep until the timeout or a wake-up (work finished, a signal)."""
        self.wake.wait(seconds)
        self.wake.clear()
