"""Children forked from the warm parent (runtime/warm.py): real ``run_jobs``, no mocks.

The supervisor forks the warm parent before it opens connections or starts
threads; every worker and the dispatcher are forks of it, sharing its Django
pages copy-on-write, and stay separate processes: a killed one is replaced
and the supervisor stays up.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from django_jobs.models import Job, JobStatus, Process
from tests import tasks
from tests.harness import child_pids, pid_alive, wait_until

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def smaps_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def children_registered(workers: int) -> bool:
    kinds = list(Process.objects.values_list("kind", flat=True))
    return kinds.count(Process.Kind.WORKER) == workers and Process.Kind.DISPATCHER in kinds


def runs(result) -> Job:
    wait_until(
        lambda: Job.objects.get(pk=int(result.id)).status == JobStatus.SUCCEEDED,
        30,
        what=f"job {result.id} to succeed",
    )
    return Job.objects.get(pk=int(result.id))


def test_children_are_forks_of_the_warm_parent_and_a_killed_one_is_replaced(run_jobs):
    proc = run_jobs("--processes", "2", "--threads", "1")
    wait_until(lambda: children_registered(2), 30, what="two workers and a dispatcher")

    # The supervisor's one child is the warm parent: a fork of the supervisor (same
    # command line, not a fresh interpreter) that is registered as nothing.
    (warm,) = child_pids(proc.pid)
    registered = dict(Process.objects.exclude(kind="supervisor").values_list("pid", "kind"))
    assert warm not in registered
    cmdline = Path(f"/proc/{warm}/cmdline").read_bytes()
    assert cmdline == Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert b"run_jobs" in cmdline
    assert sorted(child_pids(warm)) == sorted(registered)
    for pid in registered:
        assert ppid(pid) == warm
        # Django was set up before the fork: the heap written by the supervisor before
        # it forked is still shared by the child (a fresh interpreter shares none of it).
        assert smaps_kb(pid, "Shared_Dirty") > 10 * 1024, (pid, proc.output())

    job = runs(tasks.add.enqueue(2, 3))
    worker = Process.objects.get(name=job.worker_ids[-1])
    assert ppid(worker.pid) == warm and job.return_value == 5

    supervisor = Process.objects.get(kind="supervisor")
    os.kill(worker.pid, signal.SIGKILL)
    wait_until(
        lambda: (
            children_registered(2)
            and not Process.objects.filter(pid=worker.pid, kind="worker").exists()
        ),
        30,
        what="a replacement worker",
    )
    replacement = Process.objects.exclude(pk__in=[supervisor.pk]).filter(kind="worker")
    for row in replacement:
        assert ppid(row.pid) == warm  # forked from the same warm parent
        assert smaps_kb(row.pid, "Shared_Dirty") > 10 * 1024
    proc.wait_for_output(f"worker process {worker.pid} exited unexpectedly (code -9)")
    assert pid_alive(proc.pid) and Process.objects.get(kind="supervisor").pk == supervisor.pk
    assert runs(tasks.add.enqueue(4, 4)).return_value == 8

    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
    assert not pid_alive(warm)


def test_without_its_warm_parent_the_supervisor_starts_fresh_children(run_jobs):
    proc = run_jobs("--processes", "1", "--threads", "1")
    wait_until(lambda: children_registered(1), 30, what="a worker and a dispatcher")
    (warm,) = child_pids(proc.pid)
    before = set(Process.objects.exclude(kind="supervisor").values_list("pid", flat=True))

    os.kill(warm, signal.SIGKILL)
    # Orphaned, the children stop; the supervisor starts fresh interpreters instead.
    wait_until(
        lambda: (
            children_registered(1)
            and not before & set(Process.objects.values_list("pid", flat=True))
        ),
        40,
        what="fresh children",
    )
    proc.wait_for_output("the warm parent is gone")
    for pid in Process.objects.exclude(kind="supervisor").values_list("pid", flat=True):
        assert ppid(pid) == proc.pid
    assert runs(tasks.add.enqueue(1, 1)).return_value == 2

    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
