"""What ``run_enqueued_jobs()`` ran, and how each run ended, in run order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.tasks import Task


class Outcome(StrEnum):
    """How one run of a job ended (a string: ``run.outcome == "succeeded"`` holds)."""

    SUCCEEDED = "succeeded"
    # Failed for good: no attempt left, not retried (a cancelled job is CANCELLED).
    FAILED = "failed"
    # Failed, and waits for its next attempt (``next_run_at``, None: ready again now).
    WILL_RETRY = "will_retry"
    # The task raised ``Snooze``: waits until ``next_run_at``, no attempt used up.
    SNOOZED = "snoozed"
    # Ended by a cancel request (``django_jobs.cancel``): failed with ``JobCancelled``.
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ErrorRecord:
    """The error a failed run recorded (the job's ``FailedExecution`` row)."""

    exception_class_path: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"{self.exception_class_path}: {self.message}"


@dataclass(frozen=True)
class JobRun:
    """One run of one job: its body was called, or its task could not be imported."""

    job_id: int
    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]
    queue_name: str
    # The attempt this run was (``attempts`` after its start; a run that never
    # started, its task not importable, keeps the count before it).
    attempt: int
    outcome: Outcome
    # What the task returned, for SUCCEEDED; None otherwise.
    return_value: Any = None
    # The error recorded, for FAILED, WILL_RETRY and CANCELLED; None otherwise.
    error: ErrorRecord | None = None
    # When it runs again, for WILL_RETRY and SNOOZED (None: it is ready now).
    next_run_at: datetime | None = None
    # Inside a test's transaction (a ``TestCase``) only: why the body's writes were
    # rolled back, which a worker would not have done, so the outcome and the rows may
    # differ from a worker's. None: they were kept. ``assert_all_succeeded()`` fails on it.
    rolled_back: str | None = None

    @property
    def result_id(self) -> str:
        """The id of the job's ``TaskResult`` (``task.get_result(run.result_id)``)."""
        return str(self.job_id)

    def describe(self) -> str:
        """``#12 app.tasks.send(1, to='x') -> failed (builtins.ValueError: boom)``."""
        what = f"#{self.job_id} {self.task_path}({call_arguments(self.args, self.kwargs)})"
        detail = f" ({self.error})" if self.error is not None else ""
        lost = f" [its writes were rolled back: {self.rolled_back}]" if self.rolled_back else ""
        return f"{what} -> {self.outcome.value}{detail}{lost}"


@dataclass
class RunReport:
    """What one call of ``run_enqueued_jobs()`` ran, in run order (a sequence of
    :class:`JobRun`), with accessors by outcome and by task."""

    runs: list[JobRun] = field(default_factory=list)
    # Jobs claimed but sent back to wait by their rate limit, never started: rates are
    # measured by the real clock, which time travel does not move.
    rate_limited: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[JobRun]:
        return iter(self.runs)

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, index: int) -> JobRun:
        return self.runs[index]

    def __bool__(self) -> bool:
        return bool(self.runs)

    def __repr__(self) -> str:
        counts = Counter(run.outcome.value for run in self.runs)
        detail = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
        return f"<RunReport: {len(self.runs)} ran{': ' + detail if detail else ''}>"

    def with_outcome(self, outcome: Outcome | str) -> list[JobRun]:
        return [run for run in self.runs if run.outcome == outcome]

    @property
    def succeeded(self) -> list[JobRun]:
        return self.with_outcome(Outcome.SUCCEEDED)

    @property
    def failed(self) -> list[JobRun]:
        """Runs that failed for good (not the cancelled ones, nor those to be retried)."""
        return self.with_outcome(Outcome.FAILED)

    @property
    def will_retry(self) -> list[JobRun]:
        return self.with_outcome(Outcome.WILL_RETRY)

    @property
    def snoozed(self) -> list[JobRun]:
        return self.with_outcome(Outcome.SNOOZED)

    @property
    def cancelled(self) -> list[JobRun]:
        return self.with_outcome(Outcome.CANCELLED)

    @property
    def rolled_back(self) -> list[JobRun]:
        """Runs whose body's writes the test's transaction rolled back (``TestCase``
        only): see ``JobRun.rolled_back``."""
        return [run for run in self.runs if run.rolled_back]

    @property
    def outcomes(self) -> list[str]:
        """Each run's outcome, in run order: ``["will_retry", "succeeded"]``."""
        return [run.outcome.value for run in self.runs]

    @property
    def task_paths(self) -> list[str]:
        """Each run's task, in run order."""
        return [run.task_path for run in self.runs]

    def for_task(self, task: Task | str) -> list[JobRun]:
        """The runs of one task (a task object or its dotted path), in run order."""
        path = task_path(task)
        return [run for run in self.runs if run.task_path == path]

    def return_values(self, task: Task | str | None = None) -> list[Any]:
        """What the succeeded runs returned (of ``task`` only, if given), in run order."""
        runs = self.runs if task is None else self.for_task(task)
        return [run.return_value for run in runs if run.outcome == Outcome.SUCCEEDED]

    def assert_all_succeeded(self) -> None:
        """Raise ``AssertionError`` naming every run that did not succeed, with the
        first one's traceback: a one-line check for a test that expects no failure.
        A success whose writes the test's transaction rolled back fails it too."""
        bad = [run for run in self.runs if run.outcome != Outcome.SUCCEEDED or run.rolled_back]
        if not bad:
            return
        lines = [f"{len(bad)} of {len(self.runs)} job run(s) did not succeed:"]
        lines += listed([run.describe() for run in bad])
        if any(run.rolled_back for run in bad):
            lines.append(ROLLED_BACK_HELP)
        first = next((run for run in bad if run.error is not None), None)
        if first is not None and first.error is not None and first.error.traceback:
            lines += [f"The traceback of #{first.job_id}:", first.error.traceback.rstrip()]
        raise AssertionError("\n".join(lines))


# What to do about a body whose writes a TestCase's transaction rolled back.
ROLLED_BACK_HELP = (
    "A database error inside a TestCase's transaction rolls back the job body's writes "
    "(and makes its later queries raise TransactionManagementError), which a worker, in "
    "autocommit, does not. Run this test in autocommit (TransactionTestCase; pytest: "
    "transactional_db), or wrap the write that may fail in its own transaction.atomic()."
)


def listed(lines: list[str], total: int | None = None) -> list[str]:
    """The first :data:`LISTED` of ``lines``, indented, then how many more there are of
    ``total`` (default: of ``lines``)."""
    more = (len(lines) if total is None else total) - LISTED
    shown = [f"  {line}" for line in lines[:LISTED]]
    return [*shown, f"  ... and {more} more"] if more > 0 else shown


# Lines a failure message lists at most.
LISTED = 20


def task_path(task: Task | str) -> str:
    """The dotted path jobs store for ``task``: a task object's ``module_path``, or the
    path itself."""
    if isinstance(task, str):
        return task
    path = getattr(task, "module_path", None)
    if not isinstance(path, str):
        raise TypeError(
            f"expected a task (a function decorated with @task) or its dotted path, "
            f"got {type(task).__name__}"
        )
    return path


def call_arguments(args: list[Any], kwargs: dict[str, Any], width: int = 120) -> str:
    """``1, 'x', to='y'``, cut at ``width`` characters."""
    text = ", ".join([*(repr(arg) for arg in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    return text if len(text) <= width else text[: width - 3] + "..."
