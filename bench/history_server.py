"""What bench/history.py reads from the database server itself: relation sizes, which server
processes serve this database (for CPU per job), and whether autovacuum or InnoDB's purge
is working on the history while the hot paths are timed.

Vendor-specific reads of the server's own catalogues; nothing here writes.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import DatabaseError

from bench.tables import tables_of

SAMPLE_S = 0.5  # between two looks at the vacuum's progress
MB = 1024 * 1024


# --- sizes -------------------------------------------------------------------------------


@dataclass
class Size:
    table: str
    data_mb: float
    index_mb: float

    @property
    def total_mb(self) -> float:
        return self.data_mb + self.index_mb


def relation_sizes() -> list[Size] | None:
    """Each django_jobs table's size and its indexes', biggest first; None where the
    server does not tell (SQLite without the dbstat table).

    PostgreSQL: ``pg_table_size`` (heap, TOAST, free space map) and ``pg_indexes_size``.
    MariaDB: information_schema's ``data_length`` and ``index_length`` (InnoDB's estimates,
    as fresh as its last statistics). SQLite: the pages dbstat counts per table and index.
    """
    tables = tables_of("django_jobs")
    sizes: list[Size] = []
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            for table in tables:
                cursor.execute("SELECT pg_table_size(%s), pg_indexes_size(%s)", [table, table])
                data, index = cursor.fetchone()
                sizes.append(Size(table, data / MB, index / MB))
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT table_name, data_length, index_length FROM information_schema.tables "
                "WHERE table_schema = DATABASE()"
            )
            found = {name: (data, index) for name, data, index in cursor.fetchall()}
            sizes = [Size(t, found[t][0] / MB, found[t][1] / MB) for t in tables if t in found]
        else:
            try:
                cursor.execute(
                    "SELECT m.tbl_name, m.type, SUM(d.pgsize) FROM dbstat d "
                    "JOIN sqlite_master m ON m.name = d.name GROUP BY m.tbl_name, m.type"
                )
            except DatabaseError:
                return None
            by_table: dict[str, list[float]] = {}
            for table, kind, size in cursor.fetchall():
                pair = by_table.setdefault(table, [0.0, 0.0])
                pair[0 if kind == "table" else 1] += size / MB
            sizes = [Size(t, *by_table[t]) for t in tables if t in by_table]
    return sorted(sizes, key=lambda s: -s.total_mb)


# --- the server's processes ------------------------------------------------------------------


def our_backends() -> set[int] | None:
    """PostgreSQL: the pids of this database's backends and of the server's own processes
    (WAL writer, checkpointer, ...; no database), so that CPU read from /proc leaves out
    the backends of other databases on a shared server. None elsewhere: MariaDB is one
    process (its CPU is every client's), SQLite has no server."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() OR datname IS NULL"
        )
        return {pid for (pid,) in cursor.fetchall()}


# --- autovacuum and purge while the hot paths run ----------------------------------------


@dataclass
class VacuumWatch:
    """Samples, every SAMPLE_S on a connection of its own, whether autovacuum is working on
    ``table`` (PostgreSQL: ``pg_stat_progress_vacuum`` with ``pg_stat_activity``) or how
    long InnoDB's purge backlog is (MariaDB: the history list length), from ``start()``
    to ``stop()``; :meth:`summary` says what it saw."""

    table: str
    began: float = 0.0
    ended: float = 0.0
    seen: list[tuple[float, str]] = field(default_factory=list)  # (seconds in, phase)
    history_lengths: list[int] = field(default_factory=list)
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    disabled: str = ""  # why autovacuum cannot run on the table, if it cannot

    def __post_init__(self) -> None:
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self) -> VacuumWatch:
        self.before = table_stats(connection, self.table)
        self.disabled = autovacuum_off(connection, self.table)
        self.began = time.perf_counter()
        if connection.vendor != "sqlite":
            self.thread.start()
        return self

    def stop(self) -> None:
        self.halt.set()
        if self.thread.is_alive():
            self.thread.join(10)
        self.ended = time.perf_counter()
        self.after = table_stats(connection, self.table)

    def run(self) -> None:
        from django.db import connections

        own = connections.create_connection("default")
        try:
            while not self.halt.is_set():
                at = time.perf_counter() - self.began
                if own.vendor == "postgresql":
                    phase = autovacuum_phase(own, self.table)
                    if phase:
                        self.seen.append((at, phase))
                else:
                    self.history_lengths.append(history_list_length(own))
                self.halt.wait(SAMPLE_S)
        except DatabaseError as exc:
            self.error = str(exc)
        finally:
            own.close()

    def summary(self) -> str:
        span = self.ended - self.began
        if connection.vendor == "sqlite":
            return "SQLite has no background vacuum: deleted pages go to its free list"
        if connection.vendor == "mysql":
            lengths = self.history_lengths or [0]
            return (
                f"InnoDB purge: history list length {lengths[0]:,} at the start, "
                f"{max(lengths):,} at most, {lengths[-1]:,} at the end of the {span:.0f} s "
                f"({len(self.history_lengths)} samples)"
            )
        if not self.seen:
            text = f"autovacuum did not run on {self.table} during the {span:.0f} s"
            if self.disabled:
                text += f" ({self.disabled}: nothing but a manual VACUUM reclaims dead rows)"
        else:
            first, last = self.seen[0][0], self.seen[-1][0]
            phases = list(dict.fromkeys(phase for _, phase in self.seen))
            who = "a vacuum" if any("client" in p for p in phases) else "autovacuum"
            text = (
                f"{who} ran on {self.table} from {first:.0f} s to {last:.0f} s of the "
                f"{span:.0f} s ({last - first + SAMPLE_S:.0f} s seen; phases: "
                f"{', '.join(phases)})"
            )
        b, a = self.before, self.after
        counts = a.get("autovacuum_count", 0) - b.get("autovacuum_count", 0)
        text += (
            f"; autovacuums finished meanwhile: {counts}; dead rows "
            f"{b.get('n_dead_tup', 0):,} -> {a.get('n_dead_tup', 0):,}"
        )
        return text + (f"; watch failed: {self.error}" if self.error else "")


def autovacuum_phase(db: BaseDatabaseWrapper, table: str) -> str:
    """The phase of a vacuum of ``table`` going on now, '' if none; a VACUUM that a client
    runs (a prune that vacuums after itself, say) is named as such."""
    with db.cursor() as cursor:
        cursor.execute(
            "SELECT p.phase, a.backend_type FROM pg_stat_progress_vacuum p "
            "JOIN pg_stat_activity a ON a.pid = p.pid "
            "WHERE p.datname = current_database() AND p.relid = %s::regclass",
            [table],
        )
        row = cursor.fetchone()
    if row is None:
        return ""
    phase, backend = row
    return phase if backend == "autovacuum worker" else f"{phase} (a client's VACUUM)"


def history_list_length(db: BaseDatabaseWrapper) -> int:
    """InnoDB's purge backlog: undo logs of committed transactions not purged yet."""
    with db.cursor() as cursor:
        cursor.execute("SHOW ENGINE INNODB STATUS")
        status = cursor.fetchone()[2]
    found = re.search(r"History list length (\d+)", status)
    return int(found.group(1)) if found else 0


def table_stats(db: BaseDatabaseWrapper, table: str) -> dict[str, Any]:
    """PostgreSQL's counters of ``table``: dead rows, autovacuums so far."""
    if db.vendor != "postgresql":
        return {}
    with db.cursor() as cursor:
        cursor.execute(
            "SELECT n_dead_tup, autovacuum_count, last_autovacuum FROM pg_stat_user_tables "
            "WHERE relid = %s::regclass",
            [table],
        )
        row = cursor.fetchone()
    return dict(zip(("n_dead_tup", "autovacuum_count", "last_autovacuum"), row, strict=True))


def autovacuum_off(db: BaseDatabaseWrapper, table: str) -> str:
    """Why autovacuum will not vacuum ``table`` (the server's setting or the table's storage
    parameter), '' if it may."""
    if db.vendor != "postgresql":
        return ""
    with db.cursor() as cursor:
        cursor.execute("SELECT current_setting('autovacuum'), current_setting('track_counts')")
        server, counts = cursor.fetchone()
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [table])
        options = cursor.fetchone()[0] or []
    if server != "on":
        return "autovacuum is off on this server"
    if counts != "on":
        return "track_counts is off on this server"
    if "autovacuum_enabled=false" in options:
        return f"autovacuum_enabled=false on {table}"
    return ""
