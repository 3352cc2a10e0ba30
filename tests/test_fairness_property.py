"""The share bound of fair queues (docs/fairness.md, "What it guarantees"), as a property of
real enqueues and real claims: generated sequences of enqueues over several groups and weights,
interleaved with claims, and every window of consecutive starts checked against the bound.

tests/test_fairness.py gives exact claim orders for a few hand-picked sequences; a change that
keeps those but breaks the rule elsewhere (a group that arrives late, an idle spell, a weight of
1.5, the group of no key) shows here. The checker returns what it found, so that the twin below
can show it finds the unfair order FIFO gives: a property that holds of every order would prove
nothing.

The bound (start-time fair queuing): for two groups ``i`` and ``j`` that both have a job ready
throughout a window of consecutive claims, the starts ``S`` in that window satisfy
``|S_i * step_i - S_j * step_j| <= step_i + step_j``, with ``step = fairness.step_of(weight)``
(``|S_i / w_i - S_j / w_j| <= 1 / w_i + 1 / w_j`` in turns of 65,536). "Throughout" is before
every claim of the window and after every one but its last: a group whose last ready job is
claimed is idle, even if its next jobs come before the next claim, and gets no credit for it
(its window starts at their enqueue, where it arrives again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations, pairwise

import pytest
from django.conf import settings
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_jobs import bulk_enqueue
from django_jobs.core import fairness
from django_jobs.core.fairness import fifo_turn
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.models import FairTurn, Job, Process, ReadyExecution
from tests.fair_tasks import tenant_report, unkeyed_report

DB = "default"
REPORTS = QueueSelector(("reports",))
FAIR = {**settings.DJANGO_JOBS, "fair_queues": ["reports"]}
# Weights of a group, None the default (1): steps of 65,536 / w, a step of 1.5 not a whole
# number of ids.
WEIGHTS: list[float | None] = [0.5, 1, 1.5, 2, 3, None]
# The group of the jobs of no key (the unkeyed task of a fair queue): its fair_key is ''.
NO_KEY = ""
# Examples of the property per run: JOBS_FAIRNESS_EXAMPLES=500 for a long run.
EXAMPLES = int(os.environ.get("JOBS_FAIRNESS_EXAMPLES", "30"))


@dataclass(frozen=True)
class Enqueue:
    """One enqueue call: ``counts`` jobs of each group, in one ``bulk_enqueue`` (``bulk``) or
    as single ``enqueue()`` calls, one after another, group by group."""

    counts: tuple[tuple[str, int], ...]
    bulk: bool

    def __str__(self) -> str:
        jobs = ", ".join(f"{group or '<no key>'} x{count}" for group, count in self.counts)
        return f"{'bulk' if self.bulk else 'singles'}({jobs})"


@dataclass(frozen=True)
class Claim:
    """``count`` claims, one job each, as a worker claiming with ``batch_size`` 1; None:
    until nothing is ready (the queue idle)."""

    count: int | None

    def __str__(self) -> str:
        return "claim until idle" if self.count is None else f"claim x{self.count}"


Event = Enqueue | Claim


@dataclass(frozen=True)
class Scenario:
    """Groups (key: weight) and the events in order; the run ends by claiming what is left."""

    weights: dict[str, float | None]
    events: tuple[Event, ...]

    def __str__(self) -> str:
        groups = ", ".join(
            f"{group or '<no key>'}: w={weight}" for group, weight in self.weights.items()
        )
        return f"groups {{{groups}}}; events [{', '.join(map(str, self.events))}]"


@dataclass(frozen=True)
class Start:
    """One claim's job: its group, and how many jobs of each group were ready just before."""

    group: str
    ready_before: dict[str, int]

    def waiting(self, group: str) -> bool:
        """Whether ``group`` had a job ready before this claim, and still had one after it:
        between two claims only enqueues happen, so right after a claim is when a group has
        the fewest jobs ready."""
        ready = self.ready_before.get(group, 0)
        return ready > 0 and ready - (self.group == group) > 0


@dataclass
class Run:
    """What the real claims did: the starts in order, and what went wrong besides shares."""

    starts: list[Start] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Violation:
    """A window of claims ``first`` to ``last`` (0-based, inclusive) throughout which both
    groups had a job ready, and in which their starts break the bound."""

    groups: tuple[str, str]
    first: int
    last: int
    starts: tuple[int, int]
    steps: tuple[int, int]

    def __str__(self) -> str:
        (i, j), (s_i, s_j), (t_i, t_j) = self.groups, self.starts, self.steps
        gap = abs(s_i * t_i - s_j * t_j)
        return (
            f"claims {self.first}..{self.last}: {i or '<no key>'} started {s_i} (step {t_i}), "
            f"{j or '<no key>'} started {s_j} (step {t_j}), both ready throughout: "
            f"|{s_i}*{t_i} - {s_j}*{t_j}| = {gap} > {t_i + t_j}"
        )


def share_violations(starts: Sequence[Start], steps: dict[str, int]) -> list[Violation]:
    """The windows that break the bound, the worst one per pair of groups and stretch of
    claims throughout which both had a job ready.

    "Throughout" is at every moment from just before the window's first claim to just before
    its last: a group whose last ready job is claimed is idle until its next enqueue, even if
    that comes before the next claim, and its next jobs are then those of a group arriving
    (no credit for the idle spell, docs/fairness.md), so a stretch ends with such a claim.

    In a stretch, each claim adds ``step_i`` (a start of ``i``) or ``-step_j`` (of ``j``) or
    nothing to a running sum; a window's ``S_i * step_i - S_j * step_j`` is the difference of
    two of its prefix sums, so the worst window runs between the lowest and the highest.
    """
    found: list[Violation] = []
    for i, j in combinations(sorted(steps), 2):
        bound = steps[i] + steps[j]
        stretch: list[int] = []  # claim indexes of the current stretch
        for index, start in enumerate(starts):
            if all(start.ready_before.get(g, 0) > 0 for g in (i, j)):
                stretch.append(index)
            if stretch and not (start.waiting(i) and start.waiting(j)):
                found.extend(worst_window(starts, stretch, i, j, steps, bound))
                stretch = []
        if stretch:
            found.extend(worst_window(starts, stretch, i, j, steps, bound))
    return found


def worst_window(
    starts: Sequence[Start], stretch: list[int], i: str, j: str, steps: dict[str, int], bound: int
) -> list[Violation]:
    """The window of ``stretch`` with the largest ``|S_i * step_i - S_j * step_j|``, if that
    is past ``bound``."""
    sums = [0]
    for index in stretch:
        group = starts[index].group
        sums.append(sums[-1] + (steps[i] if group == i else -steps[j] if group == j else 0))
    low = min(range(len(sums)), key=sums.__getitem__)
    high = max(range(len(sums)), key=sums.__getitem__)
    if sums[high] - sums[low] <= bound:
        return []
    begin, end = min(low, high), max(low, high)  # the window is stretch[begin:end]
    window = [starts[index].group for index in stretch[begin:end]]
    return [
        Violation(
            groups=(i, j),
            first=stretch[begin],
            last=stretch[end - 1],
            starts=(window.count(i), window.count(j)),
            steps=(steps[i], steps[j]),
        )
    ]


def enqueue(event: Enqueue, weights: dict[str, float | None]) -> list[int]:
    """The jobs of ``event``, through the real ``bulk_enqueue`` or ``enqueue()``; their ids."""
    calls = []
    for group, count in event.counts:
        weight = weights[group]
        task = unkeyed_report if group == NO_KEY else tenant_report
        if weight is not None:
            task = task.using(fair_weight=weight)
        args = () if group == NO_KEY else (group,)
        calls.extend((task, args, {}) for _ in range(count))
    if event.bulk:
        return [int(result.id) for result in bulk_enqueue(calls)]
    return [int(task.enqueue(*args, **kwargs).id) for task, args, kwargs in calls]


def run(scenario: Scenario, worker: Process) -> Run:
    """Play ``scenario`` on the database, claiming one job at a time, then claim until
    nothing is ready. Work conservation is checked as it goes: a claim finds a job exactly
    when one is ready, and every job enqueued is claimed once."""
    result = Run()
    ready = dict.fromkeys(scenario.weights, 0)
    group_of: dict[int, str] = {}
    claimed: list[int] = []

    def claim() -> bool:
        jobs = claim_jobs(DB, worker.pk, REPORTS, 1)
        waiting = sum(ready.values())
        if len(jobs) != (1 if waiting else 0):
            result.problems.append(
                f"claim {len(result.starts)} took {len(jobs)} jobs with {waiting} ready ({ready})"
            )
        if not jobs:
            return False
        (job,) = jobs
        group = job.fair_key if job.fair_key is not None else "<none>"
        if group_of.get(job.pk) != group:
            result.problems.append(
                f"claim {len(result.starts)} took job {job.pk} of group {group!r}, "
                f"enqueued as {group_of.get(job.pk)!r}"
            )
        result.starts.append(Start(group, dict(ready)))
        claimed.append(job.pk)
        if group in ready:
            ready[group] -= 1
        return True

    for event in scenario.events:
        if isinstance(event, Enqueue):
            ids = enqueue(event, scenario.weights)
            groups = [group for group, count in event.counts for _ in range(count)]
            group_of.update(zip(ids, groups, strict=True))
            for group in groups:
                ready[group] += 1
        elif event.count is None:
            while claim():
                pass
        else:
            for _ in range(event.count):
                if not claim():
                    break
    while claim():
        pass
    if len(claimed) != len(set(claimed)):
        result.problems.append(f"jobs claimed twice: {sorted(claimed)}")
    if set(claimed) != set(group_of):
        result.problems.append(f"never claimed: {sorted(set(group_of) - set(claimed))}")
    if ReadyExecution.objects.using(DB).exists():
        result.problems.append("ready rows left after the last claim")
    return result


def steps_of(scenario: Scenario) -> dict[str, int]:
    return {group: fairness.step_of(weight) for group, weight in scenario.weights.items()}


def report(scenario: Scenario, outcome: Run, violations: Sequence[Violation]) -> str:
    """The failure message: the scenario, what went wrong, and the starts in order with the
    ready counts before each."""
    lines = [f"scenario: {scenario}", *outcome.problems, *map(str, violations), "starts:"]
    for index, start in enumerate(outcome.starts):
        counts = " ".join(f"{g or '<no key>'}={n}" for g, n in start.ready_before.items())
        lines.append(f"  {index:3}: {start.group or '<no key>'}  (ready before: {counts})")
    return "\n".join(lines)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """2 to 6 groups, the no-key group among them at times, each with a weight and a backlog
    of 3 to 20 jobs cut into 1 to 3 parts; the parts in any order, some sent as one bulk
    enqueue (with the next part too, at times: several groups in one call), others one job at
    a time; runs of claims between them, so that groups arrive while others have a backlog,
    and at times claims until the queue is idle (where every group starts anew)."""
    count = draw(st.integers(2, 6))
    names = [f"t{n}" for n in range(count)]
    if draw(st.booleans()):
        names[-1] = NO_KEY
    weights = {name: draw(st.sampled_from(WEIGHTS)) for name in names}
    parts: list[tuple[str, int]] = []
    for name in names:
        backlog = draw(st.integers(3, 20))
        cuts = sorted(draw(st.sets(st.integers(1, backlog - 1), max_size=2)))
        bounds = [0, *cuts, backlog]
        parts.extend((name, high - low) for low, high in pairwise(bounds))
    parts = draw(st.permutations(parts))
    events: list[Event] = []
    index = 0
    while index < len(parts):
        claims = draw(st.none() | st.integers(0, 12))
        if claims != 0:
            events.append(Claim(claims))
        bulk = draw(st.booleans())
        taken = 1 + (bulk and index + 1 < len(parts) and draw(st.booleans()))
        events.append(Enqueue(tuple(parts[index : index + taken]), bulk))
        index += taken
    return Scenario(weights, tuple(events))


@pytest.fixture
def fair():
    with override_settings(DJANGO_JOBS=FAIR):
        yield


@pytest.fixture
def worker() -> Process:
    return register_process(DB, "worker")


def play(scenario: Scenario, worker: Process) -> tuple[Run, list[Violation]]:
    """One example from an empty queue: its rows (jobs, ready rows, stamps) are written in a
    savepoint rolled back at the end, since the test's transaction spans all examples."""
    with transaction.atomic(using=DB):
        assert not ReadyExecution.objects.exists() and not FairTurn.objects.exists()
        outcome = run(scenario, worker)
        violations = share_violations(outcome.starts, steps_of(scenario))
        transaction.set_rollback(True, using=DB)
    return outcome, violations


@pytest.mark.django_db
@hypothesis_settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenario=scenarios())
def test_every_window_of_starts_keeps_each_groups_share(fair, worker, scenario):
    outcome, violations = play(scenario, worker)
    assert not outcome.problems and not violations, report(scenario, outcome, violations)


def fifo_turns(db: str, jobs: Sequence[Job], at_head: bool = False) -> dict[int, int]:
    """No fairness: every job at its id's place, as in a queue that is not fair."""
    return {job.pk: fifo_turn(job.pk) for job in jobs}


BACKLOG_THEN_LATECOMER = Scenario(
    {"A": None, "B": None}, (Enqueue((("A", 30),), True), Enqueue((("B", 5),), True))
)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("turns", "unfair"), [(None, False), (fifo_turns, True)], ids=["fair", "fifo"]
)
def test_the_checker_finds_a_backlog_that_holds_up_a_latecomer(
    fair, worker, monkeypatch, turns: Callable[..., dict[int, int]] | None, unfair: bool
):
    """The twin of the property: A's 30 then B's 5. With FIFO turns (the rule taken out)
    B waits behind all of A's, and the checker says so; with the rule, it does not."""
    if turns is not None:
        monkeypatch.setattr("django_jobs.core.ready.ready_turns", turns)
    outcome, violations = play(BACKLOG_THEN_LATECOMER, worker)
    assert not outcome.problems, report(BACKLOG_THEN_LATECOMER, outcome, violations)
    assert [start.group for start in outcome.starts] == (
        ["A"] * 30 + ["B"] * 5 if unfair else ["A"] + ["B", "A"] * 5 + ["A"] * 24
    )
    if unfair:
        (violation,) = violations
        assert violation.groups == ("A", "B")
        assert violation.starts == (30, 0)
    else:
        assert violations == []


# Sequences the property met, kept as examples of their own (each is named by what it does).
DRAINED_BETWEEN_CLAIMS = Scenario(
    {"t0": 0.5, "t1": 1, "t2": 0.5, "t3": 0.5, "t4": 0.5, "t5": 0.5},
    (
        Enqueue((("t0", 3),), False),
        Enqueue((("t1", 12),), False),
        Enqueue((("t2", 3),), False),
        Claim(12),
        Enqueue((("t3", 1),), False),
        Claim(4),
        *(Enqueue((("t3", 1),), False),) * 2,
        Enqueue((("t4", 3),), False),
        *(Enqueue((("t5", 1),), False),) * 3,
    ),
)
RAN_AHEAD_BEFORE_AN_IDLE_SPELL = Scenario(
    {"A": 0.5, "B": None},
    (
        Enqueue((("A", 20),), True),
        Claim(None),
        Enqueue((("B", 1),), True),
        Enqueue((("A", 1),), True),
        Enqueue((("B", 30),), True),
    ),
)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "scenario",
    [DRAINED_BETWEEN_CLAIMS, RAN_AHEAD_BEFORE_AN_IDLE_SPELL],
    ids=["drained-between-claims", "ran-ahead-before-an-idle-spell"],
)
def test_sequences_met_before_keep_the_bound(fair, worker, scenario: Scenario):
    """drained-between-claims: t3's one job is claimed (claim 15) and its next two come
    before claim 16, behind t1's: the window of its backlog starts at that enqueue, not
    before claim 12, and there the bound holds (t1 3 starts, t3 none: 3 * 65,536 = 196,608 =
    65,536 + 131,072, the bound exactly); from claim 12, t3 idle once, t1 starts 6 to its 1.

    ran-ahead-before-an-idle-spell: A (weight 0.5) alone gives its 20 jobs turns 2 ids
    apart, 20 ids past the last id, and they all run: the queue is idle. B's one job starts
    anew at its id; A's next, enqueued while B's is ready, must take the head's turn, not
    the one A's stamp has from before the idle spell, or B's 30 that follow all go first."""
    outcome, violations = play(scenario, worker)
    assert not outcome.problems and not violations, report(scenario, outcome, violations)
