"""A real PgBouncer (Debian's ``pgbouncer`` package) for the tests, in transaction pooling.

:class:`PgBouncer` writes a ``pgbouncer.ini`` and an auth file into a directory of its
own, starts ``/usr/sbin/pgbouncer`` in the foreground (as the ``postgres`` user when the
tests run as root: PgBouncer refuses to run as root), waits until its admin console
answers, and stops it with SIGTERM. It listens on 127.0.0.1 only (no Unix socket), on a
free port, and maps the test database to the PostgreSQL server the tests use.

:func:`tcp_connections` tells which TCP peers a process (a worker, say) is connected
to, from ``/proc``: the tests use it to prove what goes through PgBouncer and what
does not.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

BINARY = os.environ.get("JOBS_PGBOUNCER", "/usr/sbin/pgbouncer")
ADMIN_DB = "pgbouncer"  # PgBouncer's admin console: SHOW CLIENTS, SHOW POOLS, ...


def binary() -> str | None:
    """The pgbouncer executable, or None when it is not installed."""
    if os.access(BINARY, os.X_OK):
        return BINARY
    return shutil.which("pgbouncer")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quoted(value: str) -> str:
    """A value of the auth file: double quotes, doubled inside."""
    return '"' + value.replace('"', '""') + '"'


@dataclass
class Upstream:
    """The PostgreSQL server and database PgBouncer hands connections to."""

    host: str
    port: int
    dbname: str
    user: str
    password: str = ""

    def params(self) -> dict[str, Any]:
        """psycopg arguments for a connection straight to PostgreSQL (autocommit)."""
        return {
            "host": self.host,
            "port": self.port,
            "dbname": self.dbname,
            "user": self.user,
            "password": self.password or None,
            "autocommit": True,
        }

    def url(self, port: int | None = None) -> str:
        """A DATABASE_URL for this database, straight or (``port``) through PgBouncer."""
        auth = quote(self.user) + (f":{quote(self.password)}" if self.password else "")
        host = "127.0.0.1" if port else self.host
        return f"postgres://{auth}@{host}:{port or self.port}/{quote(self.dbname)}"


class PgBouncer:
    """One pgbouncer process in transaction pooling mode, for ``upstream``'s database."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        pool_size: int = 5,
        max_client_conn: int = 60,
        executable: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.executable = executable or binary() or BINARY
        self.directory = Path(tempfile.mkdtemp(prefix="django-jobs-pgbouncer-"))
        self.log_path = self.directory / "pgbouncer.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None

    # -- configuration ---------------------------------------------------------------

    def run_as(self) -> str | None:
        """The unprivileged user to switch to (``-u``) when we are root, else None."""
        if os.geteuid() != 0:
            return None
        for name in ("postgres", "nobody"):
            try:
                pwd.getpwnam(name)
            except KeyError:
                continue
            return name
        raise RuntimeError("pgbouncer will not run as root, and there is no postgres user")

    def write_config(self) -> Path:
        u = self.upstream
        auth_file = self.directory / "userlist.txt"
        # auth_type = trust checks no password, but the user must be listed; the
        # password (if any) is what PgBouncer logs in to PostgreSQL with.
        auth_file.write_text(f"{quoted(u.user)} {quoted(u.password)}\n")
        ini = self.directory / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"{u.dbname} = host={u.host} port={u.port} dbname={u.dbname}\n"
            "\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {auth_file}\n"
            f"admin_users = {u.user}\n"
            "pool_mode = transaction\n"
            f"max_client_conn = {self.max_client_conn}\n"
            f"default_pool_size = {self.pool_size}\n"
            "reserve_pool_size = 0\n"
            # Clients wait for a server connection rather than fail at once when the
            # pool is busy; a pool that never frees one shows up as this timeout.
            "query_wait_timeout = 30\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n"
        )
        # Readable by the user pgbouncer switches to (mkdtemp made the directory 0700).
        self.directory.chmod(0o755)
        for path in (ini, auth_file):
            path.chmod(0o644)
        return ini

    # -- life ------------------------------------------------------------------------

    def start(self, attempts: int = 3, timeout: float = 10.0) -> None:
        """Start on a free port (another one if that port was taken meanwhile)."""
        for attempt in range(attempts):
            self.port = free_port()
            ini = self.write_config()
            user = self.run_as()
            command = [self.executable, *(["-u", user] if user else []), str(ini)]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            if self.wait_ready(timeout):
                return
            self.stop()
            if "Address already in use" not in self.log() or attempt == attempts - 1:
                break
        raise RuntimeError(f"pgbouncer did not start ({' '.join(command)}):\n{self.log()}")

    def wait_ready(self, timeout: float) -> bool:
        import psycopg

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with psycopg.connect(**self.admin_params(), connect_timeout=2):
                    return True
            except psycopg.OperationalError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM (PgBouncer's immediate shutdown: it closes every connection)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- talking to it ---------------------------------------------------------------

    def url(self) -> str:
        """A DATABASE_URL for the test database through PgBouncer."""
        return self.upstream.url(port=self.port)

    def client_params(self) -> dict[str, Any]:
        """psycopg arguments for a client of the test database through PgBouncer
        (autocommit, no prepared statements)."""
        return {
            **self.upstream.params(),
            "host": "127.0.0.1",
            "port": self.port,
            "prepare_threshold": None,
        }

    def admin_params(self) -> dict[str, Any]:
        return {
            "host": "127.0.0.1",
            "port": self.port,
            "dbname": ADMIN_DB,
            "user": self.upstream.user,
            "autocommit": True,
            "prepare_threshold": None,
        }

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (CLIENTS, SERVERS, POOLS, STATS, CONFIG)."""
        import psycopg

        with psycopg.connect(**self.admin_params()) as admin:
            cursor = admin.execute(f"SHOW {what}")
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def clients(self) -> list[dict[str, Any]]:
        """The client connections to the test database (the admin console's left out)."""
        return [row for row in self.show("CLIENTS") if row["database"] == self.upstream.dbname]

    def pool(self) -> dict[str, Any]:
        """The test database's row of ``SHOW POOLS``."""
        (row,) = [row for row in self.show("POOLS") if row["database"] == self.upstream.dbname]
        return row

    def servers(self) -> list[dict[str, Any]]:
        """PgBouncer's connections to PostgreSQL for the test database."""
        return [row for row in self.show("SERVERS") if row["database"] == self.upstream.dbname]

    def close_servers(self, timeout: float = 5.0) -> None:
        """Close PgBouncer's connections to PostgreSQL (each once it is released), and
        wait until they are gone: idle ones would keep whatever a test's clients left on
        their sessions, and show in ``pg_stat_activity`` under a client's
        ``application_name`` while other tests run."""
        import psycopg

        with psycopg.connect(**self.admin_params()) as admin:
            admin.execute(f"RECONNECT {self.upstream.dbname}")
        deadline = time.monotonic() + timeout
        while self.servers() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stats(self) -> dict[str, Any]:
        """The test database's row of ``SHOW STATS`` (totals since PgBouncer started)."""
        (row,) = [row for row in self.show("STATS") if row["database"] == self.upstream.dbname]
        return row

    def transactions(self) -> int:
        """Transactions PgBouncer has passed to PostgreSQL for the test database so far."""
        return int(self.stats()["total_xact_count"])


# -- which TCP peers a process talks to ---------------------------------------------------


def local_port(raw_connection: Any) -> int:
    """The local TCP port of a psycopg connection's socket (what PgBouncer's
    ``SHOW CLIENTS`` calls ``port``, and PostgreSQL's ``pg_stat_activity`` ``client_port``)."""
    fd = raw_connection.pgconn.socket
    with socket.socket(fileno=os.dup(fd)) as sock:
        return sock.getsockname()[1]


def _tcp_table(pid: int) -> dict[int, tuple[int, int]]:
    """socket inode -> (local port, remote port) of every established TCP socket the
    network namespace of ``pid`` holds."""
    table: dict[int, tuple[int, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            if state != "01":  # ESTABLISHED
                continue
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    return table


def tcp_connections(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of each established TCP connection process ``pid`` holds."""
    table = _tcp_table(pid)
    found = []
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and (inode := int(target[8:-1])) in table:
            found.append(table[inode])
    return sorted(found)
