"""MySQL/MariaDB only: a stored procedure that enqueues one ready job in one round trip.

A job ready at once needs its job row and its ready row, written together. Through
statements that is START TRANSACTION, two INSERTs and COMMIT: four round trips where
a plain ``Model.objects.create`` takes one, so a single enqueue in a web request cost
twice the time of django-tasks-db's. ``CALL django_jobs_enqueue_ready(...)`` writes
both in one: in a transaction of its own when the caller is in autocommit, else under
a savepoint of the caller's transaction, rolled back on any error (``db/mysql.py``,
``enqueue_ready``). On PostgreSQL one statement already does it (a data-modifying
CTE); SQLite is in-process. Elsewhere this migration does nothing.

The parameters are the job table's columns but the id, in order, typed and with the
character set of each column as it stands at this migration (read from
information_schema), so a value reaches its column exactly as the ORM's INSERT would
send it. The procedure's SQL lives in ``db/enqueue_procedure.py``: a migration that
adds, removes or renames a job column creates it again there, through
``follow_job_columns`` (tests/test_enqueue_procedure.py fails, on any database, until
it does); until then the code takes the statements' path for a job that sets the new
column (``db/mysql.py`` checks).
"""

from django.db import migrations

# The procedure's SQL and its creation, kept where the code that calls it and the test
# that checks its columns read them too; the names stay here for the tests that call them.
from django_jobs.db.enqueue_procedure import (  # noqa: F401
    NOT_ALLOWED,
    PROCEDURE,
    SAVEPOINT,
    columns,
    create_procedure,
    drop_procedure,
    procedure_sql,
)


class Migration(migrations.Migration):
    # MySQL commits around DDL by itself; Django refuses DDL inside its transaction there.
    atomic = False
    dependencies = [("django_jobs", "0012_workflows")]

    operations = [migrations.RunPython(create_procedure, drop_procedure, elidable=False)]
