"""A TCP proxy on 127.0.0.1 that a test can cut, to take the database away from a worker."""

from __future__ import annotations

import contextlib
import socket
import threading

from django.db.backends.base.base import BaseDatabaseWrapper

from tests.harness import wait_until


class CuttableProxy:
    """Forwards connections to ``upstream``; ``cut()`` drops them all and refuses new ones."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.upstream_ports: list[int] = []  # our end of each connection to the server
        self.cut_ports: list[int] = []
        self.refusing = False
        self.closed = False
        threading.Thread(target=self.accept_loop, daemon=True).start()

    def accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.lock:
                if self.refusing:  # cut while we were connecting: that connection is cut too
                    self.cut_ports.append(server.getsockname()[1])
                    client.close()
                    server.close()
                    continue
                self.sockets += [client, server]
                self.upstream_ports.append(server.getsockname()[1])
            threading.Thread(target=self.pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(server, client, False), daemon=True).start()

    def pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
                if from_client:
                    self.sent(source, data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def sent(self, client: socket.socket, data: bytes) -> None:
        """What ``client`` sent upstream, once forwarded (a subclass may look at it)."""

    def cut(self) -> None:
        with self.lock:
            self.refusing = True
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()
            self.cut_ports += self.upstream_ports
            self.upstream_ports.clear()

    def wait_for_the_server_to_let_go(
        self, connection: BaseDatabaseWrapper, timeout: float = 20.0
    ) -> None:
        """Return once the server has ended every session that came through us.

        A statement the server had read before the cut still runs after it, to its end,
        and in autocommit it commits: a worker's claim sent a moment before the cut can
        take a job enqueued a moment after. The server notices the lost client only when
        it next reads, so a session gone from its process list has nothing left to run.
        ``connection`` must reach the server directly, not through this proxy.
        """
        with self.lock:
            ports = list(self.cut_ports)
        if not ports:
            return
        if connection.vendor == "postgresql":
            sql = "SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY(%s)"
            params: list = [ports]
        else:  # MySQL/MariaDB name a TCP client "host:port"
            marks = ", ".join(["%s"] * len(ports))
            sql = (
                "SELECT count(*) FROM information_schema.processlist"
                f" WHERE SUBSTRING_INDEX(host, ':', -1) IN ({marks})"
            )
            params = [str(port) for port in ports]

        def none_left() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                return cursor.fetchone()[0] == 0

        wait_until(none_left, timeout, 0.02, what="the sessions cut at the proxy ended")

    def restore(self) -> None:
        self.refusing = False

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()
