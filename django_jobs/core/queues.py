"""Which ready rows a worker may take, in the order its ``--queues`` list gives."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from django.db.models import Q


@dataclass(frozen=True)
class QueueSelector:
    """An ordered list of queue patterns: exact names, ``prefix*`` or ``*``.

    Order matters: every pattern is drained before the next is looked at, and
    priority only orders jobs within one pattern.
    """

    patterns: tuple[str, ...]

    @staticmethod
    def is_wildcard(pattern: str) -> bool:
        return pattern.endswith("*")

    def conditions(self) -> Iterator[Q]:
        for pattern in self.patterns:
            if pattern == "*":
                yield Q()
            elif self.is_wildcard(pattern):
                yield Q(queue_name__startswith=pattern[:-1])
            else:
                yield Q(queue_name=pattern)

    def matches(self, queue_name: str) -> bool:
        for pattern in self.patterns:
            if pattern == "*" or pattern == queue_name:
                return True
            if self.is_wildcard(pattern) and queue_name.startswith(pattern[:-1]):
                return True
        return False
