"""Jobs built from rows read with a cursor, as ``Job.objects`` would build them, without a
queryset: a worker reads the jobs of every claim it makes.

A claim's read through ``Job.objects.raw()`` looked up the converters of every column
again for each claim and built each job through the raw queryset's iterator: on
MariaDB 15% of a no-op job's worker CPU (cProfile). The column list and converters
are looked up once per database here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from django.db import connections
from django.db.models import Field, Model

from django_jobs.db.columns import column
from django_jobs.models import Job


def converters_of(connection: Any, fields: Sequence[Field]) -> tuple[tuple[int, Field, list], ...]:
    """The converters of the columns of ``fields`` (in a row's order) that have any: JSON
    fields parse their text, MySQL makes its datetimes aware, as a model query would."""
    found = (
        (index, field, field_converters(connection, field)) for index, field in enumerate(fields)
    )
    return tuple((index, field, functions) for index, field, functions in found if functions)


def converted(
    connection: Any, converters: tuple[tuple[int, Field, list], ...], row: Sequence
) -> list:
    """``row``'s values with :func:`converters_of`' converters applied."""
    values = list(row)
    for index, field, functions in converters:
        for convert in functions:
            values[index] = convert(values[index], field.cached_col, connection)
    return values


@functools.cache
def model_columns(db: str, model: type[Model]) -> tuple[tuple[str, ...], tuple]:
    """``model``'s attribute names in column order, and its columns' converters."""
    fields = model._meta.concrete_fields
    return tuple(field.attname for field in fields), converters_of(connections[db], fields)


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
    """A ``Job`` from a row of all its columns (in :func:`select_list`'s order)."""
    return model_from_row(db, Job, connection, row)


def model_from_row[M: Model](db: str, model: type[M], connection: Any, row: tuple) -> M:
    """An instance of ``model`` from a row of all its columns, in their order."""
    names, converters = model_columns(db, model)
    return model.from_db(db, names, converted(connection, converters, row))
