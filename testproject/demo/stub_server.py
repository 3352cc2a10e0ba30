"""The demo's stand-in for a slow web service: a local HTTP server that answers every GET
after a delay, for the async step of the tour (``manage.py demo``).

The point of that step is jobs that spend their time waiting on the network, so the
demo needs something to wait on that is always there and takes a known time: no network
beyond 127.0.0.1, a port the OS picks (two demos at once never collide), and nothing
installed. It runs on an asyncio event loop of its own in a daemon thread, so that it
holds any number of requests at once (a thread per request would make the server, not
the worker, the thing being measured), and it counts the most it held at once: the
server's own view of how many fetches overlapped.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import TracebackType

# Far above the demo's fan-out: connections that arrive together are all accepted at
# once, none left to the kernel's retry of a SYN a full queue dropped (a second or more).
BACKLOG = 1024
# The most a request may send before its blank line: a GET from the demo's task is ~100 B.
MAX_REQUEST_HEAD = 8 * 1024


class SlowServer:
    """``with SlowServer(delay=1.0) as server: server.url("/item/1")``: answers each GET
    with ``200`` and a small JSON body ``delay`` seconds after it has read the request."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.port = 0
        self.in_flight = 0
        self.peak = 0
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.run, name="demo-stub-server", daemon=True)

    def __enter__(self) -> SlowServer:
        self.thread.start()
        self.ready.wait(10)
        if self.error is not None:
            raise RuntimeError(f"the demo's stub server did not start: {self.error}")
        if not self.port:
            raise RuntimeError("the demo's stub server did not start within 10 s")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def run(self) -> None:
        try:
            asyncio.run(self.serve())
        except BaseException as exc:  # reported by __enter__ if it happens before ready
            self.error = exc
            self.ready.set()

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        server = await asyncio.start_server(
            self.answer, "127.0.0.1", 0, backlog=BACKLOG, limit=MAX_REQUEST_HEAD
        )
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        try:
            await self.stopping.wait()
        finally:
            # Not ``wait_closed()``: it would wait for every open connection. The requests
            # still being answered are cancelled when asyncio.run() ends the loop.
            server.close()

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, _, rest = request_line.partition(" ")
            path = rest.partition(" ")[0]
            await asyncio.sleep(self.delay)
            if method == "GET":
                status = "200 OK"
                body = json.dumps({"path": path, "waited": self.delay}).encode()
            else:
                status, body = "405 Method Not Allowed", b""
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1")
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that went away or sent no request: nothing to answer
        finally:
            self.in_flight -= 1
            writer.close()

    def stop(self) -> None:
        """Stop listening and end the thread (waits up to 5 s)."""
        if self.loop is not None and self.stopping is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.stopping.set)
            except RuntimeError:  # the loop closed in between
                pass
        self.thread.join(5)
