"""Which database sessions are waiting for a row lock right now: what the race tests
watch to know that the protection under test is holding a path back.

PostgreSQL says it in ``pg_stat_activity``. On MariaDB/MySQL this reads ``SHOW ENGINE
INNODB STATUS``, not ``information_schema.innodb_trx``: that table is a cache InnoDB
refreshes only after it has gone unread for 0.1 s, server-wide, so a few test processes
polling it at once (``pytest -n 3``) keep each other on a stale answer that never shows
the wait (the cause of timeouts in CI on every xdist worker at once). The status is
written fresh on each read; its transaction list marks a waiting transaction with a
``LOCK WAIT`` line and names its session (``MariaDB thread id N`` / ``MySQL thread id N``).
"""

from __future__ import annotations

import re

from django.db import connections

# One transaction's block of the status's TRANSACTIONS section begins with this.
TRANSACTION_MARK = "\n---TRANSACTION "
WAITING = re.compile(r"^LOCK WAIT ", re.MULTILINE)
SESSION = re.compile(r"^(?:MariaDB|MySQL) thread id (\d+),", re.MULTILINE)


def innodb_waiting_sessions(status: str) -> set[int]:
    """The sessions whose transaction waits for a lock, in the text of an InnoDB status."""
    section = status.split("\nTRANSACTIONS\n", 1)[-1].split("\nFILE I/O\n", 1)[0]
    waiting = set()
    for block in section.split(TRANSACTION_MARK)[1:]:
        session = SESSION.search(block)
        if session is not None and WAITING.search(block):
            waiting.add(int(session.group(1)))
    return waiting


def sessions_waiting_for_a_row_lock(
    using: str = "default", this_database: bool = False
) -> dict[int, str]:
    """The server sessions now waiting for a lock (of this database only, if asked), each
    with the start of its statement (for a failing test to show)."""
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # A read inside a transaction would otherwise keep its first snapshot.
            if not connection.get_autocommit():
                cursor.execute("SELECT pg_stat_clear_snapshot()")
            where = " AND datname = current_database()" if this_database else ""
            cursor.execute(
                "SELECT pid, left(query, 60) FROM pg_stat_activity "
                f"WHERE wait_event_type = 'Lock'{where}"
            )
            return {int(pid): query for pid, query in cursor.fetchall()}
        cursor.execute("SHOW ENGINE INNODB STATUS")
        waiting = innodb_waiting_sessions(cursor.fetchone()[2])
        if not waiting:
            return {}
        # PROCESSLIST is read live (no cache): each session's database and statement.
        marks = ", ".join(["%s"] * len(waiting))
        where = " AND db = DATABASE()" if this_database else ""
        cursor.execute(
            "SELECT id, left(info, 60) FROM information_schema.processlist "
            f"WHERE id IN ({marks}){where}",
            sorted(waiting),
        )
        return {int(session): query for session, query in cursor.fetchall()}


def is_waiting_for_a_row_lock(session: int, using: str = "default") -> bool:
    """Whether server session ``session`` (backend pid / connection id) waits for a lock."""
    return session in sessions_waiting_for_a_row_lock(using)
