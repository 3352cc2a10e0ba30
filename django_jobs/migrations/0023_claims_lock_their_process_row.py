"""MySQL/MariaDB only: the claim procedure locks its process's row before it takes a ready row.

A worker pruned as dead while it still runs (docs/design.md section 5) claims on under its
old process id until its next heartbeat finds the row gone. Its claims then outlived the
prune that should have recovered them, and one could take again a job the prune had just
recovered, so that the first attempt's late outcome ended the second (``lock_own_claim``
matches job and process). Every claim path now reads its process row under a shared lock
first (``core/ready.py``, ``claim_jobs``): a claim either commits before the prune's delete,
which waits for it, and the recovery after the delete sees it; or it finds the row gone and
claims nothing. Here, migration 0014's procedure with that read added (a plain read would
not do: under REPEATABLE READ it sees the view of the transaction's start); the statements'
path does the same in Python, PostgreSQL's one statement reads the row in its snapshot
(``db/postgresql/claims.py``). Elsewhere this migration does nothing.
"""

import importlib

from django.db import migrations

from django_jobs.db.procedures import install_procedure

claim_procedure = importlib.import_module("django_jobs.migrations.0014_mysql_claim_procedure")

# Where the read goes in 0014's text: a variable among its declarations, and the read right
# after the first statement of its transaction (or savepoint), before the pick.
DECLARED = "  DECLARE next_queue INT DEFAULT 0;\n"
STARTED = "  SET want = p_limit;\n"


def procedure_sql(apps, schema_editor) -> str:
    sql = claim_procedure.procedure_sql(apps, schema_editor)
    process = schema_editor.quote_name(apps.get_model("django_jobs", "Process")._meta.db_table)
    for anchor in (DECLARED, STARTED):
        assert sql.count(anchor) == 1, f"0014's procedure changed: {anchor.strip()!r}"
    sql = sql.replace(DECLARED, DECLARED + "  DECLARE own_process INT DEFAULT 0;\n")
    return sql.replace(
        STARTED,
        STARTED
        + "  -- This process's row, under a shared lock: a process pruned as dead claims nothing.\n"
        f"  SELECT COUNT(*) INTO own_process FROM {process} WHERE id = p_process_id\n"
        "    LOCK IN SHARE MODE;\n"
        "  IF own_process = 0 THEN SET want = 0; END IF;\n",
    )


def create_procedure(apps, schema_editor) -> None:
    install_procedure(
        schema_editor,
        claim_procedure.PROCEDURE,
        lambda: procedure_sql(apps, schema_editor),
        migration="0023",
        without_it="claims take seven round trips instead of one",
    )


def drop_procedure(apps, schema_editor) -> None:
    claim_procedure.drop_procedure(apps, schema_editor)


class Migration(migrations.Migration):
    # MySQL commits around DDL by itself; Django refuses DDL inside its transaction there.
    atomic = False
    dependencies = [("django_jobs", "0022_async_jobs")]

    operations = [
        migrations.RunPython(create_procedure, claim_procedure.create_procedure, elidable=False)
    ]
