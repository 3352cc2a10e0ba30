"""The database connections a group of processes holds, as the server sees them (Linux).

Phase "async" of bench/throughput.py asks how many connections each way of running
``async def`` jobs takes: a count of the server's sessions for the bench database
alone would include the harness's own (its Django connection, the enqueue notifier's),
so each session is traced back to the process holding its socket instead. A TCP
socket's inode is in ``/proc/PID/fd`` of the processes that hold it, and
``/proc/net/tcp`` gives that inode's local port; PostgreSQL's ``pg_stat_activity``
(``client_port``) and MariaDB's processlist (``HOST``, ``address:port``) give the
client's port of each session. SQLite has no server: a connection is an open file
description of the database file, found in ``/proc/PID/fd`` the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """Inodes of the sockets these processes have open (gone processes are skipped)."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def local_ports(pids: Iterable[int], server_port: int) -> set[int]:
    """Local ports of these processes' TCP connections to ``server_port`` (any address).

    /proc/net/tcp and tcp6 list every socket of this network namespace: local and
    remote address:port in hex, the state, and the inode in the tenth column."""
    inodes = socket_inodes(pids)
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], int(fields[9])
            if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def open_files(pids: Iterable[int], path: Path) -> int:
    """How many open file descriptions of ``path`` these processes hold: one per SQLite
    connection (its -wal and -shm files are other paths)."""
    wanted = str(path.resolve())
    count = 0
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == wanted:
                    count += 1
            except OSError:
                continue
    return count


def held_connections(connection: Any, pids: list[int]) -> dict[str, Any]:
    """The sessions of the bench database that ``pids`` hold, counted by the server:
    ``held`` (theirs), ``database_total`` (every session of the database, the caller's
    included), and on PostgreSQL theirs by state. ``connection`` is the caller's Django
    connection to the same database."""
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        held = open_files(pids, Path(params["NAME"]))
        return {"held": held, "database_total": None, "how": "open files of the database"}
    default_port = 5432 if connection.vendor == "postgresql" else 3306
    ports = local_ports(pids, int(params.get("PORT") or default_port))
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT client_port, state FROM pg_stat_activity WHERE datname = current_database()"
            )
            rows = [(port, state or "") for port, state in cursor.fetchall()]
            how = "pg_stat_activity of the bench database, by client_port"
        else:
            cursor.execute(
                "SELECT HOST, COMMAND FROM information_schema.PROCESSLIST WHERE DB = DATABASE()"
            )
            rows = [(client_port(host), command) for host, command in cursor.fetchall()]
            how = "the processlist of the bench database, by the client's port"
    theirs = [state for port, state in rows if port in ports]
    states: dict[str, int] = {}
    for state in theirs:
        states[state] = states.get(state, 0) + 1
    return {
        "held": len(theirs),
        "database_total": len(rows),
        "sockets": len(ports),
        "by_state": states,
        "how": how,
    }


def client_port(host: str | None) -> int | None:
    """The port of a processlist HOST (``127.0.0.1:51234``; ``localhost`` over a socket)."""
    if not host or ":" not in host:
        return None
    try:
        return int(host.rsplit(":", 1)[1])
    except ValueError:
        return None
