"""Where a worker's CPU goes while it drains jobs: py-spy on every worker process.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/jobs_bench python bench/profile_drain.py
    DATABASE_URL=... python bench/profile_drain.py --kind async --jobs 10000

Starts ``run_jobs`` (``--processes`` x ``--threads``), waits for its workers to register,
bulk-enqueues ``--jobs`` no-op jobs (``--kind async``: ``async def`` jobs that await
``asyncio.sleep(0.2)``, phase async's of bench/throughput.py, on the settings' threads and
event loop unless ``--threads`` says otherwise), samples each worker process with ``py-spy
record --gil`` (the thread holding the GIL only: Python's CPU, not its waits) until every
job has succeeded, stops everything, and prints the share of the samples each function
holds, inclusive and on its own, and each module's own share; then the same samples as
milliseconds of GIL per job by step of a job's life (claim, start, body, outcome, finish,
the threads around them) and by kind of work (ORM, driver, JSON, logging, signals, asyncio,
thread hand-offs), beside the workers' CPU per job from /proc and the server's
transactions per job. Figures are printed, not asserted.

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
import statistics
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
from django.db import connection  # noqa: E402
from django.tasks import task_backends  # noqa: E402

from bench.tables import empty, refuse_unless_named, tables_of  # noqa: E402
from bench.tasks import noop, noop_keyed, noop_rated, sleep_async  # noqa: E402
from django_jobs.models import Job, JobStatus, Process  # noqa: E402

START_TIMEOUT = 60.0
KEYS = 1_000
# The calls each kind of drain enqueues, for a number of jobs.
KINDS = {
    "plain": lambda jobs: [(noop, (), {})] * jobs,
    "keyed": lambda jobs: [(noop_keyed, (), {"key": n % KEYS}) for n in range(jobs)],
    "rated": lambda jobs: [(noop_rated, (), {"key": n % KEYS}) for n in range(jobs)],
    "async": lambda jobs: [(sleep_async, (), {"seconds": 0.2})] * jobs,
}
# A frame as py-spy's raw format writes it: "function (path:line)".
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^:]*):(?P<line>\d+)\)$")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="no-op jobs to drain (20,000)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (2)")
    parser.add_argument(
        "--threads", type=int, help="threads per worker (8; --kind async: the settings')"
    )
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (200)")
    parser.add_argument("--top", type=int, default=30, help="functions printed per list (30)")
    parser.add_argument(
        "--kind",
        choices=sorted(KINDS),
        default="plain",
        help="plain no-op jobs, or each under one of 1,000 keys: a concurrency limit of 1 "
        "(keyed) or a rate limit that never binds (rated); or async def jobs that await "
        "asyncio.sleep(0.2) (async); as bench/throughput.py's phases",
    )
    parser.add_argument(
        "--keep-samples", type=Path, metavar="DIR", help="copy py-spy's raw samples here"
    )
    options = parser.parse_args()
    if options.threads is None and options.kind != "async":
        options.threads = 8
    return options


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


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of these processes (every thread), in clock ticks."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        ticks += sum(int(value) for value in stat[stat.rindex(")") + 2 :].split()[11:13])
    return ticks


def server_transactions() -> int:
    """Transactions committed in the bench's database so far (the server's statistics,
    which lag by up to half a second: read after a pause)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def commits_so_far() -> int | None:
    if connection.vendor != "postgresql":
        return None
    time.sleep(0.6)  # the statistics collector's delay
    return server_transactions()


def drain_sampled(
    options: argparse.Namespace, spy: str, out: Path
) -> tuple[float, list[Path], float, int | None]:
    """Run the drain under py-spy; returns its seconds, the raw sample files, the worker
    processes' CPU seconds during it and the transactions the server committed."""
    command = [sys.executable, str(ROOT / "testproject" / "manage.py"), "run_jobs"]
    command += ["--processes", str(options.processes)]
    if options.threads is not None:
        command += ["--threads", str(options.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(out / "run_jobs.log", "wb") as log:
        workers = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    spies: list[subprocess.Popen] = []
    try:
        kind = Process.Kind.WORKER
        registered = lambda: Process.objects.filter(kind=kind).count() >= options.processes  # noqa: E731
        wait_for("run_jobs' workers to register", registered, START_TIMEOUT)
        pids = list(Process.objects.filter(kind=kind).values_list("pid", flat=True))
        time.sleep(1.0)  # past the workers' start-up
        commits = commits_so_far()
        ticks = cpu_ticks(pids)
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
        cpu = (cpu_ticks(pids) - ticks) / os.sysconf("SC_CLK_TCK")
        after = commits_so_far()
        # Less the enqueue's transaction and this harness's polls (one a read each).
        polls = int(seconds / 0.2) + 1
        committed = None if commits is None or after is None else after - commits - 1 - polls
    finally:
        for process in spies:
            process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for process in spies:
            process.wait(30)
        os.killpg(workers.pid, signal.SIGTERM)
        workers.wait(60)
    return seconds, files, cpu, committed


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


# Where a sample's time goes in a job's life: the innermost frame that names a step,
# (function, the end of its file's path). The claim thread's, the event loop's, the ORM
# threads' and the completer's steps; the rest are the threads beside them.
STEPS = (
    ("claim: the statement and its Jobs", "claim_jobs", "core/ready.py"),
    ("claim: starts the claim left", "start_claimed", "runtime/executor.py"),
    ("claim: room (capacity, lane_room)", "capacity", "runtime/worker.py"),
    ("claim: hand-off to the loop", "submit", "runtime/async_lane.py"),
    ("claim: Worker.submit (checks)", "submit", "runtime/worker.py"),
    ("job on a thread (sync lane)", "run_one", "runtime/worker.py"),
    ("start (ORM thread: begin_fresh)", "begin_fresh", "runtime/async_executor.py"),
    ("body (loop: run_body)", "run_body", "runtime/async_executor.py"),
    ("outcome (ORM thread: conclude)", "conclude", "runtime/async_executor.py"),
    ("job end (loop: done, slot freed)", "run", "runtime/async_lane.py"),
    ("around the job (loop: execute_async_job)", "execute_async_job", "async_executor.py"),
    ("finish (completer thread)", "run", "runtime/completer.py"),
    ("loop monitor thread", "run", "runtime/loop_monitor.py"),
    ("loop monitor's tick (loop)", "tick", "runtime/loop_monitor.py"),
    ("watchdog thread", "run", "runtime/watchdog.py"),
    ("listener thread", "run", "runtime/listener.py"),
    ("log writer thread", "write_batches", "runtime/logs.py"),
    ("progress writer thread", "run", "core/progress.py"),
    ("heartbeat thread", "run", "runtime/heartbeat.py"),
    ("claim loop: the rest (wake, sleep)", "run", "runtime/worker.py"),
    ("event loop: the rest (asyncio)", "serve", "runtime/async_lane.py"),
    ("pool threads: the rest (idle, queue)", "_worker", "concurrent/futures/thread.py"),
)
# What kind of work: the module of the first frame called from our own code
# (django_jobs/, bench/), or our own code where a sample ends there.
KINDS_OF_WORK = (
    ("driver (psycopg)", ("psycopg/", "psycopg_pool/")),
    ("ORM: model instances", ("django/db/models/base.py",)),
    ("ORM: queries (compile, cursor)", ("django/db/",)),
    ("JSON", ("json/", "orjson", "tasks/serialization.py")),
    ("logging", ("logging/", "runtime/logs.py")),
    ("signals", ("django/dispatch/",)),
    ("tracing hooks", ("observability/tracing.py",)),
    ("asyncio", ("asyncio/", "selectors.py")),
    (
        "thread hand-offs (asgiref, futures, threading)",
        ("asgiref/", "concurrent/", "threading.py", "queue.py"),
    ),
    ("Django tasks (TaskResult, Task)", ("django/tasks/",)),
    ("Django, other", ("django/",)),
)


def parsed(frame: str) -> tuple[str, str]:
    """(function, path) of a frame: py-spy names a method ``Class.method`` and gives a
    file's path from its package (``django_jobs/runtime/worker.py``)."""
    match = FRAME.match(frame)
    if not match:
        return frame, ""
    return match.group("function").split(".<locals>.")[0].rsplit(".", 1)[-1], match.group("path")


def is_ours(path: str) -> bool:
    return path.startswith(("django_jobs/", "bench/", "testproject/")) or (
        "/site-packages/" not in path and "/django_jobs/" in path
    )


def step_of(frames: list[tuple[str, str]]) -> str:
    for function, path in reversed(frames):
        for name, step_function, suffix in STEPS:
            if function == step_function and path.endswith(suffix):
                return name
    return "other threads"


def kind_of(frames: list[tuple[str, str]]) -> str:
    ours = [i for i, (_, path) in enumerate(frames) if is_ours(path)]
    if not ours:
        callee = frames
    elif ours[-1] == len(frames) - 1:
        return "our code (django_jobs)"
    else:
        callee = frames[ours[-1] + 1 :]
    first = callee[0][1]
    for name, parts in KINDS_OF_WORK:
        if any(part in first for part in parts):
            if name.startswith("ORM: queries") and any("psycopg" in p for _, p in callee):
                return "driver (psycopg)"
            return name
    return "other libraries, stdlib"


def by_step_and_kind(files: list[Path]) -> collections.Counter:
    """Samples per (step, kind of work)."""
    cells: collections.Counter = collections.Counter()
    for path in files:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [parsed(f) for f in stack.split(";") if FRAME.match(f)]
            if frames:
                cells[(step_of(frames), kind_of(frames))] += int(count)
    return cells


def print_per_job(cells: collections.Counter, rate: int, jobs: int, top: int) -> None:
    """Milliseconds of GIL per job: by step, by kind, and the largest cells of both."""
    per_job = 1000 / rate / jobs
    steps: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    for (step, kind), samples in cells.items():
        steps[step] += samples
        kinds[kind] += samples
    total = sum(cells.values())
    print(f"\nGIL held per job, every worker process: {total * per_job:.3f} ms")
    for title, counter in (("by step", steps), ("by kind of work", kinds)):
        print(f"\n{title} (ms per job, share)")
        for name, samples in counter.most_common():
            print(f"{samples * per_job:7.3f}  {100 * samples / total:5.1f}%  {name}")
    print("\nby step and kind (ms per job)")
    for (step, kind), samples in cells.most_common(top):
        print(f"{samples * per_job:7.3f}  {step} / {kind}")


def module_of(frame: str) -> str:
    match = FRAME.match(frame)
    path = match.group("path") if match else frame
    path = re.sub(r".*site-packages/", "", path)
    path = re.sub(rf"^{re.escape(str(ROOT))}/", "", path)
    path = re.sub(r".*/lib/python3\.\d+/", "stdlib/", path)
    return "/".join(path.split("/")[:2])


def held_per_job() -> dict[str, float]:
    """From the rows: the drain's span (first start to last finish), and how long each
    job held its place from its start (the claim's, on PostgreSQL) to its finish (the
    completer's commit), in ms: its body and the steps and waits around it; and how many
    claims started them."""
    rows = list(Job.objects.values_list("started_at", "finished_at"))
    held = sorted((end - start).total_seconds() * 1000 for start, end in rows if start and end)
    if not held:
        return {}
    span = max(end for _, end in rows) - min(start for start, _ in rows)
    return {
        # The claim writes one start time for every job it starts.
        "claims": len({start for start, _ in rows}),
        "span_s": span.total_seconds(),
        "mean": statistics.fmean(held),
        "p50": held[len(held) // 2],
        "p95": held[int(len(held) * 0.95)],
    }


def main() -> int:
    options = parse_args()
    spy = py_spy()
    refuse_unless_named()  # before the migration: a database not named so is left alone
    call_command("migrate", verbosity=0)
    empty_job_tables()
    with tempfile.TemporaryDirectory(prefix="profile-drain-") as folder:
        seconds, files, cpu, commits = drain_sampled(options, spy, Path(folder))
        sampled = [f for f in files if f.exists()]
        if options.keep_samples:
            options.keep_samples.mkdir(parents=True, exist_ok=True)
            for path in sampled:
                shutil.copy(path, options.keep_samples / path.name)
        total, inclusive, own, modules = shares(sampled)
        cells = by_step_and_kind(sampled)
    held = held_per_job()
    empty_job_tables()
    threads = options.threads or "the settings'"
    print(
        f"{options.jobs:,} jobs ({options.kind}) drained in {seconds:.2f} s "
        f"({options.jobs / seconds:,.0f} jobs/s, from the enqueue) by {options.processes} x "
        f"{threads} threads; {total:,} samples of the GIL holder at {options.rate}/s"
    )
    if held:
        print(
            f"rate from the rows: {options.jobs / held['span_s']:,.0f} jobs/s; each job held "
            f"from its start to its finish's commit: mean {held['mean']:.1f} ms, p50 "
            f"{held['p50']:.1f}, p95 {held['p95']:.1f}; {held['claims']:,} claims started "
            f"them ({options.jobs / held['claims']:.1f} jobs each)"
        )
    print(
        f"worker processes' CPU (user + system) per job: {1000 * cpu / options.jobs:.3f} ms"
        + (f"; server transactions per job: {commits / options.jobs:.2f}" if commits else "")
        + f"; load average {os.getloadavg()[0]:.2f}"
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
    print_per_job(cells, options.rate, options.jobs, options.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
