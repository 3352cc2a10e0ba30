"""The heartbeat thread against the deregistration of its own process at a graceful stop.

``registered()`` stops the heartbeat, then deletes the process row. A beat already on
its way finds the row gone; that is this process's own doing, not a prune, and must
not make ``run_jobs`` exit 1 (CI saw it: a graceful stop after a stress run ended with
"process row 442 was pruned; stopping" and exit code 1).
"""

from __future__ import annotations

import threading

import pytest

from django_jobs.core import processes
from django_jobs.core.processes import deregister_process, register_process
from django_jobs.models import Process
from django_jobs.runtime import heartbeat as heartbeat_module
from django_jobs.runtime.heartbeat import Heartbeat
from django_jobs.runtime.lifecycle import Lifecycle

pytestmark = pytest.mark.django_db(transaction=True)

DB = "default"


def beat_held_until_released(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the next beat wait, once entered, until released; return (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = processes.heartbeat

    def held(db: str, process_id: int) -> bool:
        if not release.is_set():
            entered.set()
            assert release.wait(10), "the test never released the beat"
        return real(db, process_id)

    monkeypatch.setattr(heartbeat_module, "heartbeat", held)
    return entered, release


def beat_meeting(monkeypatch, meanwhile) -> tuple[Process, Lifecycle]:
    """Start a heartbeat, hold its first beat inside the call, run ``meanwhile(beat,
    process)``, then let the beat go on and wait for the thread to end."""
    process = register_process(DB, Process.Kind.WORKER)
    lifecycle = Lifecycle()
    entered, release = beat_held_until_released(monkeypatch)
    beat = Heartbeat(DB, process.pk, 0.01, lifecycle)
    beat.start()
    assert entered.wait(10), "no beat came"
    meanwhile(beat, process)
    release.set()  # the beat that was on its way now finds no row
    beat.join(10)
    assert not beat.is_alive()
    return process, lifecycle


def test_a_beat_that_finds_its_row_deregistered_at_a_stop_is_not_a_prune(monkeypatch):
    def stop_then_deregister(beat: Heartbeat, process: Process) -> None:
        beat.stop()  # as registered() does on the way out, then:
        deregister_process(DB, process.pk, "stopped")

    process, lifecycle = beat_meeting(monkeypatch, stop_then_deregister)
    assert not Process.objects.filter(pk=process.pk).exists()
    assert lifecycle.pruned is False
    assert not lifecycle.stopping.is_set()


def test_a_beat_that_finds_its_row_pruned_while_running_stops_the_process(monkeypatch):
    """The twin: not stopping, row deleted by someone else: a prune, reported."""

    def prune(beat: Heartbeat, process: Process) -> None:
        Process.objects.filter(pk=process.pk).delete()  # as a dispatcher's prune does

    _, lifecycle = beat_meeting(monkeypatch, prune)
    assert lifecycle.pruned is True
    assert lifecycle.stopping.is_set()
