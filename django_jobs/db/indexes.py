"""Indexes that leave out the rows without a value, or without a flag, where the database
can."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q


class NotNullIndex(models.Index):
    """An index of the rows whose first field is not NULL on databases with partial
    indexes (PostgreSQL, SQLite); of every row on the others (MySQL, MariaDB).

    Most jobs have no concurrency key, unique key, batch or workflow, yet a full index
    holds an entry for each of them. That entry is written at the enqueue, and again
    at the claim and at the finish: both change ``status``, which other indexes hold,
    so PostgreSQL writes each new version of a job row into every index of the table.
    Left out, those NULLs cost a drain on PostgreSQL a quarter of its claim's and its
    finish's time on the server (CHANGELOG, 0.1.0). Every query of ours that reads
    such a column by its index asks for values (``=``, ``IN``), which a NULL never
    matches, so the planner still uses the partial index for it.

    Not ``Index(condition=...)``: MySQL has no partial indexes, where Django builds
    that index without its condition and warns (``models.W037``) at every ``migrate``.
    This one adds its condition only where the database takes it.
    """

    def create_sql(
        self, model: type[models.Model], schema_editor: Any, using: str = "", **kwargs: Any
    ) -> Any:
        built = as_built(self, models.Index, schema_editor)
        return built.create_sql(model, schema_editor, using=using, **kwargs)


class NotNullUniqueConstraint(models.UniqueConstraint):
    """A unique constraint on one field, whose index leaves out the rows where it is NULL
    on databases with partial indexes (PostgreSQL, SQLite): two NULLs never conflict, so
    what it refuses is the same everywhere.

    ``Job.unique_lock`` is NULL for every job that is not unique, or no longer covered;
    a full unique index wrote that NULL at each enqueue, claim and finish (see
    :class:`NotNullIndex`). Not ``UniqueConstraint(condition=...)``: MySQL/MariaDB cannot
    build that, and Django then builds nothing, with a warning (``models.W036``).
    """

    def constraint_sql(self, model: type[models.Model] | None, schema_editor: Any) -> Any:
        return as_built(self, models.UniqueConstraint, schema_editor).constraint_sql(
            model, schema_editor
        )

    def create_sql(self, model: type[models.Model] | None, schema_editor: Any) -> Any:
        return as_built(self, models.UniqueConstraint, schema_editor).create_sql(
            model, schema_editor
        )

    def remove_sql(self, model: type[models.Model] | None, schema_editor: Any) -> Any:
        return as_built(self, models.UniqueConstraint, schema_editor).remove_sql(
            model, schema_editor
        )


def as_built[T: (models.Index, models.UniqueConstraint)](
    declared: T, django_class: type[T], schema_editor: Any
) -> T:
    """``declared`` as Django's own class, with the condition ``<first field> IS NOT NULL``
    where the database has partial indexes: what Django then builds, alters and drops."""
    _, args, options = declared.deconstruct()
    if schema_editor.connection.features.supports_partial_indexes:
        first = declared.fields[0].lstrip("-")
        options["condition"] = Q(**{f"{first}__isnull": False})
    return django_class(*args, **options)


class FlagIndex(models.Index):
    """An index of the rows whose boolean ``flag`` is true on databases with partial
    indexes (PostgreSQL, SQLite); on the others (MySQL, MariaDB) an index of every row,
    led by ``flag``: a read of either value then takes its own rows in the fields' order
    from one range of it.

    ``ReadyExecution``'s ``jobs_ready_async``: the claim of one lane (``core/lanes.py``)
    orders by priority and id among the rows of its kind. Declared as
    ``Index(condition=...)``, MySQL/MariaDB built it without its condition, a copy of
    ``jobs_ready_order`` that every enqueue and claim wrote for nothing, and warned
    (``models.W037``); either lane then walked the claim order through the other kind's
    rows, row by row (a claim of 5 behind 20,000 of them: 42 ms, against 6 through the
    flag; tests/test_lanes.py). A partial index leaves the sync rows out, which most
    projects have alone. The condition is added only where it is built, as
    :class:`NotNullIndex` adds its own.
    """

    def __init__(self, *args: Any, flag: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flag = flag

    def deconstruct(self) -> Any:
        path, args, kwargs = super().deconstruct()
        kwargs["flag"] = self.flag
        return path, args, kwargs

    def create_sql(
        self, model: type[models.Model], schema_editor: Any, using: str = "", **kwargs: Any
    ) -> Any:
        _, args, options = super().deconstruct()
        if schema_editor.connection.features.supports_partial_indexes:
            options["condition"] = Q(**{self.flag: True})
        else:
            options["fields"] = [self.flag, *options["fields"]]
        built = models.Index(*args, **options)
        return built.create_sql(model, schema_editor, using=using, **kwargs)


class PostgresIndex(models.Index):
    """An index built on PostgreSQL only, with its access ``method`` (``"gin"``) and the
    ``opclasses`` only PostgreSQL has (``varchar_pattern_ops``): the GIN indexes of the
    arguments and the LIKE-prefix index of the task path, which the admin's search uses
    there (django_jobs/admin/search.py). Other databases have neither; their search takes
    another path, so nothing is built for them.

    Added and removed only through :class:`django_jobs.db.online_index.AddIndexOnline`
    (and its ``RemoveIndexOnline``), which skip the other vendors; Django's own
    ``AddIndex`` would build it everywhere.
    """

    vendors = ("postgresql",)

    def __init__(self, *args: Any, method: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.method = method

    def deconstruct(self) -> Any:
        path, args, kwargs = super().deconstruct()
        if self.method:
            kwargs["method"] = self.method
        return path, args, kwargs

    def create_sql(
        self, model: type[models.Model], schema_editor: Any, using: str = "", **kwargs: Any
    ) -> Any:
        using = using or (f" USING {self.method}" if self.method else "")
        return super().create_sql(model, schema_editor, using=using, **kwargs)
