"""MySQL/MariaDB only: queue names and recurring task keys compare as their bytes, as elsewhere.

With a table's default collation (case- and accent-insensitive, on most servers trailing
spaces ignored), the queues "emails" and "Emails" were one queue on MySQL/MariaDB and two on
PostgreSQL and SQLite: a worker started for ``--queue emails`` claimed the jobs of "Emails",
pausing one paused the other, one queue's ``max_concurrency`` row served both, and two
recurring tasks "Report" and "report" collided in the unique key. This gives every column
that holds a queue name, and the recurring task keys, the binary collation migration 0016
gave the concurrency, rate and unique keys (the character set's no-pad one where the server
has it), so the names compare exactly there too.

Migration 0014's claim procedure declares its queue variable with the queue column's
collation as it was: it is created again after the columns change, both ways, so that the
variable compares as the column does (else the comparison would rest on the server's rule
that a binary collation wins a mix of two). A change of collation rebuilds the
table (``django_jobs_job`` among them): on a big table, migrate while the queue is quiet.
Going back fails where names now differing only in case would collide in a unique index
(the server says which). Elsewhere this migration does nothing.
"""

import importlib

from django.db import migrations

binary_keys = importlib.import_module("django_jobs.migrations.0016_mysql_binary_keys")
claim_procedure = importlib.import_module("django_jobs.migrations.0014_mysql_claim_procedure")

# The columns, by model: every column that holds a queue name, and the recurring tasks' keys
# (with the tick rows' copy of them).
QUEUE_COLUMNS = {
    "Job": ("queue_name",),
    "ReadyExecution": ("queue_name",),
    "ScheduledExecution": ("queue_name",),
    "BlockedExecution": ("queue_name",),
    "AwaitingExecution": ("queue_name",),
    "ClaimedExecution": ("queue_name",),
    "QueueLock": ("queue_name",),
    "Pause": ("queue_name",),
    "RecurringTask": ("key", "queue_name"),
    "RecurringExecution": ("task_key",),
}


def binary_queue_names(apps, schema_editor) -> None:
    """0016's change, for these columns (one collation for all of them, the first column's
    character set's binary one, no pad where the server has it); then the claim procedure."""
    if schema_editor.connection.vendor != "mysql":
        return
    binary_keys.binary_keys(apps, schema_editor, QUEUE_COLUMNS)
    claim_procedure.create_procedure(apps, schema_editor)


def default_queue_names(apps, schema_editor) -> None:
    """Back to each table's default collation, and the claim procedure with it."""
    if schema_editor.connection.vendor != "mysql":
        return
    binary_keys.default_keys(apps, schema_editor, QUEUE_COLUMNS)
    claim_procedure.create_procedure(apps, schema_editor)


def columns(apps, schema_editor) -> list[tuple]:
    """Each column's table, name, type, nullability, character set and collation."""
    return binary_keys.columns(apps, schema_editor, QUEUE_COLUMNS)


class Migration(migrations.Migration):
    # MySQL commits each ALTER TABLE: Django refuses DDL inside a transaction there.
    atomic = False
    dependencies = [("django_jobs", "0017_partial_key_indexes")]

    operations = [migrations.RunPython(binary_queue_names, default_queue_names, elidable=False)]
