"""The core's named rows: what a transition returns or records, by name."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class ErrorInfo:
    """A failed attempt as recorded: the exception's class path, message and traceback."""

    exception_class_path: str
    message: str
    traceback: str


@dataclass(frozen=True)
class FailOutcome:
    retry_at: datetime | None  # when the next attempt is due, or None if failed for good

    @property
    def will_retry(self) -> bool:
        return self.retry_at is not None


@dataclass(frozen=True)
class Waiting:
    """A job the start sent back to wait for its rate window, until ``until``."""

    until: datetime
