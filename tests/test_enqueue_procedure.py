"""MySQL/MariaDB's enqueue procedure follows the job table's columns, checked on any database.

The procedure (migration 0013, ``django_jobs/db/enqueue_procedure.py``) takes the job's columns
as they stand when it is created; a procedure is not altered by ``ALTER TABLE``. A migration
that adds a job column and does not create it again leaves every enqueue on MySQL/MariaDB on
the statements' path, four round trips instead of one, and only a MariaDB run noticed
(tests/test_mysql_enqueue.py). Here the migrations are walked as Django plans them, without a
database: after each migration of ours, and after each is unapplied, the columns the procedure
was last created with must be the job table's.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import migrations, models
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations.special import RunPython
from django.db.migrations.state import ProjectState

from django_jobs.db.enqueue_procedure import (
    COMPUTED_READY_COLUMNS,
    LATER_READY_COLUMNS,
    READY_COLUMNS,
    create_procedure,
    drop_procedure,
    follow_job_columns,
    procedure_columns,
)
from django_jobs.models import Job, ReadyExecution

APP = "django_jobs"
FIX = (
    "wrap the migration's operations on the job table in "
    "django_jobs.db.enqueue_procedure.follow_job_columns(...) (docs/contributing.md, "
    '"Adding an option to a task")'
)


def planned() -> list[migrations.Migration]:
    """Every migration up to our latest, in the order ``migrate`` applies them."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    (leaf,) = loader.graph.leaf_nodes(APP)
    return [loader.graph.nodes[key] for key in loader.graph.forwards_plan(leaf)]


def job_columns(state: ProjectState) -> frozenset[str]:
    """The columns the procedure would take, created on the job table of ``state``."""
    model = state.models.get((APP, "job"))
    if model is None:
        return frozenset()
    fields = []
    for name, field in model.fields.items():
        bound = field.clone()
        bound.set_attributes_from_name(name)  # its column, as the model class would have it
        fields.append(bound)
    return procedure_columns(fields)


def procedure_step(operation: object, forwards: bool) -> str | None:
    """``"create"`` or ``"drop"`` where ``operation`` does that to the procedure, run
    ``forwards`` or backwards; else None."""
    if not isinstance(operation, RunPython):
        return None
    code = operation.code if forwards else operation.reverse_code
    return {create_procedure: "create", drop_procedure: "drop"}.get(code)  # type: ignore[call-overload]


def described(columns: frozenset[str] | None, expected: frozenset[str]) -> str:
    if columns is None:
        return "no procedure"
    missing, extra = sorted(expected - columns), sorted(columns - expected)
    return "; ".join(
        part
        for part in (
            missing and f"not taking {', '.join(missing)}",
            extra and f"taking {', '.join(extra)}, which the table no longer has",
        )
        if part
    )


def gaps(plan: Iterable[migrations.Migration]) -> tuple[list[str], frozenset[str] | None]:
    """Where the procedure stops following the job table: a sentence per migration of ours
    after which (applied, or unapplied) the procedure's columns are not the table's; and the
    columns it was last created with (None: no migration creates it)."""
    state = ProjectState()
    taken: frozenset[str] | None = None  # the procedure's columns; None: none created yet
    found = []
    for migration in plan:
        if migration.app_label != APP:
            state = migration.mutate_state(state, preserve=False)
            continue
        before = taken
        states = [job_columns(state)]
        for operation in migration.operations:
            operation.state_forwards(APP, state)
            states.append(job_columns(state))
            step = procedure_step(operation, forwards=True)
            if step:
                taken = states[-1] if step == "create" else None
        if taken is not None and taken != states[-1]:
            found.append(
                f"after migration {migration.name} the procedure is left "
                f"{described(taken, states[-1])}: {FIX}"
            )
        # Unapplied: the operations backwards, each from the state after it.
        back = taken
        for index in reversed(range(len(migration.operations))):
            step = procedure_step(migration.operations[index], forwards=False)
            if step:
                back = states[index] if step == "create" else None
        if before is not None and back != states[0]:
            found.append(
                f"migrating back past {migration.name} leaves the procedure "
                f"{described(back, states[0])}: {FIX}"
            )
    return found, taken


def test_every_migration_leaves_the_procedure_taking_the_job_tables_columns():
    found, taken = gaps(planned())
    assert not found, "\n".join(found)
    assert taken is not None, "no migration creates the enqueue procedure"
    model = procedure_columns(Job._meta.concrete_fields)
    assert taken == model, (
        f"the Job model and the procedure disagree: {described(taken, model)}. Make the "
        f"migration (makemigrations django_jobs) and {FIX}"
    )


def test_the_procedure_writes_every_column_of_the_ready_row():
    """Its second INSERT names the ready row's columns (``READY_COLUMNS``, and those of
    ``LATER_READY_COLUMNS`` the table has, each copied from the job's column of the same
    name): a column added to ``ReadyExecution`` would be left to a default the table may not
    have. Such a column joins ``LATER_READY_COLUMNS``, and the migration that adds it
    creates the procedure again (``follow_job_columns``)."""
    ready = {field.column for field in ReadyExecution._meta.concrete_fields}
    written = {*READY_COLUMNS, *LATER_READY_COLUMNS, *COMPUTED_READY_COLUMNS}
    assert ready == written, (
        f"ReadyExecution's columns {sorted(ready)} are not those the enqueue procedure writes "
        f"{sorted(written)}: add the new one to LATER_READY_COLUMNS "
        "(django_jobs/db/enqueue_procedure.py keeps 0013's SQL as it is) and create the "
        "procedure again in the migration that changes the table"
    )
    job = {field.column for field in Job._meta.concrete_fields}
    assert set(LATER_READY_COLUMNS) <= job, "each later ready column copies the job's own"


def a_migration(*operations) -> migrations.Migration:
    migration = migrations.Migration("9999_a_job_column", APP)
    migration.operations = list(operations)
    return migration


def a_column() -> migrations.AddField:
    return migrations.AddField("job", "a_column", models.JSONField(default=list, blank=True))


def test_a_new_job_column_without_the_procedure_is_found():
    found, _ = gaps([*planned(), a_migration(a_column())])
    assert [line.split(":")[0] for line in found] == [
        "after migration 9999_a_job_column the procedure is left not taking a_column"
    ]
    assert "follow_job_columns" in found[0]


def test_a_removed_job_column_without_the_procedure_is_found():
    found, _ = gaps([*planned(), a_migration(migrations.RemoveField("job", "trace_context"))])
    assert [line.split(":")[0] for line in found] == [
        "after migration 9999_a_job_column the procedure is left taking trace_context, "
        "which the table no longer has"
    ]


def test_the_procedure_created_again_only_forwards_is_found_backwards():
    again = migrations.RunPython(create_procedure, migrations.RunPython.noop)
    found, _ = gaps([*planned(), a_migration(a_column(), again)])
    assert [line.split(":")[0] for line in found] == [
        "migrating back past 9999_a_job_column leaves the procedure taking a_column, "
        "which the table no longer has"
    ]


def test_follow_job_columns_keeps_the_procedure_following_both_ways():
    found, taken = gaps([*planned(), a_migration(*follow_job_columns(a_column()))])
    assert found == []
    assert taken == procedure_columns(Job._meta.concrete_fields) | {"a_column"}
