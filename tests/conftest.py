"""Shared fixtures: the database under test, and real ``run_jobs`` subprocesses."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from tests.harness import RunJobs, app_permissions, database_url

# Every property test of the suite: no deadline (an example is a page load or a job through
# a real worker on a real database, as slow as the machine is), no example database (a
# shared checkout, and CI starts from a clean one), and function-scoped fixtures shared by
# the examples of one test on purpose (the rows, the live worker). Each test sets its own
# max_examples.
hypothesis_settings.register_profile(
    "django_jobs",
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
hypothesis_settings.load_profile("django_jobs")


@pytest.fixture(scope="session", autouse=True)
def flush_what_was_written():
    """Every ``transactional_db`` test ends with Django's flush, which on PostgreSQL is one
    ``TRUNCATE`` of all 27 tables of the test project: 0.45 to 0.8 s under load, a new file
    for each table and each of its indexes, some 470 times a run (185 of the suite's 1,195
    test-seconds, against 26 on SQLite, which deletes). Here the flush truncates only the
    tables that have been written since their last truncate (a fresh table's file is 0
    bytes long, ``pg_relation_size``; any row written, even one deleted since, makes it 8
    KiB or more), with ``CASCADE`` for the tables that reference them, which the flush
    empties anyway: 0.1 s instead of 0.24. What a test finds is what Django's flush leaves,
    every table empty and in a file of its own: not a ``DELETE``, whose dead rows' space a
    later insert may reuse and so change the order an unordered query returns (a test of
    test_rate_limits.py failed so). A flush that resets sequences or cascades already (the
    soak's, ``tests.harness``) keeps Django's statement; SQLite and MariaDB are untouched."""
    from django.db import connections

    patched = []
    for conn in connections.all(initialized_only=False):
        ops = type(conn.ops)
        if conn.vendor != "postgresql" or any(ops is done for done, _ in patched):
            continue
        truncate = ops.sql_flush

        def sql_flush(
            self, style, tables, *, reset_sequences=False, allow_cascade=False, truncate=truncate
        ):
            if reset_sequences or allow_cascade:
                cascade, reset = allow_cascade, reset_sequences
                return truncate(self, style, tables, reset_sequences=reset, allow_cascade=cascade)
            with self.connection.cursor() as cursor:
                cursor.execute(
                    "SELECT name FROM unnest(%s::text[]) AS name "
                    "WHERE pg_relation_size(to_regclass(quote_ident(name))) > 0",
                    [list(tables)],
                )
                written = [name for (name,) in cursor.fetchall()]
            return truncate(self, style, written, allow_cascade=True)

        ops.sql_flush = sql_flush
        patched.append((ops, truncate))
    yield
    for ops, truncate in patched:
        ops.sql_flush = truncate


@pytest.fixture(scope="session", autouse=True)
def flush_without_post_migrate():
    """Django's flush after each ``transactional_db`` test ends with the ``post_migrate``
    signal, whose receivers make every app's 28 content types and 96 permissions again, one
    query each at least: 50 ms of a 55 ms flush on SQLite, some 470 times per database a run.
    No test reads them but those that give a user a permission, which make them first
    (``harness.app_permissions``); the admin makes a content type when it needs one, once
    the cache of those the flush deleted is cleared, as the signal's receiver would have.
    Nothing of ours listens to ``post_migrate``: the suite's tables are what the flush leaves."""
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.commands import flush

    def forget_content_types(*args: object, **kwargs: object) -> None:
        ContentType.objects.clear_cache()

    emit = flush.emit_post_migrate_signal
    flush.emit_post_migrate_signal = forget_content_types
    yield
    flush.emit_post_migrate_signal = emit


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Django's default hasher spends ~0.5 s per password by design; the admin tests
    create a user each, which made them most of the suite's time. Logins still check
    the password, with a hasher that is cheap."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def fresh_prefix_queue_names():
    """A worker process remembers for a second which queues a ``prefix*`` pattern
    covers (claims.prefix_queues, MariaDB/MySQL); each test starts without the last
    test's queues."""
    from django_jobs.core.ready import PREFIX_NAMES

    PREFIX_NAMES.clear()


@pytest.fixture
def viewer(db):
    """A logged-in admin client of a staff user who may view jobs and change nothing."""
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    app_permissions()
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def jobs_db(settings) -> str:
    """The alias the backend writes to (``default`` in the test project)."""
    return "default"


@pytest.fixture
def run_jobs(transactional_db, tmp_path):
    """Start real ``manage.py run_jobs`` processes against the test database.

    Every process started is stopped (SIGKILL if need be) at teardown.
    """
    started: list[RunJobs] = []

    def start(*args: str, env: dict[str, str] | None = None) -> RunJobs:
        proc = RunJobs(
            list(args),
            database_url=database_url(),
            log_path=tmp_path / f"run_jobs-{len(started)}.log",
            extra_env=env or {},
        )
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()


@pytest.fixture
def figure(request):
    """Report a measured figure (a crash window, a pool's use) under the run's summary.

    Kept on the test's report rather than printed, so it reaches the summary from
    pytest-xdist's worker processes too, whose own output nobody sees."""

    def report(text: str) -> None:
        request.node.user_properties.append(("figure", text.strip()))

    return report


def pytest_terminal_summary(terminalreporter):
    figures = [
        value
        for kind in ("passed", "failed")
        for report in terminalreporter.stats.get(kind, [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == "figure"
    ]
    if figures:
        terminalreporter.section("figures")
        for text in sorted(figures):
            terminalreporter.write_line(text)
