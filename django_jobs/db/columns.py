"""The column of a concrete field, read by the portable operations (``base.py``), the vendors'
SQL and ``job_rows.py`` alike: a module of its own, importing nothing of ours, so that
``job_rows.py`` need not import ``base.py``, which imports it."""

from __future__ import annotations

from django.db import models


def pk_column(model: type[models.Model]) -> str:
    """The primary key's column of one of our tables (every one has one)."""
    pk = model._meta.pk
    assert pk is not None
    return column(pk)


def column(field: models.Field) -> str:
    """A concrete field's column (only a field with no column of its own has None)."""
    assert field.column is not None
    return field.column
