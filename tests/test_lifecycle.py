"""Signals reach a process whose main thread is busy inside ``threading.Event`` calls.

A Python signal handler that sets an Event can run while the main thread holds
that Event's internal lock (inside ``Event.wait``) and then waits for it forever.
The child below spins on ``Event.wait(0)``; with a handler that sets the Event
itself, about one run in ten hung for good (measured: 6 of 60). Each of 40 runs
must stop, gracefully on the first SIGTERM and at once on the second, as
``run_jobs`` does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import sys
    from django_jobs.runtime.lifecycle import Lifecycle

    lifecycle = Lifecycle()
    lifecycle.install_signal_handlers()
    print("ready", flush=True)
    while not lifecycle.stopping.is_set():
        lifecycle.immediate.wait(0)
    print("graceful", flush=True)
    while not lifecycle.immediate.is_set():
        lifecycle.immediate.wait(0)
    print("immediate", flush=True)
    """
)


@pytest.mark.parametrize("round_", range(40))
def test_two_sigterms_stop_a_process_busy_in_event_waits(round_):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "graceful"
        child.send_signal(signal.SIGTERM)
        assert child.wait(10) == 0
        assert child.stdout.read().strip() == "immediate"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
            pytest.fail(f"deadlocked on a signal; stderr: {child.stderr.read()}")
