"""A TCP proxy on 127.0.0.1 that a test can cut, to take the database away from a worker."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    """Forwards connections to ``upstream``; ``cut()`` drops them all and refuses new ones."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
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
                self.sockets += [client, server]
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

    def restore(self) -> None:
        self.refusing = False

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()
