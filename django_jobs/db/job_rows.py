"""Jobs built from rows read with a cursor, as ``Job.objects`` would build them, without a
queryset: a worker reads the jobs of every claim it makes.

A claim's read through ``Job.objects.raw()`` looked up the converters of every column
again for each claim and built each job through the raw queryset's iterator: on
MariaDB 15% of a no-op job's worker CPU (cProfile). The column list and converters
are looked up once per database here.
"""

from __future__ import annotations

import functools
from typing import Any

from django.db import connections
from django.db.models import Field

from django_jobs.db.base import column
from django_jobs.models import Job


@functools.cache
def job_columns(db: str) -> tuple[tuple[str, ...], tuple[tuple[int, list], ...]]:
    """``Job``'s attribute names in column order, and the converters of the columns
    that have any (JSON fields parse their text; MySQL makes its datetimes aware), as a
    model query would apply them."""
    connection = connections[db]
    fields = Job._meta.concrete_fields
    converters = tuple(
        (index, field_converters(connection, field)) for index, field in enumerate(fields)
    )
    return (
        tuple(field.attname for field in fields),
        tuple((index, found) for index, found in converters if found),
    )


@functools.cache
def select_list(db: str) -> str:
    """Every column of a job, in the order :func:`job_from_row` reads them."""
    quote = connections[db].ops.quote_name
    return ", ".join(quote(column(field)) for field in Job._meta.concrete_fields)


def field_converters(connection: Any, field: Field) -> list:
    """The backend's converters of ``field``'s column, then the field's own."""
    backend = connection.ops.get_db_converters(field.cached_col)
    return [*backend, *field.get_db_converters(connection)]


def job_from_row(db: str, connection: Any, row: tuple) -> Job:
    """A ``Job`` from a row of all its columns (in :func:`job_columns`' order)."""
    names, converters = job_columns(db)
    values = list(row)
    fields = Job._meta.concrete_fields
    for index, functions in converters:
        field = fields[index]
        for convert in functions:
            values[index] = convert(values[index], field.cached_col, connection)
    return Job.from_db(db, names, values)
