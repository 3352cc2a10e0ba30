"""Retry, discard and cancel for ``manage.py jobs``: each job through the very function the
admin's action calls (``core/operator.py``), and a tally of what came of it.

The command adds no locking of its own. Each job is acted on in its own transaction, one
after another in ascending id, exactly as the admin's bulk actions do: a retry locks the
job's row and then its key's semaphore, so two jobs in one transaction would lock a job row
after a semaphore, against the lock order (docs/design.md section 4). Batches bound what the
command reads and holds, not what it locks: at most one job's locks are held at any time,
however many jobs are selected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from django_jobs.core import operator
from django_jobs.exceptions import JobAlreadyFinished, JobNotFound
from django_jobs.models import FINISHED_STATUSES, Job

NOT_AN_ID = "not a job id"
# What the report lists of the jobs not acted on: the first ids of each reason, and the
# first reasons; the rest are counted.
IDS_LISTED = 10
REASONS_LISTED = 10
OTHER_REASONS = "other reasons"


@dataclass(frozen=True)
class Outcome:
    """What came of one job: ``done`` names what was done, else ``refused`` says why not."""

    done: str | None = None
    refused: str | None = None


@dataclass(frozen=True)
class Action:
    name: str  # as typed: retry
    verb: str  # as asked: Retry 1,234 jobs?
    past: str  # as reported: not retried
    accepts: frozenset[str]  # the statuses it acts on
    act: Callable[[str, int], Outcome]
    # What it does to each job, said in the dry run ("would retry").
    would: str


def status_of(db: str, job_id: int) -> str | None:
    return Job.objects.using(db).filter(pk=job_id).values_list("status", flat=True).first()


def refusal(action: Action, status: str | None) -> str:
    """Why ``action`` does not act on a job in ``status`` (None: there is no such job),
    in the words of ``core/operator.py``, which the admin says them in too."""
    if status is None:
        return operator.NO_SUCH_JOB
    if status in action.accepts:
        # It was in a state the action takes, and was not when the action looked under
        # its lock (a worker, or another operator, moved it meanwhile).
        return operator.raced(action.past.removeprefix("not "))
    if action.accepts == operator.RETRYABLE:
        return f"it is {status}, not failed"
    if status in FINISHED_STATUSES:
        return f"it has already ended ({status})"
    return f"it is {status}: a claimed or running job is cancelled, not discarded"


def retry(db: str, job_id: int) -> Outcome:
    """A refused retry is explained as the admin explains it (``operator.retry_refusal``),
    from the status read once after the refusal."""
    if operator.retry_failed_job(db, job_id):
        return Outcome(done="retried")
    return Outcome(refused=operator.retry_refusal(db, job_id, status_of(db, job_id)))


def discard(db: str, job_id: int) -> Outcome:
    if operator.discard(db, job_id):
        return Outcome(done="discarded")
    return Outcome(refused=refusal(DISCARD, status_of(db, job_id)))


def cancel(db: str, job_id: int) -> Outcome:
    try:
        outcome = operator.cancel_job(db, job_id)
    except JobNotFound:
        return Outcome(refused=operator.NO_SUCH_JOB)
    except JobAlreadyFinished:
        return Outcome(refused=refusal(CANCEL, status_of(db, job_id)))
    return Outcome(done="cancelled" if outcome == operator.CANCELLED else "stop requested")


RETRY = Action("retry", "Retry", "not retried", operator.RETRYABLE, retry, "would retry")
DISCARD = Action(
    "discard", "Discard", "not discarded", operator.DISCARDABLE, discard, "would discard"
)
CANCEL = Action("cancel", "Cancel", "not cancelled", operator.CANCELLABLE, cancel, "would cancel")
ACTIONS = {action.name: action for action in (RETRY, DISCARD, CANCEL)}


@dataclass
class Refused:
    count: int = 0
    listed: list[str] = field(default_factory=list)


@dataclass
class Tally:
    """Counts per outcome, and the jobs not acted on by reason, in bounded memory: however
    many jobs a run goes through, it keeps ``IDS_LISTED`` names for each of at most
    ``REASONS_LISTED`` reasons (the others are counted under "other reasons")."""

    done: dict[str, int] = field(default_factory=dict)
    refused: dict[str, Refused] = field(default_factory=dict)

    def add(self, outcome: Outcome, name: str) -> None:
        if outcome.done is not None:
            self.done[outcome.done] = self.done.get(outcome.done, 0) + 1
        else:
            self.refuse(outcome.refused or OTHER_REASONS, name)

    def refuse(self, reason: str, name: str) -> None:
        if reason not in self.refused and len(self.refused) >= REASONS_LISTED:
            reason = OTHER_REASONS
        entry = self.refused.setdefault(reason, Refused())
        entry.count += 1
        if len(entry.listed) < IDS_LISTED:
            entry.listed.append(name)

    @property
    def done_count(self) -> int:
        return sum(self.done.values())

    @property
    def refused_count(self) -> int:
        return sum(entry.count for entry in self.refused.values())

    def refused_lines(self) -> list[str]:
        """One line per reason, the most frequent first: the reason, then the jobs."""
        lines = []
        ordered = sorted(self.refused.items(), key=lambda item: -item[1].count)
        for reason, entry in ordered:
            more = entry.count - len(entry.listed)
            names = ", ".join(entry.listed) + (f" and {more:,} more" if more else "")
            lines.append(f"  {reason}: {names}")
        return lines


def job_name(job_id: int) -> str:
    return f"#{job_id}"


def listed(ids: Iterable[int], count: int) -> str:
    """The first ``IDS_LISTED`` of ``ids``, and how many more there are of ``count``."""
    names = [job_name(job_id) for job_id in list(ids)[:IDS_LISTED]]
    more = count - len(names)
    return ", ".join(names) + (f" and {more:,} more" if more > 0 else "")


def plural(count: int, word: str = "job") -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"
