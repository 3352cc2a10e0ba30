"""JSON columns whose stored text Python cannot read back: a value, not an exception.

A job's JSON columns are written by us from checked values, but a row can also be written by
hand, by a script or by another program, and the database accepts JSON that Python's
``json`` refuses: an integer of more than 4,300 digits (``sys.int_max_str_digits``) on every
database, arrays nested deeper than Python's recursion limit on PostgreSQL. Django's
``JSONField`` raises for both, so one such row made every claim that read it fail: the
worker backed off and claimed it again, forever, and no job of its queue ran, not even one
enqueued before it (tests/test_fault_isolation.py). :class:`TolerantJSONField` reads such a
column as :class:`Unreadable` (and text that is not JSON, which Django would hand back as a
string, the same way), the executor fails a job whose arguments are one
(``executor.unreadable_input``), and the rest of the row reads as usual: the one job ends,
the worker goes on.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import models
from django.db.models.fields.json import KeyTransform


class Unreadable:
    """The stored text of a JSON column that Python cannot decode, and why.

    False as a truth value, so that code reading an optional list column as ``value or []``
    (a job's ``worker_ids``) takes it as empty; anything else that uses it as data fails.
    """

    __slots__ = ("reason", "text")

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unreadable) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 60 else f"{self.text[:57]}..."
        return f"<unreadable JSON ({self.reason}): {shown}>"


class TolerantJSONField(models.JSONField):
    """A ``JSONField`` that reads text Python cannot decode as :class:`Unreadable`.

    Deconstructed as Django's ``JSONField``: the column is the same, and no migration
    (SQLite would rebuild the jobs table for a changed field class) is needed.
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if not isinstance(value, str) or isinstance(expression, KeyTransform):
            return super().from_db_value(value, expression, connection)
        try:
            return json.loads(value, cls=self.decoder)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            return Unreadable(value, unreadable_reason(exc))

    def deconstruct(self) -> Any:
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


def unreadable_reason(exc: BaseException) -> str:
    """Why ``json`` refused a value, in a line (a RecursionError's message says nothing)."""
    if isinstance(exc, RecursionError):
        return "nested deeper than Python's recursion limit"
    return str(exc).split("; use sys.set_int_max_str_digits")[0]
