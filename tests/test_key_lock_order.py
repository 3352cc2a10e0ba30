"""MySQL/MariaDB: a start locks its keys' rate rows in ascending key order, in one statement
of point lookups (``db/mysql.py``, ``Operations.lock_in_key_order``), as every path locks
them (docs/design.md section 4). PostgreSQL's one-statement start has its own pair of these
tests in tests/test_rate_limits_one_statement.py."""

from __future__ import annotations

import pytest
from django.db import connection

from django_jobs.db import ops
from tests.test_rate_limits_one_statement import first_key_locked_while_the_last_waits

pytestmark = pytest.mark.skipif(
    connection.vendor != "mysql", reason="InnoDB's locking reads (db/mysql.py)"
)


@pytest.mark.django_db(transaction=True)
def test_the_start_locks_the_rate_rows_in_ascending_key_order(monkeypatch):
    """Waiting for the later key, the start already holds the earlier."""
    assert first_key_locked_while_the_last_waits(monkeypatch)


@pytest.mark.django_db(transaction=True)
def test_unprotected_the_start_locking_in_descending_order_waits_holding_nothing(monkeypatch):
    """The twin: the keys in descending order, the start waits for the later key first and
    the earlier is free: the order the other test sees is the statement's."""
    operations = type(ops("default"))
    ascending = operations.locking_order
    monkeypatch.setattr(operations, "locking_order", lambda self, keys: ascending(self, keys)[::-1])
    assert not first_key_locked_while_the_last_waits(monkeypatch)
