"""Our own drain and latency in two checkouts, round by round: "nothing else gets worse".

    git worktree add ../before <commit>      # with its own .venv, or --python
    python bench/ab_drain.py ../before . --db postgres --rounds 4

Every issue asks that what it does not touch stays within a few percent of before, in the
same run. bench/throughput.py measures us against peers; this runs its ``drain`` and
``latency`` phases for us alone, in each checkout in turn (A, B, A, B, ...: the machine's
drift falls on both), each round a fresh process that imports that checkout's code, and
prints the rates, the workers' CPU per job, their memory (PSS) and enqueue→start p50/p95,
then B / A of the means. Figures are printed, never asserted.

A round's two runs are paired, so each round gives one ratio B/A that the machine's drift
between rounds does not move; the rounds alternate which checkout runs first (A B, B A, ...),
so that neither always meets the state the other left (a warm cache, a longer WAL). The
ratios' spread is printed beside the ratio of the means: their 95% interval (Student's t)
says whether a "within 5%" verdict is a finding or noise. On this 2-core machine a round's
ratio swings by up to 15% on SQLite and MariaDB: six SQLite rounds gave intervals ±7% to
±13% wide, so a 5% verdict there needs a dozen rounds or more. Each checkout runs with its
own ``.venv/bin/python`` where it has one (so that each has its own installed packages;
equal extras matter: unequal venvs once gave a false +8% of memory), else ``--python``.
The database's name contains "throughput" (bench/throughput.py empties its tables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Run in a checkout (its root first on sys.path): one drain and one latency measurement.
CHILD = r"""
import json, os, sys, tempfile
from pathlib import Path
root, db, jobs, samples, interval, out = sys.argv[1:7]
sys.path.insert(0, root)
sys.argv = ["throughput.py", "--db", db, "--phases", "drain"]
import bench.throughput as T
from django.core.management import call_command
T.create_database()
call_command("migrate", verbosity=0)
ours = T.Ours(os.cpu_count() or 2, T.DEFAULT_THREADS)
with tempfile.TemporaryDirectory() as logs:
    drained = T.drain(ours, int(jobs), lambda: ours.enqueue_many(int(jobs)), Path(logs), "ab")
    waits = sorted(T.latency(ours, int(samples), float(interval), Path(logs)))
Path(out).write_text(json.dumps({
    "rate": drained.rate,
    "cpu_ms": drained.cpu["ms_per_job"],
    "pss_mb": drained.rss["all_processes_pss_mb"],
    "p50_ms": waits[len(waits) // 2],
    "p95_ms": waits[int(len(waits) * 0.95)],
}))
"""

FIGURES = (
    ("rate", "drain, jobs/s"),
    ("cpu_ms", "workers' CPU, ms/job"),
    ("pss_mb", "memory, PSS MB"),
    ("p50_ms", "enqueue→start p50, ms"),
    ("p95_ms", "enqueue→start p95, ms"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="checkout A (the reference)")
    parser.add_argument("after", type=Path, help="checkout B")
    parser.add_argument("--db", choices=("postgres", "mariadb", "sqlite"), default="postgres")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of A then B (4)")
    parser.add_argument("--jobs", type=int, default=20_000, help="no-op jobs drained (20,000)")
    parser.add_argument("--samples", type=int, default=200, help="latency samples (200)")
    parser.add_argument("--interval-ms", type=float, default=30.0, help="between them (30)")
    parser.add_argument("--python", default=sys.executable, help="where a checkout has no .venv")
    return parser.parse_args()


def interpreter(checkout: Path, fallback: str) -> str:
    own = checkout / ".venv" / "bin" / "python"
    return str(own) if own.exists() else fallback


def measure(checkout: Path, options: argparse.Namespace) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [
                interpreter(checkout, options.python),
                "-c",
                CHILD,
                str(checkout),
                options.db,
                str(options.jobs),
                str(options.samples),
                str(options.interval_ms),
                out.name,
            ],
            cwd=checkout,
            check=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        return json.loads(Path(out.name).read_text())


def main() -> int:
    options = parse_args()
    checkouts = {"A": options.before.resolve(), "B": options.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for round_ in range(1, options.rounds + 1):
        order = ("A", "B") if round_ % 2 else ("B", "A")
        for name in order:
            figures = measure(checkouts[name], options)
            runs[name].append(figures)
            shown = ", ".join(f"{key} {figures[key]:,.3f}" for key, _ in FIGURES)
            print(f"round {round_} {name}: {shown}", flush=True)
    print(f"\n{options.db}, {options.rounds} rounds: A = {checkouts['A']}, B = {checkouts['B']}")
    for key, label in FIGURES:
        a = statistics.mean(run[key] for run in runs["A"])
        b = statistics.mean(run[key] for run in runs["B"])
        pairs = zip(runs["A"], runs["B"], strict=True)
        paired = [after[key] / before[key] for before, after in pairs]
        print(
            f"{label:>24}: A {a:10,.3f}  B {b:10,.3f}  B/A {b / a:.3f}  "
            f"rounds' B/A {min(paired):.3f}-{max(paired):.3f}, {interval(paired)}"
        )
    return 0


# Student's t at 97.5% for 1 to 10 degrees of freedom (more rounds: the normal's 1.96
# is within 3% of it past 30; 2.0 is used past 10).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def interval(ratios: list[float]) -> str:
    """The 95% interval of the mean of the rounds' paired ratios, as text."""
    if len(ratios) < 2:
        return "one round: no interval"
    mean = statistics.mean(ratios)
    t = T_975[len(ratios) - 2] if len(ratios) - 1 <= len(T_975) else 2.0
    half = t * statistics.stdev(ratios) / len(ratios) ** 0.5
    return f"mean {mean:.3f}, 95% interval {mean - half:.3f}-{mean + half:.3f}"


if __name__ == "__main__":
    sys.exit(main())
