"""MySQL/MariaDB only: concurrency, rate and unique keys compare as their bytes, as elsewhere.

A table's default collation on MySQL/MariaDB ignores case and accents and, on most servers,
trailing spaces: with it, the keys "Acme", "acme" and "acmé" were one key. Two accounts
shared one concurrency slot and one rate window, a unique job refused another's call; and
a start whose key's row was stored in another case found no row of its own key and sent its
job back to wait, every time (a job stranded). PostgreSQL and SQLite compare these columns
exactly; this gives the MySQL/MariaDB columns a binary collation of their own character
set, so they do too.

The collation chosen: the character set's binary "no pad" one where the server has it
(MariaDB's ``*_nopad_bin``, MySQL 8's ``utf8mb4_0900_bin``), so that "acme " is not "acme"
either; else its ``*_bin`` (trailing spaces still ignored). Every key column gets the same
one: the raw SQL joins one key column to another, and two different collations there are an
"illegal mix". A later migration that alters one of these fields must keep its collation
(tests/test_key_case.py checks the columns). A change of collation rebuilds the table
(``django_jobs_job`` among them): on a big table, migrate while the queue is quiet.
Elsewhere this migration does nothing.
"""

from django.db import migrations

# The key columns, by model: every column that holds a concurrency, rate or unique key.
KEY_COLUMNS = {
    "Job": ("concurrency_key", "rate_key", "unique_key", "unique_lock"),
    "ReadyExecution": ("concurrency_key",),
    "BlockedExecution": ("concurrency_key",),
    "ClaimedExecution": ("concurrency_key",),
    "Semaphore": ("key",),
    "RateLimit": ("key",),
}


def binary_collation(cursor, charset: str) -> str | None:
    """The binary collation of ``charset``, no pad if the server has one."""
    for name in (f"{charset}_nopad_bin", f"{charset}_0900_bin", f"{charset}_bin"):
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.collations "
            "WHERE collation_name = %s AND character_set_name = %s",
            [name, charset],
        )
        if cursor.fetchone()[0]:
            return name
    return None


def columns(apps, schema_editor, by_model=KEY_COLUMNS):
    """Each column's table, name, type, nullability, character set and collation: the key
    columns, or those of ``by_model`` (migration 0018 gives queue names the same)."""
    found = []
    with schema_editor.connection.cursor() as cursor:
        for model_name, names in by_model.items():
            table = apps.get_model("django_jobs", model_name)._meta.db_table
            for name in names:
                cursor.execute(
                    "SELECT column_type, is_nullable, character_set_name, collation_name "
                    "FROM information_schema.columns "
                    "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
                    [table, name],
                )
                kind, nullable, charset, collation = cursor.fetchone()
                found.append((table, name, kind, nullable == "YES", charset, collation))
    return found


def modify(schema_editor, table, name, kind, nullable, charset, collation) -> None:
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"ALTER TABLE {quote(table)} MODIFY {quote(name)} {kind} "
        f"CHARACTER SET {charset} COLLATE {collation} {'NULL' if nullable else 'NOT NULL'}"
    )


def binary_keys(apps, schema_editor, by_model=KEY_COLUMNS) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    found = columns(apps, schema_editor, by_model)
    # One collation for all of them: the first column's character set's, so a database
    # whose tables differ in character set still gets columns that compare with each other.
    charset = found[0][4]
    with schema_editor.connection.cursor() as cursor:
        collation = binary_collation(cursor, charset)
    if collation is None:
        return
    for table, name, kind, nullable, _, current in found:
        if current != collation:
            modify(schema_editor, table, name, kind, nullable, charset, collation)


def default_keys(apps, schema_editor, by_model=KEY_COLUMNS) -> None:
    """Back to each table's default collation (fails where keys now differing only in
    case would collide in a unique index: the server says which)."""
    if schema_editor.connection.vendor != "mysql":
        return
    with schema_editor.connection.cursor() as cursor:
        for table, name, kind, nullable, _, _ in columns(apps, schema_editor, by_model):
            cursor.execute(
                "SELECT table_collation FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = %s",
                [table],
            )
            (default,) = cursor.fetchone()
            cursor.execute(
                "SELECT character_set_name FROM information_schema.collations "
                "WHERE collation_name = %s",
                [default],
            )
            (default_charset,) = cursor.fetchone()
            modify(schema_editor, table, name, kind, nullable, default_charset, default)


class Migration(migrations.Migration):
    # MySQL commits each ALTER TABLE: Django refuses DDL inside a transaction there.
    atomic = False
    dependencies = [("django_jobs", "0015_mysql_finish_procedure")]

    operations = [migrations.RunPython(binary_keys, default_keys, elidable=False)]
