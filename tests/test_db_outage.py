"""The database goes away under a running worker, for longer than the alive threshold.

The worker talks to the database through a TCP proxy on 127.0.0.1 that the test
cuts (every connection dropped, new ones refused) and later restores; the test
itself talks to the database directly. Meaningless on SQLite (a file, no server).
"""

from __future__ import annotations

import signal
import threading
from importlib import import_module

import pytest
from django.db import OperationalError, connection, connections
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core.processes import register_process
from django_jobs.core.ready import claim_jobs
from django_jobs.models import ClaimedExecution, JobStatus, Process
from django_jobs.runtime.lifecycle import Lifecycle
from django_jobs.runtime.worker import Worker
from tests import batch_tasks, tasks
from tests.harness import database_url, error_paths, job_row, runs_of, wait_until
from tests.proxy import CuttableProxy

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

ALIVE_THRESHOLD = 3.0  # harness FAST_ENV


@pytest.fixture
def proxy():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite is a file: there is no database server to lose")
    settings = connection.settings_dict
    port = settings.get("PORT") or (5432 if connection.vendor == "postgresql" else 3306)
    proxy = CuttableProxy(settings.get("HOST") or "127.0.0.1", int(port))
    yield proxy
    proxy.close()


@pytest.mark.parametrize(
    "mode",
    [["--processes", "1", "--threads", "2"], ["--single-process", "--threads", "2"]],
    ids=["supervisor", "single-process"],
)
def test_the_worker_rides_out_a_database_outage(run_jobs, proxy, tmp_path, mode):
    log, marker = tmp_path / "runs", tmp_path / "started"
    running = tasks.record_run.enqueue(str(log), "running", 1.0, str(marker))
    proc = run_jobs(*mode, env={"DATABASE_URL": database_url(port=proxy.port)})
    wait_until(marker.exists, what="the job started")
    expected = 1 if "--single-process" in mode else 3  # (supervisor, worker, dispatcher)
    wait_until(lambda: Process.objects.count() == expected, what="every process registered")
    before = dict(Process.objects.values_list("pk", "pid"))

    proxy.cut()
    # Whatever the worker sent before the cut has run: nothing it sent can claim these.
    proxy.wait_for_the_server_to_let_go(connection)
    during = [tasks.add.enqueue(20, i) for i in range(3)]  # straight to the database
    # The job ends while the database is away: its outcome must wait, not be lost.
    proc.wait_for_output(f"database unavailable during finishing job {running.id}")
    # Longer than the alive threshold: every heartbeat is stale when it comes back,
    # and nobody may take that for death.
    wait_until(
        lambda: all(
            (timezone.now() - beat).total_seconds() > ALIVE_THRESHOLD + 0.5
            for beat in Process.objects.values_list("last_heartbeat_at", flat=True)
        ),
        15,
        what="every heartbeat older than the alive threshold",
    )
    assert job_row(running).status == JobStatus.RUNNING
    assert all(job_row(r).status == JobStatus.READY for r in during)
    proxy.restore()

    wait_until(
        lambda: all(job_row(r).status == JobStatus.SUCCEEDED for r in [running, *during]),
        30,
        what="the running job and the ones enqueued during the outage done",
    )
    job = job_row(running)
    assert (job.attempts, job.return_value) == (1, "running"), proc.output()
    assert error_paths(running) == [], proc.output()  # recorded once, as a success
    assert runs_of(log) == ["running"]
    assert [job_row(r).return_value for r in during] == [20, 21, 22]
    # Same processes as before the outage: none pruned as dead, none replaced.
    assert dict(Process.objects.values_list("pk", "pid")) == before, proc.output()
    assert "pruned dead process" not in proc.output()
    assert "was pruned; stopping" not in proc.output()

    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    assert ClaimedExecution.objects.count() == 0
    assert Process.objects.count() == 0


def lose_the_answer_once(real, then=None):
    """``real`` commits, then the first call reports a lost connection anyway, as when
    the connection drops after the server committed but before the client heard so.
    ``lost`` says whether that happened; ``then`` runs just before the error."""
    lost = []

    def wrapper(*args, **kwargs):
        value = real(*args, **kwargs)
        if not lost:
            lost.append(True)
            if then is not None:
                then()
            raise OperationalError("server closed the connection unexpectedly (simulated)")
        return value

    return wrapper, lost


def worker_once(**options) -> Worker:
    conf = JobsSettings.load(threads=1, polling_interval=0.01, db_retry_max_delay=0.05, **options)
    process = register_process(conf.database, Process.Kind.WORKER)
    return Worker(conf, process.pk, process.name, Lifecycle(), once=True)


def run_to_the_end(worker: Worker) -> None:
    def run() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    drained = not thread.is_alive()
    if not drained:
        worker.lifecycle.request_immediate("test timed out")
        thread.join(5)
    assert drained, "the worker never ended (a claim left stranded?)"


@pytest.mark.parametrize(
    ("target", "task", "args"),
    [
        ("django_jobs.runtime.worker.claim_jobs", tasks.add, (1, 2)),
        # A job that the claim does not start (it lets go of its unique key as it starts):
        # its start is the start transaction's, whose answer is lost here.
        ("django_jobs.runtime.executor.start_jobs", batch_tasks.unique_while_waiting, (3,)),
    ],
)
def test_a_commit_whose_answer_was_lost_is_neither_stranded_nor_counted_twice(
    monkeypatch, target, task, args
):
    """The one outage a proxy cannot time: between the server's COMMIT and the reply.

    A lost claim would stay claimed by a live worker forever (no one recovers a live
    process's claims); a repeated start would count one run as two attempts.
    """
    result = task.enqueue(*args)
    module, name = target.rsplit(".", 1)
    wrapper, lost = lose_the_answer_once(getattr(import_module(module), name))
    monkeypatch.setattr(target, wrapper)
    run_to_the_end(worker_once())
    assert lost, "the commit's answer was never lost: nothing was tested"
    job = job_row(result)
    assert (job.status, job.attempts, job.return_value) == (JobStatus.SUCCEEDED, 1, 3)
    assert error_paths(result) == []
    assert not ClaimedExecution.objects.exists()


def test_a_claim_whose_answer_was_lost_then_a_stop_costs_no_attempt(monkeypatch):
    """The claim (which starts its jobs) commits, its answer is lost, and a stop comes
    before the next claim could hand the jobs back: the stop hands them back. Left to
    recovery, each would count as a failed attempt of a body that never ran."""
    result = tasks.add.enqueue(1, 2)
    worker = worker_once()
    wrapper, lost = lose_the_answer_once(
        claim_jobs, then=lambda: worker.lifecycle.request_stop("test")
    )
    monkeypatch.setattr("django_jobs.runtime.worker.claim_jobs", wrapper)
    run_to_the_end(worker)
    assert lost
    job = job_row(result)
    assert (job.status, job.attempts, job.worker_ids) == (JobStatus.READY, 0, [])
    assert error_paths(result) == []
    assert not ClaimedExecution.objects.exists()
