"""``manage.py demo``: a tour of django-jobs that runs its jobs and stops by itself.

It migrates, makes sure there is a superuser to look at the admin with, starts a local
stub HTTP server for the async step, enqueues one job (or small group) per feature, says
what to expect of each, then runs ``run_jobs --single-process`` until every job of the
tour has ended, and closes with what happened and where to see it in the admin. Ctrl-C
stops it early, through ``run_jobs``'s own graceful shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import connection, connections
from django.tasks import TaskResult
from django.utils import timezone

from django_jobs import bulk_enqueue, cancel, enqueue_batch, get_workflow, progress, workflow
from django_jobs.conf import JobsSettings
from django_jobs.exceptions import JobAlreadyFinished
from django_jobs.models import FINISHED_STATUSES, Batch, FailedExecution, Job, JobStatus
from django_jobs.runtime.logs import flush_buffered_lines
from testproject.demo import tasks
from testproject.demo.fanout import FanOut, fan_out
from testproject.demo.stub_server import SlowServer

DEFER_SECONDS = 3
WIDTH = 100
ADMIN_URL = "http://127.0.0.1:8000/admin/django_jobs/"
DEMO_USER = ("admin", "admin")
# One short line per log record: in the demo the date and the pid (always this one
# process) only push the message off the screen.
LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")


@dataclass
class Tour:
    """What the demo enqueued, by the feature each job shows."""

    plain: list[TaskResult]
    emails: list[TaskResult]
    retry: TaskResult
    failing: TaskResult
    deferred: TaskResult
    keyed: list[TaskResult]
    unique: list[TaskResult]
    batch_id: int
    rows: list[TaskResult]
    workflow_id: int
    quotes: list[TaskResult]
    cheapest: TaskResult
    export: TaskResult
    slow_sync: TaskResult
    endless_import: TaskResult
    fetches: list[TaskResult]
    started: float = field(default_factory=time.monotonic)

    def job_ids(self) -> set[int]:
        everything = [
            *self.plain,
            *self.emails,
            self.retry,
            self.failing,
            self.deferred,
            *self.keyed,
            *self.unique,
            *self.rows,
            *self.quotes,
            self.cheapest,
            self.export,
            self.slow_sync,
            self.endless_import,
            *self.fetches,
        ]
        return {int(result.id) for result in everything}

    def fetch_ids(self) -> list[int]:
        return sorted(int(result.id) for result in self.fetches)

    def callback_ids(self) -> set[int]:
        """The batch's callback jobs, once its last row has ended and enqueued them."""
        batch = Batch.objects.filter(pk=self.batch_id).first()
        return {int(job_id) for job_id in batch.callback_jobs.values()} if batch else set()

    def unfinished(self) -> int:
        """Jobs of the tour that have not ended; the batch's callback counts before it exists."""
        batch = Batch.objects.filter(pk=self.batch_id).first()
        waiting_for_callback = int(batch is not None and batch.finished_at is None)
        ids = self.job_ids() | self.callback_ids()
        return waiting_for_callback + (
            Job.objects.filter(pk__in=ids).exclude(status__in=FINISHED_STATUSES).count()
        )


def enqueue_tour(server: SlowServer) -> Tour:
    """One job (or small group) per feature; see ``Command.introduce`` for what each shows.
    The async step's fetches ask ``server``, which must run until they have ended."""
    plain = [tasks.add.enqueue(2, 3), tasks.fetch_status.enqueue("https://example.com")]
    emails = bulk_enqueue([(tasks.send_welcome_email, [user_id], {}) for user_id in (1, 2, 3)])
    retry = tasks.flaky_report.enqueue(report_id=7)
    failing = tasks.parse_upload.enqueue("upload.xlsx")
    deferred = tasks.send_reminder.using(
        run_after=timezone.now() + timedelta(seconds=DEFER_SECONDS)
    ).enqueue(user_id=1)
    keyed = [tasks.sync_account.enqueue(account_id=1) for _ in range(2)]
    unique = [tasks.rebuild_index.enqueue(account_id=1) for _ in range(2)]
    batch = enqueue_batch(
        [(tasks.import_row, [row], {}) for row in range(4)],
        on_finish=tasks.import_done,
        description="demo import",
    )
    with workflow("demo price check") as wf:
        quotes = [wf.add(tasks.fetch_quote, shop) for shop in tasks.QUOTES]
        cheapest = wf.add(tasks.pick_cheapest, after=quotes)
    export = tasks.export_orders.enqueue("2026-10")
    slow_sync = tasks.sync_catalogue.enqueue("acme")
    endless_import = tasks.import_products.enqueue("acme")
    fetches = bulk_enqueue(
        [(tasks.fetch_page, [server.url(f"/item/{n}")], {}) for n in range(tasks.FETCHES)]
    )
    return Tour(
        plain=plain,
        emails=emails,
        retry=retry,
        failing=failing,
        deferred=deferred,
        keyed=keyed,
        unique=unique,
        batch_id=batch.id,
        rows=list(batch.results),
        workflow_id=wf.result.id,
        quotes=[quote.result for quote in quotes],
        cheapest=cheapest.result,
        export=export,
        slow_sync=slow_sync,
        endless_import=endless_import,
        fetches=fetches,
    )


class ControlTour:
    """What the demo does while the jobs run: cancels the endless import once it runs,
    says how far the export has got each time its progress changes (``progress()``), and
    when the async fan-out has ended (the log leaves out its starts and finishes, 400 lines)."""

    def __init__(self, tour: Tour, say: Callable[[str], None]) -> None:
        self.tour = tour
        self.say = say
        self.cancelled = False
        self.last_progress: tuple | None = None
        self.fetches_ended = False

    def tick(self) -> None:
        if not self.cancelled and job_row(self.tour.endless_import).status == JobStatus.RUNNING:
            self.cancelled = True
            outcome = cancel(self.tour.endless_import.id)
            self.say(
                f"Demo: cancel(#{self.tour.endless_import.id}) -> {outcome!r}: import_products "
                "is running, so its worker asks it to stop; it sees cancel_requested() and "
                "returns."
            )
        reported = progress(self.tour.export.id)
        if reported is not None:
            seen = (reported.done, reported.message)
            if seen != self.last_progress:
                self.last_progress = seen
                self.say(
                    f"Demo: progress(#{self.tour.export.id}) -> {reported.summary} "
                    f"({reported.message})"
                )
        if not self.fetches_ended:
            fetches = fan_out(self.tour.fetch_ids())
            if (fetch_span := fetches.span) is not None:
                self.fetches_ended = True
                self.say(f"Demo: the fetches have ended: {fetch_figures(fetches, fetch_span)}.")


class DoneWatcher(threading.Thread):
    """Stops ``run_jobs`` once every job of the tour has ended.

    It sends this process the SIGINT a Ctrl-C would: ``run_jobs`` then shuts down
    gracefully through its own signal handling, the one way to stop it that is
    part of its interface, and the demo needs no second way.
    """

    def __init__(
        self,
        tour: Tour,
        default_sigint: Any,
        on_finished: Callable[[], None],
        on_tick: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="demo-done-watcher", daemon=True)
        self.tour = tour
        self.default_sigint = default_sigint
        self.on_finished = on_finished
        self.on_tick = on_tick
        self.finished = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.wait(0.2):
                self.on_tick()
                if self.tour.unfinished() == 0:
                    self.finished.set()
                    self.on_finished()
                    self.stop_run_jobs()
                    return
        finally:
            connection.close()  # this thread's own connection

    def stop_run_jobs(self) -> None:
        # run_jobs installs its handler before it starts a worker, so it is there by the time
        # the jobs have run; this wait only matters if another worker ran them all first.
        while signal.getsignal(signal.SIGINT) is self.default_sigint:
            if self.stop.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGINT)


class Command(BaseCommand):
    help = (
        "A tour of django-jobs: enqueue one job per feature, run them until all have ended "
        "(Ctrl-C stops early), then say what happened and how to see it in the admin."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # Kept so that older instructions still work: the demo always stops when done now.
        parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)

    def say(self, text: str = "", style: Any = None, indent: str = "") -> None:
        """Write and flush, so these lines and the log's stay in order even in a pipe (the
        log's lines logged so far first: its handler writes them from a thread of its own)."""
        flush_buffered_lines()
        if text:
            text = wrap(text, indent, indent + "  ")
        self.stdout.write(style(text) if style else text)
        self.stdout.flush()

    def item(self, label: str, text: str) -> None:
        flush_buffered_lines()
        self.stdout.write(
            textwrap.fill(text, WIDTH, initial_indent=f"  {label:<9} ", subsequent_indent=" " * 12)
        )
        self.stdout.flush()

    def handle(self, *args: Any, **options: Any) -> None:
        began = time.monotonic()
        # Until the tour is over: the async step's fetches ask it.
        with SlowServer(tasks.FETCH_DELAY_SECONDS) as server:
            self.run_tour(began, server)

    def run_tour(self, began: float, server: SlowServer) -> None:
        try:
            call_command("migrate", verbosity=0)
            login = ensure_superuser()
            tour = enqueue_tour(server)
        except KeyboardInterrupt:
            self.say("Stopped before any job ran.")
            return
        self.introduce(tour, server)
        use_short_log_lines(quiet_task=tasks.fetch_page.module_path)
        watcher = DoneWatcher(
            tour,
            signal.getsignal(signal.SIGINT),
            lambda: self.say(
                "Every job of the tour has ended: stopping run_jobs, as Ctrl-C would.",
                self.style.SUCCESS,
            ),
            ControlTour(tour, lambda text: self.say(text, self.style.NOTICE)).tick,
        )
        watcher.start()
        try:
            call_command("run_jobs", single_process=True, verbosity=1)
        finally:
            watcher.stop.set()
            watcher.join()
        dropped = 0
        if watcher.finished.is_set():
            self.say(f"Done in {time.monotonic() - began:.1f} s.", self.style.SUCCESS)
        else:
            # Their stub server stops with the demo: run later, they could only fail.
            dropped = cancel_unfinished(tour.fetch_ids())
            left = tour.unfinished()
            self.say(
                f"Stopped early: {left} job(s) of the tour had not ended. They stay in the "
                "database; run the demo again, or testproject/manage.py run_jobs, to finish them."
                + (
                    f" The {dropped} {plural(dropped, 'fetch', 'fetches')} that had not ended "
                    f"{plural(dropped, 'is', 'are')} cancelled: the stub server they ask stops "
                    "with the demo."
                    if dropped
                    else ""
                ),
                self.style.WARNING,
            )
        self.summarise(tour, server, dropped)
        self.point_to_admin(login)

    def introduce(self, tour: Tour, server: SlowServer) -> None:
        keyed = [job_row(result) for result in tour.keyed]
        first, second = tour.unique
        same = "the same job" if first.id == second.id else "two jobs (unexpected!)"
        rows = ", ".join(f"#{result.id}" for result in tour.rows)
        lines = [
            ("plain", f"#{tour.plain[0].id} add(2, 3), #{tour.plain[1].id} an async task"),
            (
                "priority",
                f"{ids(tour.emails)} send_welcome_email on queue 'emails', priority 10: "
                "they run first",
            ),
            (
                "retry",
                f"#{tour.retry.id} flaky_report fails on attempt 1 and is retried "
                f"{tasks.RETRY_BACKOFF_SECONDS:g} s later; attempt 2 succeeds",
            ),
            (
                "failure",
                f"#{tour.failing.id} parse_upload raises ValueError and has no retry left: FAILED",
            ),
            (
                "deferred",
                f"#{tour.deferred.id} send_reminder with run_after = now + {DEFER_SECONDS} s: "
                "scheduled until then",
            ),
            (
                "keyed",
                f"#{keyed[0].pk} and #{keyed[1].pk} sync_account(account_id=1), key "
                f"'{keyed[0].concurrency_key}' with limit 1: #{keyed[0].pk} is "
                f"{keyed[0].status}, #{keyed[1].pk} is {keyed[1].status} until #{keyed[0].pk} "
                "ends",
            ),
            (
                "unique",
                f"rebuild_index(account_id=1) enqueued twice: {same}, #{first.id}",
            ),
            (
                "batch",
                f"batch #{tour.batch_id}: import_row {rows}; when the last one ends, its "
                "on_finish callback import_done runs, once",
            ),
            (
                "workflow",
                f"workflow #{tour.workflow_id}: fetch_quote {ids(tour.quotes)} run side by side; "
                f"pick_cheapest #{tour.cheapest.id} is {job_row(tour.cheapest).status} until "
                "both have succeeded, then reads what they returned with dependency_results()",
            ),
            (
                "progress",
                f"#{tour.export.id} export_orders reports its progress with set_progress(), "
                f"{len(tasks.EXPORT_STEPS) - 1} steps; the demo reads it with progress() as it "
                "changes",
            ),
            (
                "timeout",
                f"#{tour.slow_sync.id} sync_catalogue has timeout="
                f"{tasks.SYNC_TIMEOUT_SECONDS:g} s and runs longer: interrupted, FAILED with "
                "JobTimeout",
            ),
            (
                "cancel",
                f"#{tour.endless_import.id} import_products runs until cancelled: the demo "
                "cancels it once it runs; it stops by itself, FAILED with JobCancelled, never "
                "retried",
            ),
            (
                "async",
                f"{id_range(tour.fetch_ids())} fetch_page, {len(tour.fetches)} async def jobs, "
                f"each a GET to a stub server on this machine ({server.url('/')}) that answers "
                f"after {tasks.FETCH_DELAY_SECONDS:g} s. {len(tour.fetches)} fetches that each "
                f"wait {tasks.FETCH_DELAY_SECONDS:g} s finish in about a second or two, on one "
                f"event loop, not {len(tour.fetches)} threads (this worker has "
                f"{JobsSettings.load().threads} threads for sync jobs)",
            ),
        ]
        self.say(f"django-jobs demo, on {database_label()}", self.style.MIGRATE_HEADING)
        self.say(f"Enqueued {len(tour.job_ids())} jobs:")
        for label, text in lines:
            self.item(label, text)
        self.say(
            "Running them: run_jobs --single-process, one log line per job event (but the "
            "fetches' starts and ends: the demo says when they have all ended); it stops when "
            "all have ended (Ctrl-C: sooner).",
            self.style.MIGRATE_HEADING,
        )

    def summarise(self, tour: Tour, server: SlowServer, dropped: int) -> None:
        """What came of each step; ``dropped``: the fetches cancelled at an early stop."""
        ids_ = tour.job_ids() | tour.callback_ids()
        jobs = {job.pk: job for job in Job.objects.filter(pk__in=ids_)}
        counts: dict[str, int] = {}
        for job in jobs.values():
            counts[job.status] = counts.get(job.status, 0) + 1
        order = [status.value for status in JobStatus]
        by_status = ", ".join(
            f"{status} {counts[status]}" for status in sorted(counts, key=order.index)
        )
        self.say(f"Jobs by status: {by_status}", self.style.MIGRATE_HEADING)

        def ran(job_id: Any) -> Job | None:
            job = jobs.get(int(job_id))
            return job if job is not None and job.status in FINISHED_STATUSES else None

        notes = []
        if retry := ran(tour.retry.id):
            errors = list(
                FailedExecution.objects.filter(job_id=retry.pk).values_list(
                    "attempt", "exception_class_path"
                )
            )
            failed = ", ".join(f"attempt {n}: {path.rsplit('.', 1)[-1]}" for n, path in errors)
            outcome = f"{retry.status} after {retry.attempts} attempt(s) ({failed})"
            notes.append(("retry", f"#{retry.pk} {outcome}"))
        if failing := ran(tour.failing.id):
            notes.append(("failure", f"#{failing.pk} {failing.status}: its traceback is stored"))
        if deferred := ran(tour.deferred.id):
            assert deferred.started_at is not None
            waited = (deferred.started_at - deferred.enqueued_at).total_seconds()
            notes.append(("deferred", f"#{deferred.pk} started {waited:.1f} s after its enqueue"))
        keyed = [ran(result.id) for result in tour.keyed]
        if all(keyed):
            spans = "; ".join(f"#{job.pk} ran {span(job)}" for job in keyed if job)
            notes.append(("keyed", f"{spans}: one at a time"))
        callbacks = [ran(job_id) for job_id in tour.callback_ids()]
        if callbacks and all(callbacks):
            callback = callbacks[0]
            assert callback is not None
            notes.append(("batch", f"callback #{callback.pk} ran once: {callback.return_value!r}"))
        quotes = [ran(result.id) for result in tour.quotes]
        if (cheapest := ran(tour.cheapest.id)) and all(quotes):
            last = max(job.finished_at for job in quotes if job and job.finished_at)
            assert cheapest.started_at is not None
            waited = (cheapest.started_at - last).total_seconds()
            status = get_workflow(tour.workflow_id).status
            notes.append(
                (
                    "workflow",
                    f"#{cheapest.pk} started {waited:.1f} s after the last quote: "
                    f"{cheapest.return_value!r}; workflow #{tour.workflow_id} {status}",
                )
            )
        if export := ran(tour.export.id):
            reported = progress(export.pk)
            told = f"{reported.summary} ({reported.message})" if reported else "nothing"
            notes.append(("progress", f"#{export.pk} {export.status}; progress() reads {told}"))
        for label, job_id in (("timeout", tour.slow_sync.id), ("cancel", tour.endless_import.id)):
            if job := ran(job_id):
                notes.append((label, f"#{job.pk} {job.status}: {last_error(job)}"))
        fetches = fan_out(tour.fetch_ids())
        if (fetch_span := fetches.span) is not None and not dropped:
            text = (
                f"{fetch_figures(fetches, fetch_span)}; one after another they would have taken "
                f"{fetches.total * tasks.FETCH_DELAY_SECONDS:g} s. The stub server held up to "
                f"{server.peak} requests at once."
            )
        else:
            text = (
                f"{fetches.succeeded} of {fetches.total} fetches succeeded before the demo stopped"
            )
            if dropped:
                text += f", {dropped} {plural(dropped, 'was', 'were')} cancelled as it stopped"
        notes.append(("async", text))
        for label, text in notes:
            self.item(label, text)

    def point_to_admin(self, login: str) -> None:
        python = shell_path(sys.executable)
        manage = shell_path(Path(settings.BASE_DIR) / "manage.py")
        url = os.environ.get("DATABASE_URL")
        prefix = f"DATABASE_URL={url} " if url else ""
        self.say("See it all in the admin:", self.style.MIGRATE_HEADING)
        self.stdout.write(f"  {prefix}{python} {manage} runserver")
        self.say(f"then open {ADMIN_URL} and log in {login}.", indent="  ")
        self.say(
            "Dashboard: counts per queue. Jobs: filter by status; a job's page lists every "
            "failed attempt with its traceback (the retry's and the failure's, the timeout's "
            "and the cancel's), shows the progress its task reported, and has a Cancel button "
            "while the job waits or runs. Batches: the import and its callback. Workflows: "
            "the price check and its graph. Processes: empty again, the worker has stopped.",
            indent="  ",
        )
        self.say(
            "The fetches, each with when it started and finished and what it returned: "
            f"{ADMIN_URL}job/?task_path={tasks.fetch_page.module_path}",
            indent="  ",
        )


def wrap(text: str, first: str, rest: str) -> str:
    """Lines of at most ``WIDTH``, never breaking a path or a key in two."""
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def ensure_superuser() -> str:
    """Someone to log in to the admin as; creates ``admin``/``admin`` when there is nobody."""
    user_model = get_user_model()
    username, password = DEMO_USER
    user = user_model.objects.filter(username=username, is_superuser=True).first()
    if user is not None and user.check_password(password):
        return f"as {username} / {password}"
    superusers = list(
        user_model.objects.filter(is_superuser=True).values_list("username", flat=True)[:3]
    )
    if superusers:
        return f"as your superuser ({', '.join(superusers)})"
    user_model.objects.create_superuser(username, f"{username}@example.com", password)
    return f"as {username} / {password} (a superuser the demo created)"


def use_short_log_lines(quiet_task: str) -> None:
    """Short lines, on standard output (in order with the demo's own lines), without the
    start and finish lines of ``quiet_task``'s jobs (the fan-out's: hundreds of them)."""
    quiet = QuietStartsAndFinishes(quiet_task)
    for name in ("django_jobs", "testproject"):
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(LOG_FORMAT)
            handler.addFilter(quiet)
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stdout)


class QuietStartsAndFinishes(logging.Filter):
    """Drops the worker's "job started" and "job finished" lines of one task's jobs; its
    failures, and every other line, still show."""

    def __init__(self, task_path: str) -> None:
        super().__init__()
        self.routine = (f"job started task={task_path} ", f"job finished task={task_path} ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.name == "django_jobs.worker" and record.getMessage().startswith(self.routine)
        )


def cancel_unfinished(job_ids: list[int]) -> int:
    """Cancel those of ``job_ids`` that have not ended; how many were cancelled."""
    cancelled = 0
    waiting = Job.objects.filter(pk__in=job_ids).exclude(status__in=FINISHED_STATUSES)
    for job_id in waiting.values_list("pk", flat=True):
        try:
            cancel(job_id)
        except JobAlreadyFinished:  # it ended in between
            continue
        cancelled += 1
    return cancelled


def fetch_figures(fetches: FanOut, span: float) -> str:
    """'200 of 200 succeeded, 1.3 s from the first start to the last end, up to 200 at once'."""
    return (
        f"{fetches.succeeded} of {fetches.total} succeeded, {span:.1f} s from the "
        f"first start to the last end (their started_at and finished_at), up to "
        f"{fetches.peak} running at once"
    )


def plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def id_range(job_ids: list[int]) -> str:
    """'#23 to #222' for consecutive ids, else the first and last with the count."""
    if not job_ids:
        return "no jobs"
    first, last = job_ids[0], job_ids[-1]
    if last - first + 1 == len(job_ids):
        return f"#{first} to #{last}"
    return f"{len(job_ids)} jobs, #{first} to #{last}"


def job_row(result: TaskResult) -> Job:
    return Job.objects.get(pk=int(result.id))


def last_error(job: Job) -> str:
    """``JobTimeout (timed out: ...)``: the class and message of the job's last failure."""
    failure = FailedExecution.objects.filter(job_id=job.pk).order_by("-attempt", "-pk").first()
    if failure is None:
        return "no error recorded"
    name = failure.exception_class_path.rsplit(".", 1)[-1]
    return f"{name} on attempt {failure.attempt} of {job.max_attempts} ({failure.message})"


def ids(results: list[TaskResult]) -> str:
    return ", ".join(f"#{result.id}" for result in results)


def span(job: Job) -> str:
    def clock(moment: datetime | None) -> str:
        return f"{timezone.localtime(moment):%H:%M:%S.%f}"[:-3] if moment else "?"

    return f"{clock(job.started_at)}-{clock(job.finished_at)}"


def database_label() -> str:
    db = connections["default"].settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"SQLite ({shell_path(db['NAME'])}; set DATABASE_URL for another database)"
    return f"{connections['default'].display_name} ({db['NAME']})"


def shell_path(path: str | Path) -> str:
    """``path`` relative to the current directory when it is inside it, else absolute."""
    absolute = Path(path).absolute()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)
