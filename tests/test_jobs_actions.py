"""``manage.py jobs retry|discard|cancel``: the selection (ids, filters), bad input, the
confirmation, the dry run, batches, the report and the exit codes, on the database under
test. The actions themselves are ``core/operator.py``'s (tests/test_operations.py); here,
that the command reaches them for exactly the jobs selected, and says what came of each."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs.core import operator
from django_jobs.core.operator import CANCELLED_ERROR
from django_jobs.management import job_actions
from django_jobs.management.commands.jobs import INTERRUPTED, NOT_CONFIRMED, SOME_REFUSED, USAGE
from django_jobs.models import (
    AwaitingExecution,
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    ReadyExecution,
    ScheduledExecution,
)
from tests.factories import (
    AwaitingExecutionFactory,
    ClaimedExecutionFactory,
    FinishedJobFactory,
    ReadyExecutionFactory,
    ScheduledExecutionFactory,
)
from tests.harness import MANAGE, REPO_ROOT, database_url

pytestmark = pytest.mark.django_db

EXECUTION_TABLES = (
    ReadyExecution,
    ScheduledExecution,
    BlockedExecution,
    AwaitingExecution,
    ClaimedExecution,
    FailedExecution,
)


def jobs(*args: str, stdin: str | None = None, **options: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``manage.py jobs`` run in this process: 0 when it
    returns, else its ``CommandError``'s ``returncode``, but for a command line that
    cannot be read (2), which is raised for the test to match its message."""
    out, err = StringIO(), StringIO()
    if stdin is not None:
        options["stdin"] = StringIO(stdin)
    try:
        call_command("jobs", *args, stdout=out, stderr=err, **options)
    except CommandError as exc:
        if exc.returncode == USAGE:
            raise
        return exc.returncode, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def failed(**fields: Any) -> Job:
    return FinishedJobFactory(status=JobStatus.FAILED, return_value=None, **fields)


def everything() -> tuple[list[dict], dict[str, list]]:
    """Every job row and every execution row: what "nothing else changed" compares."""
    rows = list(Job.objects.order_by("pk").values())
    executions = {
        model.__name__: list(model.objects.order_by("pk").values()) for model in EXECUTION_TABLES
    }
    return rows, executions


def status(job: Job) -> str:
    return Job.objects.values_list("status", flat=True).get(pk=job.pk)


# --- the overview is unchanged ----------------------------------------------------------


def test_the_overview_and_its_json_are_what_they_were():
    FinishedJobFactory(status=JobStatus.FAILED)
    code, text, _ = jobs()
    assert code == 0 and text.startswith("Queues (at ")
    assert "Stuck jobs" in text and "Workflows (the latest 10)" in text
    code, text, _ = jobs("--json")
    assert code == 0
    assert json.loads(text)["queues"]["default"]["failed_last_hour"] == 1


def test_json_does_not_go_with_an_action():
    job = failed()
    with pytest.raises(CommandError, match="--json prints the overview"):
        jobs("--json", "retry", str(job.pk), "--yes")
    assert status(job) == JobStatus.FAILED


# --- retry ------------------------------------------------------------------------------


def test_retry_by_id_gives_each_failed_job_one_more_attempt():
    first, second = failed(attempts=1, max_attempts=1), failed(attempts=3, max_attempts=3)
    code, out, _ = jobs("retry", str(first.pk), f"#{second.pk}", "--yes")
    assert code == 0, out
    assert f"2 jobs to retry: #{first.pk}, #{second.pk}" in out
    assert "Retried: 2 jobs." in out
    assert "Not retried" not in out
    for job, attempts in ((first, 1), (second, 3)):
        job.refresh_from_db()
        assert (job.status, job.attempts, job.max_attempts) == ("ready", attempts, attempts + 1)
        assert job.finished_at is None
        assert ReadyExecution.objects.filter(job=job).exists()


def test_retry_names_each_id_it_could_not_act_on_and_changes_nothing_else():
    retried = failed()
    succeeded = FinishedJobFactory()
    ready = ReadyExecutionFactory().job
    running = ClaimedExecutionFactory(job__status=JobStatus.RUNNING).job
    before = everything()
    typed = [
        str(retried.pk),
        str(succeeded.pk),
        str(ready.pk),
        str(running.pk),
        str(10**12),  # no such job
        str(2**70),  # past a 64-bit id: never sent to the database
        "-5",
        "abc",
        "²",  # isdigit() says yes, int() says no
        "9" * 5000,
    ]
    code, out, _ = jobs("retry", *typed, "--yes")

    assert code == 1, out
    assert "1 job to retry" in out
    assert "Retried: 1 job." in out
    assert "Not retried: 9 jobs:" in out
    assert f"  it is succeeded, not failed: #{succeeded.pk}" in out
    assert f"  it is ready, not failed: #{ready.pk}" in out
    assert f"  it is running, not failed: #{running.pk}" in out
    assert f"  there is no such job: #{10**12}" in out
    not_ids = next(line for line in out.splitlines() if line.startswith("  not a job id: "))
    for text in (repr(str(2**70)), "'-5'", "'abc'", "'²'", "(5,000 characters)"):
        assert text in not_ids
    assert len(not_ids) < 200  # 5,000 digits are named, not printed
    # The one failed job was retried; every other row is as it was.
    assert status(retried) == JobStatus.READY
    rows, executions = everything()
    others = [row for row in rows if row["id"] != retried.pk]
    assert others == [row for row in before[0] if row["id"] != retried.pk]
    ready_rows = [row for row in executions["ReadyExecution"] if row["job_id"] != retried.pk]
    assert ready_rows == before[1]["ReadyExecution"]
    assert executions["ClaimedExecution"] == before[1]["ClaimedExecution"]


def test_retry_refused_by_the_operator_says_why_as_the_admin_does():
    """A failed unique job whose key another job took meanwhile: ``retry_failed_job`` says
    no under its lock, and the report gives ``retry_refusal``'s reason."""
    holder = ReadyExecutionFactory(job__unique_key="invoice:7", job__unique_lock="invoice:7").job
    job = failed(unique_key="invoice:7")
    before = everything()
    code, out, _ = jobs("retry", str(job.pk), "--yes")
    assert code == 1
    assert f"  another job holds its unique key: #{job.pk}" in out
    assert everything() == before
    assert status(holder) == JobStatus.READY


def test_a_refused_retry_reads_the_jobs_status_once_after_the_refusal():
    """The status read to explain the refusal is the one ``retry_refusal`` is given."""
    ReadyExecutionFactory(job__unique_key="invoice:8", job__unique_lock="invoice:8")
    job = failed(unique_key="invoice:8")
    with CaptureQueriesContext(connection) as queries:
        outcome = job_actions.retry("default", job.pk)
    assert outcome.refused == "another job holds its unique key"
    # SELECT <the job's status> [AS ...] FROM <the job table>: nothing else selected.
    only_status = re.compile(
        r"SELECT\s+\S*status\W*(\s+AS\s+\S+)?\s+FROM\s+\W?django_jobs_job\W", re.IGNORECASE
    )
    status_reads = [
        q["sql"] for q in queries.captured_queries if only_status.match(q["sql"].strip())
    ]
    assert len(status_reads) == 1, status_reads


def test_retry_by_filters_acts_on_the_matching_failed_jobs_only():
    now = timezone.now()
    hours = timedelta(hours=1)
    target = failed(task_path="app.mail.send", queue_name="mail", finished_at=now - hours)
    sibling = failed(task_path="app.mail.bounce", queue_name="mail", finished_at=now - hours)
    too_old = failed(task_path="app.mail.send", queue_name="mail", finished_at=now - 5 * hours)
    other_queue = failed(task_path="app.mail.send", queue_name="mail-eu", finished_at=now - hours)
    other_case = failed(task_path="app.Mail.send", queue_name="mail", finished_at=now - hours)
    not_failed = FinishedJobFactory(task_path="app.mail.send", queue_name="mail")

    code, out, _ = jobs(
        "retry", "--task", "app.mail.send", "--queue", "mail", "--since", "2h", "--yes"
    )
    assert code == 0, out
    assert f"1 job to retry: #{target.pk}" in out
    assert status(target) == JobStatus.READY
    for job in (sibling, too_old, other_queue, other_case):
        assert status(job) == JobStatus.FAILED
    assert status(not_failed) == JobStatus.SUCCEEDED

    # Prefixes, exact on every database (the case of a letter counts).
    code, out, _ = jobs("retry", "--task", "app.mail.*", "--queue", "mail*", "--yes")
    assert code == 0, out
    assert "Retried: 3 jobs." in out
    for job in (sibling, too_old, other_queue):
        assert status(job) == JobStatus.READY
    assert status(other_case) == JobStatus.FAILED


def test_since_and_until_take_iso_dates_in_the_current_time_zone(settings):
    settings.TIME_ZONE = "Europe/Paris"
    base = timezone.now().replace(year=2026, month=3, day=10, hour=0, minute=0, second=0)
    early = failed(finished_at=base.replace(hour=8))  # 09:00 in Paris
    late = failed(finished_at=base.replace(hour=12))  # 13:00 in Paris
    code, out, _ = jobs(
        "retry", "--since", "2026-03-10T08:30", "--until", "2026-03-10 12:00:00+00:00", "--yes"
    )
    assert code == 0, out
    assert (status(early), status(late)) == (JobStatus.READY, JobStatus.FAILED)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--since", "yesterday"], "--since 'yesterday' is neither a duration"),
        (["--since", "2026-02-30"], "--since '2026-02-30' is not a real date: day is out of"),
        (["--until", "2026-13-01"], "--until '2026-13-01' is not a real date: month must be"),
        (["--since", "2026-02-30T10:00"], "'2026-02-30T10:00' is not a real date and time"),
        (["--since", "0001-01-01T00:00+05:00"], "'0001-01-01T00:00+05:00' is out of range"),
        (["--until", "9999-12-31T23:00-05:00"], "'9999-12-31T23:00-05:00' is out of range"),
        (["--until", "3x"], "--until '3x' is neither a duration"),
        (["--since", "999999999999w"], "reaches back more than a century"),
        (["--since", "1h", "--until", "2h"], "is not before --until"),
        (["--status", "succeeded"], "retry does not act on succeeded jobs; it takes: failed"),
        (["--status", "gone"], "--status 'gone' is no status"),
        (["--task", ""], "--task needs a name"),
        (["--queue", "a*b"], "'*' may only end a prefix"),
        (["--queue", "mail\x00"], "holds a NUL character"),
        (["1", "--task", "app.x"], "give job ids, or filters"),
        ([], "say which jobs to retry"),
    ],
)
def test_what_cannot_be_read_is_a_clear_error_and_changes_nothing(args, message):
    failed(finished_at=timezone.now())
    before = everything()
    with pytest.raises(CommandError, match=re.escape(message)) as exc:
        jobs("retry", *args, "--yes")
    assert exc.value.returncode == 2
    assert everything() == before


@pytest.mark.parametrize(
    "zone, args",
    [
        ("Asia/Tokyo", ["--since", "0001-01-01"]),
        ("America/New_York", ["--until", "9999-12-31T23:00"]),
    ],
)
def test_a_date_at_the_ends_of_the_calendar_in_the_current_time_zone_is_a_clear_error(
    settings, zone, args
):
    """A date with no zone is read in the current one, where the calendar's first or last
    day does not exist in UTC, in which the database is asked."""
    settings.TIME_ZONE = zone
    failed(finished_at=timezone.now())
    before = everything()
    with pytest.raises(CommandError, match="is out of range: in UTC it falls") as exc:
        jobs("retry", *args, "--yes")
    assert exc.value.returncode == USAGE
    assert everything() == before


def test_the_ends_of_the_calendar_in_utc_select_as_any_other_moment():
    job = failed(finished_at=timezone.now())
    code, out, _ = jobs(
        "retry", "--since", "0001-01-01T00:00+00:00", "--until", "9999-12-31T23:59:59Z", "--yes"
    )
    assert code == 0, out
    assert f"1 job to retry: #{job.pk}" in out
    assert status(job) == JobStatus.READY


def test_an_unreadable_batch_size_is_refused_by_the_parser():
    with pytest.raises(CommandError, match="invalid batch size"):
        call_command("jobs", "retry", "--all", "--batch-size", "0", "--yes")


# --- discard and cancel -----------------------------------------------------------------


def test_discard_ends_waiting_and_failed_jobs_and_names_the_others():
    ready = ReadyExecutionFactory().job
    scheduled = ScheduledExecutionFactory().job
    awaiting = AwaitingExecutionFactory().job
    failed_job = failed()
    running = ClaimedExecutionFactory(job__status=JobStatus.RUNNING).job
    succeeded = FinishedJobFactory()
    ids = [ready, scheduled, awaiting, failed_job, running, succeeded]
    code, out, _ = jobs("discard", *(str(job.pk) for job in ids), "--yes")
    assert code == 1, out
    assert "Discarded: 4 jobs." in out
    assert (
        f"  it is running: a claimed or running job is cancelled, not discarded: #{running.pk}"
        in out
    )
    assert f"  it has already ended (succeeded): #{succeeded.pk}" in out
    for job in (ready, scheduled, awaiting, failed_job):
        assert status(job) == JobStatus.DISCARDED
    assert not ReadyExecution.objects.exists() and not ScheduledExecution.objects.exists()
    assert (status(running), status(succeeded)) == (JobStatus.RUNNING, JobStatus.SUCCEEDED)
    assert ClaimedExecution.objects.filter(job=running).exists()


def test_cancel_ends_waiting_jobs_and_asks_running_ones_to_stop():
    ready = ReadyExecutionFactory(job__queue_name="reports").job
    running = ClaimedExecutionFactory(job__status=JobStatus.RUNNING, job__queue_name="reports").job
    elsewhere = ReadyExecutionFactory(job__queue_name="mail").job
    FinishedJobFactory(queue_name="reports")
    code, out, _ = jobs("cancel", "--queue", "reports", "--yes")
    assert code == 0, out
    assert "2 jobs to cancel" in out
    assert "Cancelled: 1 job." in out and "Stop requested: 1 job." in out
    assert status(ready) == JobStatus.FAILED
    assert FailedExecution.objects.get(job=ready).exception_class_path == CANCELLED_ERROR
    running.refresh_from_db()
    assert running.status == JobStatus.RUNNING and running.cancel_requested_at is not None
    assert status(elsewhere) == JobStatus.READY


def test_cancel_of_ended_and_unknown_jobs_names_them():
    succeeded = FinishedJobFactory()
    before = everything()
    code, out, _ = jobs("cancel", str(succeeded.pk), "0", "--yes")
    assert code == 1
    assert "No job to cancel." in out
    assert f"  it has already ended (succeeded): #{succeeded.pk}" in out
    assert "  there is no such job: #0" in out
    assert everything() == before


# --- the dry run and the confirmation ---------------------------------------------------


def test_a_dry_run_lists_what_would_be_done_and_changes_nothing():
    jobs_ = [failed() for _ in range(12)]
    succeeded = FinishedJobFactory()
    before = everything()
    code, out, _ = jobs("retry", "--all", "--dry-run")
    assert code == 0, out
    assert "Dry run: nothing is changed." in out
    listed = ", ".join(f"#{job.pk}" for job in jobs_[:10])
    assert f"Would retry 12 jobs: {listed} and 2 more" in out
    code, out, _ = jobs("retry", str(jobs_[0].pk), str(succeeded.pk), "--dry-run")
    assert code == 1
    assert f"Would retry 1 job: #{jobs_[0].pk}" in out
    assert f"Would not retry: 1 job:\n  it is succeeded, not failed: #{succeeded.pk}" in out
    assert everything() == before


def test_the_confirmation_asks_with_the_count_and_acts_only_on_yes():
    job = failed()
    before = everything()
    code, out, _ = jobs("retry", "--all", stdin="n\n")
    assert code == 3
    assert out.endswith("Retry 1 job? [y/N] Nothing was changed.\n")
    assert everything() == before
    code, out, _ = jobs("retry", "--all", stdin="")  # end of input: no, on a line of its own
    assert code == 3 and everything() == before
    assert out.endswith("Retry 1 job? [y/N] \nNothing was changed.\n")
    code, out, _ = jobs("retry", "--all", stdin="y\n")
    assert code == 0 and "Retry 1 job? [y/N] Retried: 1 job." in out
    assert status(job) == JobStatus.READY


@contextmanager
def ctrl_c_kept_in() -> Iterator[None]:
    """A ``KeyboardInterrupt`` out of the command fails the test, not the whole session."""
    try:
        yield
    except KeyboardInterrupt:
        pytest.fail("the command let the Ctrl-C out")


class CtrlC(StringIO):
    """An answer cut short by Ctrl-C (or by a reader that raises at the end of input)."""

    def __init__(self, raised: type[BaseException]) -> None:
        super().__init__()
        self.raised = raised

    def readline(self, *args: Any) -> str:
        raise self.raised


@pytest.mark.parametrize("raised", [KeyboardInterrupt, EOFError])
def test_ctrl_c_at_the_question_is_no_on_a_line_of_its_own(raised):
    failed()
    before = everything()
    out = StringIO()
    with pytest.raises(CommandError, match="was not yes: nothing was changed") as exc:
        with ctrl_c_kept_in():
            call_command("jobs", "retry", "--all", stdout=out, stdin=CtrlC(raised))
    assert exc.value.returncode == NOT_CONFIRMED
    assert out.getvalue().endswith("Retry 1 job? [y/N] \nNothing was changed.\n")
    assert everything() == before


def test_without_a_terminal_to_ask_on_it_refuses_unless_told_yes():
    job = failed()
    before = everything()
    # pytest's standard input is no terminal, as a cron job's or a pipeline's is not.
    with pytest.raises(CommandError, match="pass --yes") as exc:
        jobs("retry", "--all")
    assert exc.value.returncode == 2
    assert everything() == before
    assert jobs("retry", "--all", "--no-input")[0] == 0
    assert status(job) == JobStatus.READY


def test_ctrl_c_while_acting_reports_what_was_done_and_where_it_stopped(monkeypatch):
    """The interrupt lands in the second job's turn, after its retry committed: the report
    counts the first, names the second as uncertain, and the third is left as it was."""
    first, second, third = failed(), failed(), failed()
    retry = operator.retry_failed_job
    turns: list[int] = []

    def retry_then_ctrl_c(db: str, job_id: int) -> bool:
        turns.append(job_id)
        done = retry(db, job_id)
        if len(turns) == 2:
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(operator, "retry_failed_job", retry_then_ctrl_c)
    with ctrl_c_kept_in():
        code, out, _ = jobs("retry", "--all", "--yes")
    assert code == INTERRUPTED == 130
    assert "Retried: 1 job." in out
    assert (
        f"Interrupted at #{second.pk}, which may or may not have been retried (look at it); "
        "not gone through: 1 job of the 3 selected." in out
    )
    assert turns == [first.pk, second.pk]
    assert [status(job) for job in (first, second, third)] == ["ready", "ready", "failed"]


def test_called_from_code_it_returns_on_success_and_raises_the_exit_status_otherwise():
    """``call_command`` in a shell or a script: exit 0 returns, the others are a
    ``CommandError`` carrying the status; none ends the caller's process."""
    job, succeeded = failed(), FinishedJobFactory()
    out = StringIO()
    assert call_command("jobs", "retry", str(job.pk), yes=True, stdout=out) is None
    assert "Retried: 1 job." in out.getvalue()
    with pytest.raises(CommandError, match=r"not retried: 1 job \(named above\)") as exc:
        call_command("jobs", "retry", str(succeeded.pk), yes=True, stdout=StringIO())
    assert exc.value.returncode == SOME_REFUSED
    assert call_command("jobs", "discard", str(job.pk), dry_run=True, stdout=out) is None
    with pytest.raises(CommandError) as exc:
        call_command("jobs", "discard", str(job.pk), stdout=out, stdin=StringIO("n\n"))
    assert exc.value.returncode == NOT_CONFIRMED


def test_inside_a_transaction_of_the_callers_it_refuses_and_changes_nothing():
    """Each job in a transaction of its own is the lock order's premise (design.md
    section 4): under the caller's ``atomic()`` every job would share one."""
    job = failed()
    before = everything()
    with transaction.atomic():
        with pytest.raises(CommandError, match="call it outside any atomic block") as exc:
            jobs("retry", str(job.pk), "--yes")
    assert exc.value.returncode == USAGE
    assert everything() == before


def test_ids_may_be_separated_by_commas():
    first, second, third = failed(), failed(), failed()
    code, out, _ = jobs("retry", f"{first.pk},#{second.pk}", f"{third.pk},", "x,", "--yes")
    assert code == 1, out
    assert f"3 jobs to retry: #{first.pk}, #{second.pk}, #{third.pk}" in out
    assert "  not a job id: 'x'" in out
    assert {status(job) for job in (first, second, third)} == {JobStatus.READY}


@pytest.mark.parametrize(
    "before_action, after_action",
    [(["-v", "2"], []), ([], ["-v", "2"]), ([], ["--verbosity=2", "--no-color", "--traceback"])],
)
def test_djangos_own_options_go_before_or_after_the_action(before_action, after_action):
    targets = [failed() for _ in range(3)]
    code, out, err = jobs(
        *before_action, "retry", "--all", "--batch-size", "2", "--yes", *after_action
    )
    assert code == 0, out
    assert [line.strip() for line in err.splitlines()] == [
        "2 of 3 jobs gone through",
        "3 of 3 jobs gone through",
    ]
    assert {status(job) for job in targets} == {JobStatus.READY}


# --- batches ----------------------------------------------------------------------------


def test_a_selection_larger_than_a_batch_is_acted_on_completely_in_bounded_reads():
    targets = [failed(queue_name="bulk") for _ in range(23)]
    kept = failed(queue_name="other")
    with CaptureQueriesContext(connection) as queries:
        code, out, err = jobs("retry", "--queue", "bulk", "--batch-size", "5", "--yes", verbosity=2)
    assert code == 0, out
    assert "23 jobs to retry" in out and "Retried: 23 jobs." in out
    assert {status(job) for job in targets} == {JobStatus.READY}
    assert status(kept) == JobStatus.FAILED
    # Five reads of at most five ids each (5, 5, 5, 5, 3), each after the last id read.
    progress = [line.strip() for line in err.splitlines()]
    assert progress == [f"{n} of 23 jobs gone through" for n in (5, 10, 15, 20, 23)]
    reads = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith("SELECT")
        and "LIMIT 5" in q["sql"].upper()
        and "ORDER BY" in q["sql"].upper()
    ]
    assert len(reads) == 5


def test_ids_past_a_batch_are_acted_on_completely():
    targets = [failed() for _ in range(7)]
    code, out, _ = jobs("discard", *(str(job.pk) for job in targets), "--batch-size", "2", "--yes")
    assert code == 0 and "Discarded: 7 jobs." in out
    assert {status(job) for job in targets} == {JobStatus.DISCARDED}


def test_jobs_that_come_to_match_after_the_count_past_the_last_id_are_left_alone():
    """The count asked about bounds the run: a job failing after it, with a higher id, is
    not retried by a confirmation that did not count it."""
    first = failed()

    class AnswerThenFail(StringIO):
        def readline(self, *args: Any) -> str:
            self.late = failed()
            return "y\n"

    answer = AnswerThenFail()
    out = StringIO()
    call_command("jobs", "retry", "--all", stdout=out, stdin=answer)
    assert "Retry 1 job? [y/N] Retried: 1 job." in out.getvalue()
    assert (status(first), status(answer.late)) == (JobStatus.READY, JobStatus.FAILED)


def test_the_report_of_a_large_refusal_stays_short():
    """A thousand unknown ids: each reason lists its first ten, and counts the rest."""
    typed = [str(10**12 + n) for n in range(1000)]
    code, out, _ = jobs("retry", *typed, "--yes")
    assert code == 1
    line = next(line for line in out.splitlines() if "there is no such job" in line)
    assert line.endswith("and 990 more")
    assert len(out) < 1000


# --- a real process: exit codes and the question on a terminal ------------------------------


def command_env() -> dict[str, str]:
    env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1"}
    env.pop("TEST_DATABASE_NAME", None)
    return env


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def on_terminal(*args: str, text: bool = False) -> Iterator[tuple[subprocess.Popen, int]]:
    """``manage.py jobs <args>`` reading a pseudo-terminal (so it may ask), its output piped;
    yields the process and the terminal's other end, to type into."""
    primary, secondary = pty.openpty()
    try:
        yield (
            subprocess.Popen(
                [sys.executable, str(MANAGE), "jobs", *args],
                cwd=REPO_ROOT,
                env=command_env(),
                stdin=secondary,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=text,
                # Ctrl-C as at a terminal, whatever started the tests: a shell's background
                # job (`pytest ... &`) ignores SIGINT, the command inherited that, Python then
                # raised no KeyboardInterrupt, and the Ctrl-C test waited out its 120 s.
                preexec_fn=default_sigint,
            ),
            primary,
        )
    finally:
        os.close(secondary)
        os.close(primary)


def run_command(*args: str, **popen: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(MANAGE), "jobs", *args],
        cwd=REPO_ROOT,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=120,
        **popen,
    )


@pytest.mark.django_db(transaction=True)
def test_a_real_process_exits_with_the_documented_codes_and_asks_on_a_terminal():
    job = failed()
    done = run_command("retry", "--since", "nope", "--yes")
    assert done.returncode == 2, done.stderr
    assert "CommandError: --since 'nope' is neither a duration" in done.stderr
    done = run_command("retry", "--no-such-option")
    assert done.returncode == 2 and "unrecognized arguments" in done.stderr
    done = run_command("retry", "--all", stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "not a terminal" in done.stderr
    done = run_command("retry", "--until", "9999-12-31T23:00-05:00", "--yes")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "is out of range" in done.stderr
    assert status(job) == JobStatus.FAILED

    # On a terminal it asks, and reads the answer from it.
    with on_terminal("retry", "--all", text=True) as (process, primary):
        os.write(primary, b"y\n")
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert f"1 job to retry: #{job.pk}\nRetry 1 job? [y/N] Retried: 1 job.\n" == out
    assert status(job) == JobStatus.READY

    done = run_command("retry", str(job.pk), "--yes")
    assert done.returncode == 1
    assert f"Not retried: 1 job:\n  it is ready, not failed: #{job.pk}\n" in done.stdout
    assert "CommandError: not retried: 1 job (named above)" in done.stderr
    # Django's own options after the action, as before it.
    done = run_command(
        "discard",
        str(job.pk),
        "--yes",
        "--settings",
        "testproject.settings",
        "--no-color",
        "-v",
        "2",
        "--skip-checks",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("Discarded: 1 job.\n") and "1 of 1 jobs gone through" in done.stderr


@pytest.mark.django_db(transaction=True)
def test_ctrl_c_at_the_question_on_a_terminal_exits_3_without_a_traceback():
    job = failed()
    with on_terminal("retry", "--all") as (process, _):
        assert process.stdout is not None
        asked = b""
        while not asked.endswith(b"[y/N] "):  # the question, flushed without a newline
            chunk = os.read(process.stdout.fileno(), 1024)
            assert chunk, f"it ended before asking: {asked!r}"
            asked += chunk
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    assert process.returncode == NOT_CONFIRMED, err
    assert (asked + out).decode().endswith("Retry 1 job? [y/N] \nNothing was changed.\n")
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err
    assert status(job) == JobStatus.FAILED
