"""PostgreSQL's side of the admin's reads: the arguments searched through their GIN indexes
(``jobs_job_kwargs_gin``, ``jobs_job_args_gin``, jsonb_ops), and a statement timeout local
to one transaction."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.db import connections, transaction
from django.db.models import BooleanField, F, Func, Q, Value

# SQLSTATE query_canceled: what statement_timeout raises.
QUERY_CANCELED = "57014"


class JsonPathMatches(Func):
    """``column @? 'path'::jsonpath``: the operator a jsonb_ops GIN index serves for a path
    with a wildcard (``$.* ? (@ == 4242)``: any key), which ``@>`` cannot express."""

    arg_joiner = " @? "
    template = "(%(expressions)s::jsonpath)"
    output_field = BooleanField()

    def __init__(self, column: str, path: str) -> None:
        super().__init__(F(column), Value(path))


def literal(value: Any) -> str:
    """``value`` as a jsonpath literal: JSON's own spelling (a string's escapes, ``\\uXXXX``
    included, are jsonpath's too)."""
    return json.dumps(value)


def keyword_argument(name: str, values: Sequence[Any]) -> Q:
    """``kwargs @> '{"name": value}'`` for each value, ORed: one bitmap scan of the
    kwargs GIN index per value."""
    condition = Q(pk__in=[])
    for value in values:
        condition |= Q(kwargs__contains={name: value})
    return condition


def any_argument(values: Sequence[Any]) -> Q:
    """A positional argument (an element of ``args``) or a keyword argument's value equal
    to one of ``values``: two GIN lookups per value."""
    condition = Q(pk__in=[])
    for value in values:
        condition |= Q(JsonPathMatches("args", f"$[*] ? (@ == {literal(value)})"))
        condition |= Q(JsonPathMatches("kwargs", f"$.* ? (@ == {literal(value)})"))
    return condition


@contextmanager
def statement_timeout(db: str, seconds: float) -> Iterator[None]:
    """``statement_timeout`` set for one transaction (``set_config(..., true)``, as ``SET
    LOCAL``): it ends with the transaction, so a pooler in transaction mode (PgBouncer)
    never hands the setting to another client."""
    with transaction.atomic(using=db):
        with connections[db].cursor() as cursor:
            cursor.execute(
                "SELECT set_config('statement_timeout', %s, true)", [f"{int(seconds * 1000)}ms"]
            )
        yield


def is_statement_timeout(error: BaseException) -> bool:
    return getattr(error.__cause__, "sqlstate", None) == QUERY_CANCELED
