"""Where a worker's CPU goes while it drains no-op jobs: py-spy on every worker process.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/jobs_bench python bench/profile_drain.py

Starts ``run_jobs`` (``--processes`` x ``--threads``), waits for its workers to register,
bulk-enqueues ``--jobs`` no-op jobs, samples each worker process with ``py-spy record
--gil`` (the thread holding the GIL only: Python's CPU, not its waits) until every job has
succeeded, stops everything, and prints the share of the samples each function holds,
inclusive and on its own, and each module's own share. Figures are printed, not asserted.

py-spy is not a dependency of the project (``pip install py-spy``; it attaches to a
running process by ptrace, so it may need root or ``kernel.yama.ptrace_scope=0``). The
database's name must contain "bench": its job tables are emptied before and after.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.tasks import task_backends  # noqa: E402

from bench.tables import empty, refuse_unless_named, tables_of  # noqa: E402
from bench.tasks import noop, noop_keyed, noop_rated  # noqa: E402
from django_jobs.models import Job, JobStatus, Process  # noqa: E402

START_TIMEOUT = 60.0
KEYS = 1_000
# The calls each kind of drain enqueues, for a number of jobs.
KINDS = {
    "plain": lambda jobs: [(noop, (), {})] * jobs,
    "keyed": lambda jobs: [(noop_keyed, (), {"key": n % KEYS}) for n in range(jobs)],
    "rated": lambda jobs: [(noop_rated, (), {"key": n % KEYS}) for n in range(jobs)],
}
# A frame as py-spy's raw format writes it: "function (path:line)".
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^:]*):(?P<line>\d+)\)$")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="no-op jobs to drain (20,000)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker (8)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (200)")
    parser.add_argument("--top", type=int, default=30, help="functions printed per list (30)")
    parser.add_argument(
        "--kind",
        choices=sorted(KINDS),
        default="plain",
        help="plain no-op jobs, or each under one of 1,000 keys: a concurrency limit of 1 "
        "(keyed) or a rate limit that never binds (rated); as bench/throughput.py's phases",
    )
    return parser.parse_args()


def py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    return found


def empty_job_tables() -> None:
    empty(tables_of("django_jobs"))


def wait_for(what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def drain_sampled(options: argparse.Namespace, spy: str, out: Path) -> tuple[float, list[Path]]:
    """Run the drain under py-spy; returns its seconds and the raw sample files."""
    command = [sys.executable, str(ROOT / "testproject" / "manage.py"), "run_jobs"]
    command += ["--processes", str(options.processes), "--threads", str(options.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(out / "run_jobs.log", "wb") as log:
        workers = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    spies: list[subprocess.Popen] = []
    try:
        kind = Process.Kind.WORKER
        registered = lambda: Process.objects.filter(kind=kind).count() >= options.processes  # noqa: E731
        wait_for("run_jobs' workers to register", registered, START_TIMEOUT)
        pids = list(Process.objects.filter(kind=kind).values_list("pid", flat=True))
        task_backends["default"].bulk_enqueue(KINDS[options.kind](options.jobs))
        began = time.perf_counter()
        files = [out / f"worker-{pid}.txt" for pid in pids]
        for pid, path in zip(pids, files, strict=True):
            spy_command = [spy, "record", "--gil", "--nonblocking", "-r", str(options.rate)]
            spy_command += ["-f", "raw", "-o", str(path), "-p", str(pid)]
            spies.append(
                subprocess.Popen(spy_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        done = Job.objects.filter(status=JobStatus.SUCCEEDED)
        wait_for("the drain", lambda: done.count() >= options.jobs, 600.0)
        seconds = time.perf_counter() - began
    finally:
        for process in spies:
            process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for process in spies:
            process.wait(30)
        os.killpg(workers.pid, signal.SIGTERM)
        workers.wait(60)
    return seconds, files


def shares(
    files: list[Path],
) -> tuple[int, collections.Counter, collections.Counter, collections.Counter]:
    """Samples in all, and per function: inclusive, own; per module: own."""
    total = 0
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    modules: collections.Counter = collections.Counter()
    for path in files:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue  # not a sample: py-spy writes a warning into the file at times
            samples = int(count)
            frames = [f for f in stack.split(";") if FRAME.match(f)]
            total += samples
            if not frames:
                continue
            for frame in set(frames):
                inclusive[frame] += samples
            own[frames[-1]] += samples
            modules[module_of(frames[-1])] += samples
    return total, inclusive, own, modules


def module_of(frame: str) -> str:
    match = FRAME.match(frame)
    path = match.group("path") if match else frame
    path = re.sub(r".*site-packages/", "", path)
    path = re.sub(rf"^{re.escape(str(ROOT))}/", "", path)
    path = re.sub(r".*/lib/python3\.\d+/", "stdlib/", path)
    return "/".join(path.split("/")[:2])


def main() -> int:
    options = parse_args()
    spy = py_spy()
    refuse_unless_named()  # before the migration: a database not named so is left alone
    call_command("migrate", verbosity=0)
    empty_job_tables()
    with tempfile.TemporaryDirectory(prefix="profile-drain-") as folder:
        seconds, files = drain_sampled(options, spy, Path(folder))
        total, inclusive, own, modules = shares([f for f in files if f.exists()])
    empty_job_tables()
    print(
        f"{options.jobs:,} no-op jobs ({options.kind}) drained in {seconds:.2f} s by "
        f"{options.processes} x "
        f"{options.threads} threads; {total:,} samples of the GIL holder at {options.rate}/s"
    )
    if not total:
        return 1
    for title, counter in (
        ("own time, by module", modules),
        ("own time, by function", own),
        ("inclusive, by function", inclusive),
    ):
        print(f"\n{title}")
        for name, samples in counter.most_common(options.top):
            print(f"{100 * samples / total:6.1f}%  {name[:140]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
