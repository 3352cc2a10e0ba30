"""The warm parent: a fork of the supervisor that forks its children, so they share its memory.

A fresh interpreter per child (``multiprocessing`` spawn) costs every child a
whole Django of its own: about 60 MB each, most of it the same modules and
settings. Forking the supervisor itself would share all of that, but the
supervisor holds database connections and threads (heartbeat, ready check,
signals) that a fork must never inherit: a connection used from two processes
corrupts its protocol stream, and a lock held by a thread that does not exist
in the child never comes free.

So the supervisor forks once, at its very start, before it registers: its
connections closed (an app's ``ready()``, the start's prune and checks may
have opened some), the modules a child needs imported, and ``gc.freeze()``
called so that no collection in a child writes to the shared objects' pages.
That fork, the warm parent, starts no thread and opens no connection; it only
waits for the supervisor's requests, forks a child for each, and reports the
child's pid and exit code back through a pipe per child, the way
``multiprocessing``'s forkserver does (whose own server is a fresh interpreter
of its own, and comes with its resource-tracker process). A child therefore
starts from the same clean state every time, including a recycled worker's
replacement, and shares the supervisor's pages copy-on-write: the memory
``run_jobs`` takes is about one Django plus what each process makes its own.

The warm parent ignores the stop signals: the supervisor asks the children to
stop, and the warm parent exits when the supervisor closes its socket (or
dies), after which a child still running notices that its parent changed and
stops. Should the warm parent die anyway, the supervisor starts further
children as fresh interpreters (:class:`Spawned`), as it did before.
"""

from __future__ import annotations

import errno
import gc
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any

from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.supervisor")

NUMBER = struct.Struct("q")  # a pid, an exit code, a request's length
MAX_FDS = 2  # the status pipe's write end and, for a worker, its wake pipe's read end
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1)


class WarmParentGone(Exception):
    """The warm parent did not answer: start children some other way."""


class Forked:
    """A child forked by the warm parent, seen from the supervisor: what
    ``multiprocessing.Process`` offers the supervisor (pid, sentinel, exit code)."""

    def __init__(self, pid: int, status: int) -> None:
        self.pid = pid
        self.sentinel = status  # readable once the exit code is written, or the parent is gone
        self.exitcode: int | None = None
        self.orphaned = False  # the warm parent died first: no exit code will come

    def _poll(self, timeout: float | None) -> bool:
        """True once the process is known to have exited."""
        if self.exitcode is not None:
            return True
        if not self.orphaned:
            if not wait([self.sentinel], timeout):
                return False
            data = read_exactly(self.sentinel, NUMBER.size)
            if data is not None:
                self.exitcode = NUMBER.unpack(data)[0]
                return True
            self.orphaned = True
        # Reparented (to init, which reaps it): exited once its pid is gone.
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while pid_exists(self.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        self.exitcode = 1  # unknown: counted as a crash
        return True

    def join(self, timeout: float | None = None) -> None:
        self._poll(timeout)

    def is_alive(self) -> bool:
        return not self._poll(0)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        os.close(self.sentinel)


class WarmParent:
    """The supervisor's handle on its warm parent (see the module docstring)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        """Fork the warm parent. Call before the supervisor opens connections of its own."""
        prepare_to_fork()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with warnings.catch_warnings():
            # Python warns about forking a process with threads; the supervisor's signal
            # watcher, blocked in a read, holds no lock a fork could inherit.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                serve(theirs)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        gc.unfreeze()  # the supervisor itself collects as before
        self.pid, self.sock = pid, ours
        logger.debug("warm parent started: pid %d", pid)

    def fork(self, args: tuple[Any, ...], wake: Connection | None) -> Forked:
        """A child running ``entry.child_main(*args, wake)``; WarmParentGone if it cannot."""
        if self.sock is None:
            raise WarmParentGone("not running")
        status_r, status_w = os.pipe()
        fds = [status_w] if wake is None else [status_w, wake.fileno()]
        payload = pickle.dumps(args)
        try:
            with self.lock:
                socket.send_fds(self.sock, [NUMBER.pack(len(payload))], fds)
                self.sock.sendall(payload)
        except OSError as exc:
            os.close(status_r)
            raise self.gone(str(exc)) from exc
        finally:
            os.close(status_w)
        data = read_exactly(status_r, NUMBER.size)
        if data is None:
            os.close(status_r)
            raise self.gone("it closed the child's status pipe")
        return Forked(NUMBER.unpack(data)[0], status_r)

    def gone(self, why: str) -> WarmParentGone:
        logger.warning("the warm parent is gone (%s); children start afresh from now on", why)
        self.close()
        return WarmParentGone(why)

    def close(self) -> None:
        """Let it go: it exits once the socket closes."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.pid is not None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.pid = None


def prepare_to_fork() -> None:
    """What every child needs, imported and settled in the supervisor before the fork."""
    from django.db import connections

    import django_jobs.runtime.child  # noqa: F401  (the workers' modules, shared from here)

    for conn in connections.all(initialized_only=True):
        conn.close()
        close_pool = getattr(conn, "close_pool", None)
        if close_pool is not None and getattr(conn, "pool", None) is not None:
            close_pool()  # a pool's sockets and threads must not be shared either
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    gc.freeze()


def serve(sock: socket.socket) -> None:
    """The warm parent's loop: fork a child per request, report its pid and exit code."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, int] = {}  # child pid -> write end of its status pipe
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(sig_r, selectors.EVENT_READ)
        while True:
            ready = [key.fileobj for key, _ in selector.select()]
            if sig_r in ready:
                drain_pipe(sig_r)
                reap(statuses)
            if sock in ready:
                request = receive(sock)
                if request is None:
                    return  # the supervisor closed its end, or died
                args, fds = request
                status_w, wake = fds[0], (fds[1] if len(fds) > 1 else None)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    sock.close()
                    run_forked(args, wake, [sig_r, sig_w, status_w, *statuses.values()])
                if wake is not None:
                    os.close(wake)
                try:
                    os.write(status_w, NUMBER.pack(pid))
                except BrokenPipeError:
                    pass  # the supervisor let go of it: still reaped below
                statuses[pid] = status_w


def run_forked(args: tuple[Any, ...], wake: int | None, inherited: list[int]) -> None:
    """A fresh child of the warm parent: its signals back to default, its fds dropped."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for signum in (*STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        from django_jobs.runtime.entry import child_main

        kind, overrides, supervisor_id, verbosity = args
        conn = Connection(wake, writable=False) if wake is not None else None
        child_main(kind, overrides, supervisor_id, verbosity, conn)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status_w = statuses.pop(pid, None)
        if status_w is None:
            continue
        try:
            os.write(status_w, NUMBER.pack(os.waitstatus_to_exitcode(status)))
        except BrokenPipeError:
            pass
        os.close(status_w)


def receive(sock: socket.socket) -> tuple[tuple[Any, ...], list[int]] | None:
    """One request: the child's arguments and the fds that came with them; None at EOF."""
    try:
        header, fds, _, _ = socket.recv_fds(sock, NUMBER.size, MAX_FDS)
    except ConnectionResetError:
        return None
    if not header:
        return None
    header += recv_exactly(sock, NUMBER.size - len(header))
    payload = recv_exactly(sock, NUMBER.unpack(header)[0])
    return pickle.loads(payload), fds


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the supervisor closed its socket mid-request")
        data += chunk
    return data


def read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from a pipe, None at EOF."""
    data = b""
    while len(data) < size:
        try:
            chunk = os.read(fd, size - len(data))
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            raise
        if not chunk:
            return None
        data += chunk
    return data


def drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
