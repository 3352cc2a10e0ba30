"""hot_transaction: atomic()'s behaviour, with two round trips fewer on MySQL/MariaDB.

Every test runs outside the test case's own transaction (``transaction=True``), where
hot_transaction takes its MySQL path; on PostgreSQL and SQLite it is ``atomic()``, and
the same assertions hold.
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from django_jobs.db.transactions import hot_transaction
from django_jobs.models import Pause

pytestmark = pytest.mark.django_db(transaction=True)

DB = "default"


class Boom(Exception):
    pass


def paused() -> set[str]:
    return set(Pause.objects.values_list("queue_name", flat=True))


def test_a_block_that_ends_normally_commits_and_leaves_autocommit_on():
    with hot_transaction(DB):
        Pause.objects.create(queue_name="a")
        assert connection.in_atomic_block and not connection.get_autocommit()
    assert not connection.in_atomic_block and connection.get_autocommit()
    assert paused() == {"a"}


def test_an_exception_rolls_the_whole_block_back_and_is_raised():
    with pytest.raises(Boom):
        with hot_transaction(DB):
            Pause.objects.create(queue_name="a")
            raise Boom
    assert paused() == set()
    assert not connection.in_atomic_block and connection.get_autocommit()
    Pause.objects.create(queue_name="b")  # the connection is usable, in autocommit
    assert paused() == {"b"}


def test_a_nested_atomic_block_rolls_back_to_its_savepoint_and_the_rest_commits():
    with hot_transaction(DB):
        Pause.objects.create(queue_name="kept")
        try:
            with transaction.atomic(using=DB):
                Pause.objects.create(queue_name="undone")
                Pause.objects.create(queue_name="kept")  # unique: IntegrityError
        except IntegrityError:
            pass
        Pause.objects.create(queue_name="after")
    assert paused() == {"kept", "after"}


def test_a_caught_error_of_a_savepointless_block_rolls_everything_back():
    with hot_transaction(DB):
        Pause.objects.create(queue_name="a")
        try:
            with transaction.atomic(using=DB, savepoint=False):
                Pause.objects.create(queue_name="a")
        except IntegrityError:
            pass
        assert connection.needs_rollback
    assert paused() == set()
    assert not connection.needs_rollback


def test_on_commit_callbacks_run_after_the_commit_and_never_after_a_rollback():
    seen: list[tuple[str, set[str]]] = []
    with hot_transaction(DB):
        Pause.objects.create(queue_name="a")
        transaction.on_commit(lambda: seen.append(("committed", paused())), using=DB)
        assert seen == []
    assert seen == [("committed", {"a"})]
    with pytest.raises(Boom):
        with hot_transaction(DB):
            transaction.on_commit(lambda: seen.append(("rolled back", paused())), using=DB)
            raise Boom
    with hot_transaction(DB):
        pass
    assert seen == [("committed", {"a"})]


def test_inside_an_open_atomic_block_it_is_a_savepoint_of_that_block():
    with pytest.raises(Boom):
        with transaction.atomic(using=DB):
            Pause.objects.create(queue_name="outer")
            with hot_transaction(DB):
                Pause.objects.create(queue_name="inner")
            assert paused() == {"outer", "inner"}
            raise Boom
    assert paused() == set()


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL's autocommit toggles")
def test_on_mysql_a_block_costs_two_statements_fewer_than_atomic():
    def statements(block) -> int:
        """What the server counted for this session (Questions), minus the SHOW itself."""
        with connection.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
            before = int(cursor.fetchone()[1])
            with block(using=DB) if block is transaction.atomic else block(DB):
                cursor.execute("SELECT 1")
            cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
            return int(cursor.fetchone()[1]) - before - 1

    connection.ensure_connection()
    # atomic(): SET autocommit=0, SELECT, COMMIT, SET autocommit=1.
    assert statements(transaction.atomic) == 4
    # START TRANSACTION, SELECT, COMMIT.
    assert statements(hot_transaction) == 3
