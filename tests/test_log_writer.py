"""``BufferedStreamHandler``: run_jobs' lines written by a thread of their own, in batches.

What must hold whatever the threads do: every line written once, whole, in the
order each thread logged it; a stream that fails or stalls costs lines of the
log, never a thread that logs; a forked child writes its own lines, not its
parent's; every way out of a process writes what is left.
"""

from __future__ import annotations

import io
import logging
import os
import threading

import pytest

from django_jobs.runtime.logs import BufferedStreamHandler, flush_buffered_lines
from tests.harness import wait_until


class Recorder(io.StringIO):
    """A stream that counts its writes and flushes, and can refuse or hold a write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.flushes = 0
        self.refuse = 0
        self.entered = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def write(self, text: str) -> int:
        self.entered.set()
        self.hold.wait()
        if self.refuse:
            self.refuse -= 1
            raise OSError("the stream refused the write")
        self.writes += 1
        return super().write(text)

    def flush(self) -> None:
        self.flushes += 1


@pytest.fixture
def make_logger():
    made: list[tuple[logging.Logger, BufferedStreamHandler]] = []

    def make(stream, **options) -> tuple[logging.Logger, BufferedStreamHandler]:
        logger = logging.getLogger(f"tests.log_writer.{len(made)}.{id(stream)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        handler = BufferedStreamHandler(stream, **options)
        handler.setFormatter(logging.Formatter("%(threadName)s %(message)s"))
        logger.addHandler(handler)
        made.append((logger, handler))
        return logger, handler

    yield make
    for logger, handler in made:
        logger.removeHandler(handler)
        handler.close()


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_lines_of_many_threads_are_each_written_once_whole_and_in_order(make_logger):
    stream = Recorder()
    logger, _handler = make_logger(stream, interval=0.01)
    threads, per_thread = 8, 2_000
    start = threading.Barrier(threads)

    def log_lines(number: int) -> None:
        start.wait()
        for index in range(per_thread):
            logger.info("line %d of %d", index, number)

    workers = [threading.Thread(target=log_lines, args=(n,), name=f"t{n}") for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    # Written by the writer thread, no flush asked for.
    wait_until(lambda: len(lines_of(stream)) == threads * per_thread, 10, what="every line")
    seen: dict[str, list[int]] = {f"t{n}": [] for n in range(threads)}
    for line in lines_of(stream):
        name, _, index, _, number = line.split(" ")
        assert name == f"t{number}", line
        seen[name].append(int(index))
    assert all(indexes == list(range(per_thread)) for indexes in seen.values())
    # In batches: far fewer writes than lines.
    assert stream.writes < threads * per_thread / 10


def test_a_line_after_a_quiet_spell_is_written_at_once_the_next_ones_wait(make_logger):
    stream = Recorder()
    logger, handler = make_logger(stream, interval=3600)
    logger.info("first")
    wait_until(lambda: lines_of(stream) == ["MainThread first"], 5, what="the first line")
    logger.info("second")
    assert lines_of(stream) == ["MainThread first"]  # the writer sleeps out its interval
    handler.flush()
    assert lines_of(stream) == ["MainThread first", "MainThread second"]
    logger.info("third")
    handler.close()
    assert lines_of(stream) == ["MainThread first", "MainThread second", "MainThread third"]
    logger.info("after close")  # as StreamHandler does: written at once
    assert lines_of(stream)[-1] == "MainThread after close"


def test_past_max_lines_the_thread_that_logs_writes_them_itself(make_logger):
    stream = Recorder()
    logger, _handler = make_logger(stream, interval=3600, max_lines=3)
    logger.info("first")  # written at once: the writer then sleeps for an hour
    wait_until(lambda: stream.writes == 1, 5, what="the first line")
    for index in range(3):
        logger.info("held %d", index)
    assert stream.writes == 1
    logger.info("one too many")
    assert len(lines_of(stream)) == 5 and stream.writes == 2


def test_a_stream_that_refuses_a_write_loses_that_batch_not_the_writer(make_logger, capsys):
    stream = Recorder()
    logger, handler = make_logger(stream, interval=0.01)
    stream.refuse = 1
    logger.info("lost")
    wait_until(lambda: stream.refuse == 0, 5, what="the refused write")
    assert "1 line(s) not written" in capsys.readouterr().err
    logger.info("kept")
    wait_until(lambda: lines_of(stream) == ["MainThread kept"], 5, what="the next line")
    assert handler.writer is not None and handler.writer.is_alive()


def test_a_stalled_stream_never_stalls_the_threads_that_log(make_logger):
    stream = Recorder()
    logger, _handler = make_logger(stream, interval=0.0)
    stream.hold.clear()
    logger.info("stuck in the write")
    assert stream.entered.wait(5)  # the writer is blocked in write(), holding the lock
    for index in range(100):
        logger.info("logged meanwhile %d", index)  # returns: nothing waits for the writer
    stream.hold.set()
    wait_until(lambda: len(lines_of(stream)) == 101, 5, what="the held lines")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_writes_its_own_lines_not_its_parents(make_logger, tmp_path):
    path = tmp_path / "log"
    with open(path, "w", buffering=1) as stream:
        logger, handler = make_logger(stream, interval=3600)
        logger.info("parent first")  # written at once: the writer then sleeps for an hour
        wait_until(lambda: path.read_text() == "MainThread parent first\n", 5, what="it")
        # The line shows in the file before the writer's flush returns (the stream is
        # line-buffered): the fork below waits for that flush (the next test forces it).
        logger.info("parent before the fork")  # held
        pid = os.fork()
        if pid == 0:  # the child: exits as run_jobs' children exit at a second signal
            try:
                logger.info("child")
                flush_buffered_lines()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert path.read_text().splitlines() == ["MainThread parent first", "MainThread child"]
        handler.flush()
    assert path.read_text().splitlines() == [
        "MainThread parent first",
        "MainThread child",
        "MainThread parent before the fork",
    ]


class LockingStream(io.StringIO):
    """A stream that holds a lock of its own inside every write, as a file's buffered
    writer does; a write can be held there."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = threading.Lock()
        self.entered = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def write(self, text: str) -> int:
        with self.inner:
            self.entered.set()
            self.hold.wait()
            return super().write(text)


class WatchedLock:
    """A handler's lock that tells when one given thread asks for it."""

    def __init__(self, lock, thread_id: int) -> None:
        self.lock = lock
        self.thread_id = thread_id
        self.asked = threading.Event()

    def acquire(self, *args, **kwargs) -> bool:
        if threading.get_ident() == self.thread_id:
            self.asked.set()
        return self.lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _at_fork_reinit(self) -> None:  # what logging's own fork hook calls in a child
        self.lock._at_fork_reinit()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_fork_waits_for_the_write_under_way_so_the_child_can_write(make_logger):
    """run_jobs' warm parent is a fork of the supervisor, whose writer may be inside a
    write right then; the child must not get the stream's lock held by a thread it lacks."""
    stream = LockingStream()
    logger, handler = make_logger(stream, interval=0.0)
    stream.hold.clear()
    logger.info("under way at the fork")
    assert stream.entered.wait(5)  # the writer is inside write(), holding the stream's lock
    watched = WatchedLock(handler.lock, threading.get_ident())
    handler.lock = watched
    # The write ends once the fork asks for the handler's lock. A fork that never asks
    # goes on at once, with the stream's lock held by the writer.
    releaser = threading.Thread(target=lambda: (watched.asked.wait(5), stream.hold.set()))
    releaser.start()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 3 if stream.inner.locked() else 0
        finally:
            os._exit(code)
    releaser.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child got the stream's lock held"
    assert watched.asked.is_set()
    logger.info("after the fork")  # the parent's writer and lock carry on
    both = ["MainThread under way at the fork", "MainThread after the fork"]
    wait_until(lambda: lines_of(stream) == both, 5, what="both lines")


def test_a_failing_report_of_a_failed_write_does_not_end_the_writer(make_logger, monkeypatch):
    stream = Recorder()
    logger, handler = make_logger(stream, interval=0.01)
    broken = Recorder()
    broken.refuse = 10**6  # stderr refuses every write too
    monkeypatch.setattr("sys.stderr", broken)
    stream.refuse = 1
    logger.info("lost")
    wait_until(lambda: stream.refuse == 0, 5, what="the refused write")
    logger.info("kept")
    wait_until(lambda: lines_of(stream) == ["MainThread kept"], 5, what="the next line")
    assert handler.writer is not None and handler.writer.is_alive()
