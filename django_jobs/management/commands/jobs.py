"""``manage.py jobs``: the state of the queues in a terminal, or as JSON for scripts; and
``manage.py jobs retry|discard|cancel``, the admin's bulk actions over a selection of jobs
(docs/admin.md, "In a terminal").

Every value a job or a process brought (a queue, a key, a task path, a host, a progress
message) is printed through ``printable``: a newline in it cannot forge a line of the
report, nor an escape sequence rewrite the operator's terminal.
"""

from __future__ import annotations

import json
import sys
from argparse import SUPPRESS
from collections.abc import Iterator
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.core.progress import summary
from django_jobs.management.job_actions import (
    ACTIONS,
    IDS_LISTED,
    NOT_AN_ID,
    Action,
    Tally,
    job_name,
    listed,
    plural,
    refusal,
)
from django_jobs.management.selection import (
    Filters,
    SelectionError,
    TypedIds,
    chunks,
    count_and_last,
    id_batches,
    parse_pattern,
    parse_when,
    printable_arg,
)
from django_jobs.models import Job, JobStatus, Process
from django_jobs.observability import inspection
from django_jobs.observability.inspection import (
    COUNT_CAP,
    STATES,
    WORKFLOWS_SHOWN,
    FairGroup,
    FairQueue,
    ProcessInfo,
    Snapshot,
    snapshot,
)
from django_jobs.text import printable

# Exit codes of retry, discard and cancel (docs/admin.md): every selected job acted on (or
# would be, in a dry run); some could not be (they are named); the command line could not be
# read, or the confirmation could not be asked; the operator answered no; the run was
# interrupted (Ctrl-C) after it began to act, the shell's code for SIGINT. From code
# (``call_command``) the command returns for 0 and raises ``CommandError`` with the code as
# its ``returncode`` for the others: it never ends the caller's process.
ALL_DONE, SOME_REFUSED, USAGE, NOT_CONFIRMED, INTERRUPTED = 0, 1, 2, 3, 130
DEFAULT_BATCH_SIZE = 1000
MAX_BATCH_SIZE = 10_000
FILTERS = ("task", "queue", "status", "since", "until")
PROCESS_COLUMNS = [
    "kind",
    "host",
    "pid",
    "heartbeat",
    "state",
    "async",
    "loop stalls",
    "running jobs",
]


def batch_size(text: str) -> int:
    """``--batch-size``: jobs read (and acted on, one by one) per batch."""
    try:
        size = int(text)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_BATCH_SIZE:
        raise ValueError(text)
    return size


batch_size.__name__ = f"batch size (1 to {MAX_BATCH_SIZE:,})"  # argparse's error names it


class Command(BaseCommand):
    help = (
        "Show per-queue counts, blocked concurrency keys, the fair queues' largest groups, "
        "stuck jobs, live processes, the progress of running jobs and the latest workflows; "
        "or retry, discard or cancel jobs (jobs retry --help)."
    )
    # call_command(..., stdin=StringIO("y\n")): the confirmation's answer, in tests.
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print one JSON document.")
        actions = parser.add_subparsers(
            dest="action",
            title="actions",
            metavar="{retry,discard,cancel}",
            help="Act on the jobs selected, as the admin's actions do; without one, show the "
            "overview.",
        )
        for action in ACTIONS.values():
            subparser = actions.add_parser(
                action.name,
                help=ACTION_HELP[action.name],
                description=ACTION_HELP[action.name] + SELECTION_HELP,
            )
            add_base_arguments(subparser, parser)
            add_action_arguments(subparser, action)

    def handle(self, *args: Any, **options: Any) -> None:
        if options.get("action"):
            if options["json"]:
                raise CommandError(
                    "--json prints the overview; it does not go with an action", returncode=USAGE
                )
            self.act(ACTIONS[options["action"]], options)
            return
        state = snapshot()
        if options["json"]:
            self.stdout.write(json.dumps(state.as_json(), indent=2, sort_keys=True))
            return
        self.render(state)

    def render(self, state: Snapshot) -> None:
        """The snapshot as text, one section per part of the queue."""
        for section in (
            self.render_queues,
            self.render_blocked_keys,
            self.render_fair_queues,
            self.render_stuck,
            self.render_processes,
            self.render_progress,
            self.render_workflows,
        ):
            section(state)

    def render_queues(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING(f"Queues (at {state.taken_at:%Y-%m-%d %H:%M:%S %Z})"))
        header = ["queue", *STATES]
        rows = [
            [
                printable(queue) + (" (paused)" if queue in state.paused else ""),
                *map(str, counts.values()),
            ]
            for queue, counts in state.queues.items()
        ]
        out(table(header, rows) if rows else "  no jobs")
        since = state.finished_since
        if since is not None and state.finished_minutes < 60:
            out(
                f"  failed_last_hour, finished_last_hour: since {since:%H:%M %Z} only (the "
                f"latest {state.finished_minutes} min): the hour held more than "
                f"{inspection.QUEUE_ROWS_READ:,} finished jobs, as many as are read for "
                "their queue"
            )

    def render_blocked_keys(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Blocked concurrency keys"))
        key_rows = [
            [
                printable(key.key),
                str(key.limit),
                str(key.holders),
                str(key.blocked),
                f"{key.oldest_blocked_at:%Y-%m-%d %H:%M:%S}" if key.oldest_blocked_at else "",
            ]
            for key in state.blocked_keys
        ]
        out(
            table(["key", "limit", "holders", "blocked", "oldest blocked"], key_rows)
            if key_rows
            else "  none"
        )
        total = state.blocked_key_count
        if total > len(key_rows):
            in_all = f"more than {COUNT_CAP:,}" if total > COUNT_CAP else f"{total:,}"
            out(
                f"  ... the first {len(key_rows):,} of {in_all} keys (by name); the admin's "
                "blocked page lists every key"
            )

    def render_fair_queues(self, state: Snapshot) -> None:
        """Each fair queue's groups with the most ready jobs, and their shares of the recent
        starts (``inspection.fair_groups``); no section when no queue is fair."""
        if not state.fair_queues:
            return
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Fair queues (the groups with the most ready jobs)"))
        for found in state.fair_queues:
            among = f" among the next {found.ready_read:,}" if found.ready_capped else ""
            cut = " (the latest only)" if found.starts_cut else ""
            out(
                f"  {printable(found.queue)}: {found.ready_text} ready, "
                f"{found.groups_seen:,} group{'' if found.groups_seen == 1 else 's'}{among}; "
                f"{found.starts:,} recent starts: running, or finished since "
                f"{found.starts_since:%H:%M %Z}{cut}"
            )
            rows = [fair_row(found, group.key or "(no key)", group) for group in found.groups]
            others = found.groups_seen - len(found.groups)
            if found.other_ready or found.other_starts:
                rows.append(
                    fair_row(
                        found,
                        f"({others:,} other groups)" if others else "(other groups)",
                        None,
                        found.other_ready,
                        found.other_starts,
                    )
                )
            if found.ungrouped_ready or found.ungrouped_starts:
                rows.append(
                    fair_row(
                        found,
                        "(no group: enqueued before the queue was fair)",
                        None,
                        found.ungrouped_ready,
                        found.ungrouped_starts,
                    )
                )
            header = ["group", "ready", "starts", "share", "turns queued"]
            out(table(header, rows) if rows else "    no job ready or started lately")

    def render_stuck(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Stuck jobs"))
        for kind, job_ids in state.stuck.items():
            label = kind.replace("_", " ")
            listed = ", ".join(map(str, job_ids[:10])) + (" ..." if len(job_ids) > 10 else "")
            line = f"  {label}: {len(job_ids)}" + (f"  [{listed}]" if job_ids else "")
            out(self.style.WARNING(line) if job_ids else line)

    def render_processes(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Processes"))
        proc_rows = [
            [
                printable(p.kind),
                printable(p.hostname),
                str(p.pid),
                f"{p.last_heartbeat_at:%H:%M:%S}",
                "alive" if p.alive else "DEAD",
                async_capacity(p),
                loop_stalls(p),
                ", ".join(map(str, p.running_jobs)),
            ]
            for p in state.processes
        ]
        out(table(PROCESS_COLUMNS, proc_rows) if proc_rows else "  none running")
        for p in state.processes:
            if p.alive and p.loop_stalls:
                out(
                    self.style.WARNING(
                        f"  {printable(p.name)}: its event loop was blocked "
                        f"{p.loop_stalls:,} time{'' if p.loop_stalls == 1 else 's'}"
                        f"{stalled_for(p)} since it started: an async job did blocking work "
                        "and every other async job of the process waited (its log names the "
                        "job; do such work in a sync task or through sync_to_async)"
                    )
                )

    def render_progress(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING("Progress of running jobs"))
        progress_rows = [
            [
                str(p.job_id),
                printable(p.task_path),
                summary(p.done, p.total),
                f"{p.updated_at:%H:%M:%S}",
                printable(p.message),
            ]
            for p in state.progress
        ]
        out(
            table(["job", "task", "progress", "reported", "message"], progress_rows)
            if progress_rows
            else "  none reported"
        )

    def render_workflows(self, state: Snapshot) -> None:
        out = self.stdout.write
        out(self.style.MIGRATE_HEADING(f"Workflows (the latest {WORKFLOWS_SHOWN})"))
        rows = [
            [
                str(w.id),
                printable(w.name) or "-",
                w.status,
                f"{w.total - w.unfinished}/{w.total}",
                f"{w.created_at:%Y-%m-%d %H:%M:%S}" if w.created_at else "",
            ]
            for w in state.workflows
        ]
        out(table(["id", "name", "status", "done", "created"], rows) if rows else "  none")
        if len(rows) >= WORKFLOWS_SHOWN:
            out("  ... the admin's workflows page lists every workflow")

    # --- retry, discard, cancel ------------------------------------------------------------

    def act(self, action: Action, options: dict[str, Any]) -> None:
        """Select, show, confirm, act in batches, report; end with the codes above."""
        db = JobsSettings.load().database
        refuse_callers_transaction(db, action)
        size = options["batch_size"]
        tally = Tally()
        if options["job_ids"]:
            refuse_filters(options)
            count, first, batches = self.survey_ids(db, action, options["job_ids"], size, tally)
        else:
            jobs = filters(action, options).queryset(db)
            # The largest id counted bounds the run: a job that comes to match later, with
            # a higher id, is not acted on under a confirmation that did not count it.
            count, last = count_and_last(jobs)
            first = list(
                jobs.filter(pk__lte=last or 0)
                .order_by("pk")
                .values_list("pk", flat=True)[:IDS_LISTED]
            )
            batches = id_batches(jobs, size, last) if count else iter(())
        out = self.stdout.write
        if options["dry_run"]:
            out("Dry run: nothing is changed.")
            described = f": {listed(first, count)}" if count else ""
            out(f"{action.would.capitalize()} {plural(count)}{described}")
            self.finish(action, tally, would=True)
            return
        if not count:
            out(f"No job to {action.name}.")
            self.finish(action, tally)
            return
        out(f"{plural(count)} to {action.name}: {listed(first, count)}")
        if not options["yes"]:
            self.confirm(action, count, options)
        done = 0
        in_hand: int | None = None  # the job being acted on, while it is
        try:
            for batch in batches:
                for job_id in batch:
                    in_hand = job_id
                    tally.add(action.act(db, job_id), job_name(job_id))
                    done += 1
                    in_hand = None
                if options["verbosity"] >= 2:
                    self.stderr.write(f"  {done:,} of {count:,} jobs gone through")
        except KeyboardInterrupt:
            self.interrupted(action, tally, done, count, in_hand)
        self.finish(action, tally)

    def survey_ids(
        self, db: str, action: Action, texts: list[str], size: int, tally: Tally
    ) -> tuple[int, list[int], Iterator[list[int]]]:
        """The ids typed: those whose job is in a state the action takes (to act on), and
        the others in ``tally`` with why, before anything is changed."""
        typed = TypedIds.parse(texts)
        for text in typed.not_ids:
            tally.refuse(NOT_AN_ID, printable(printable_arg(text, 30)))
        chosen: list[int] = []
        for batch in chunks(typed.ids, size):
            found = dict(Job.objects.using(db).filter(pk__in=batch).values_list("pk", "status"))
            for job_id in batch:
                status = found.get(job_id)
                if status in action.accepts:
                    chosen.append(job_id)
                else:
                    tally.refuse(refusal(action, status), job_name(job_id))
        return len(chosen), chosen[:IDS_LISTED], chunks(tuple(chosen), size)

    def confirm(self, action: Action, count: int, options: dict[str, Any]) -> None:
        """Ask before acting; never guess for a script (no terminal: an error)."""
        stdin = options.get("stdin")
        question = f"{action.verb} {plural(count)}?"
        if stdin is None:
            if not sys.stdin.isatty():
                raise CommandError(
                    f"{question} The standard input is not a terminal to ask on: pass --yes "
                    "to act without asking, or --dry-run to see what would be done. Nothing "
                    "was changed.",
                    returncode=USAGE,
                )
            stdin = sys.stdin
        try:
            # The question too: a Ctrl-C as soon as it shows may land before the read.
            self.stdout.write(f"{question} [y/N] ", ending="")
            self.stdout.flush()
            answer = stdin.readline()
        except (KeyboardInterrupt, EOFError):
            answer = ""  # Ctrl-C (or Ctrl-D where reading raises): no
        if answer.strip().lower() in ("y", "yes"):
            return
        if not answer.endswith("\n"):
            # Nothing the terminal echoed ended the prompt's line (end of input, Ctrl-C).
            self.stdout.write("")
        self.stdout.write("Nothing was changed.")
        raise CommandError(
            f"the answer to {question!r} was not yes: nothing was changed",
            returncode=NOT_CONFIRMED,
        )

    def interrupted(
        self, action: Action, tally: Tally, done: int, count: int, in_hand: int | None
    ) -> NoReturn:
        """Ctrl-C while acting: what was done up to there, and where it stopped. The job
        in hand was acted on whole or not at all (its own transaction), but whether it
        committed before the interrupt cannot be told from here."""
        self.stdout.write("")  # past the ^C the terminal echoed
        self.report(action, tally)
        left = count - done - (in_hand is not None)
        where = ""
        if in_hand is not None:
            where = (
                f" at {job_name(in_hand)}, which may or may not have been "
                f"{action.past.removeprefix('not ')} (look at it)"
            )
        self.stdout.write(
            self.style.WARNING(
                f"Interrupted{where}; not gone through: {plural(max(left, 0))} of the "
                f"{count:,} selected."
            )
        )
        raise CommandError(f"interrupted after {done:,} of {count:,} jobs", returncode=INTERRUPTED)

    def finish(self, action: Action, tally: Tally, would: bool = False) -> None:
        """What was done (or would be), the jobs that were not and why; return for exit
        0, else raise the exit status (``CommandError``'s ``returncode``)."""
        self.report(action, tally, would)
        if tally.refused:
            label = f"would not {action.name}" if would else action.past
            raise CommandError(
                f"{label}: {plural(tally.refused_count)} (named above)", returncode=SOME_REFUSED
            )

    def report(self, action: Action, tally: Tally, would: bool = False) -> None:
        out = self.stdout.write
        for outcome, count in tally.done.items():
            out(self.style.SUCCESS(f"{outcome.capitalize()}: {plural(count)}."))
        if tally.refused:
            label = f"would not {action.name}" if would else action.past
            out(self.style.WARNING(f"{label.capitalize()}: {plural(tally.refused_count)}:"))
            for line in tally.refused_lines():
                out(line)


ACTION_HELP = {
    "retry": "Give failed jobs one more attempt (the admin's Retry).",
    "discard": "Discard waiting or failed jobs (the admin's Discard); never a running one.",
    "cancel": "Cancel waiting jobs at once, and ask running ones to stop (the admin's Cancel).",
}
SELECTION_HELP = (
    " Select jobs by id, or by filters (--task, --queue, --status, --since, --until), or all "
    "the action can take (--all). Each job is acted on in its own transaction, by the "
    "function the admin's action calls. Exit status: 0 if every job selected was acted on, "
    "1 if some were not (they are named), 2 for a command line that cannot be read, 3 if the "
    "answer to the confirmation was no, 130 if interrupted (Ctrl-C) while acting."
)


# Django's own options, as ``BaseCommand.create_parser`` adds them to the command's parser
# (but --version, which is the command's, not an action's).
BASE_OPTIONS = frozenset(
    {"--verbosity", "--settings", "--pythonpath", "--traceback", "--no-color", "--force-color"}
    | {"--skip-checks"}
)


def add_base_arguments(subparser: CommandParser, parser: CommandParser) -> None:
    """Django's own options on an action too, so that they may follow it
    (``jobs retry 14 -v 2 --settings ...``) as well as precede it.

    Each is copied from the command's parser, where ``create_parser`` put them before
    ``add_arguments``, so an option Django leaves out (``--skip-checks`` for a command
    without checks) or hides (``suppressed_base_arguments``) is left out or hidden here
    too. Their default is ``SUPPRESS``: argparse copies every value an action's parser
    holds over the command's, and a default here would undo ``jobs -v 2 retry``.
    """
    for base in parser._actions:  # argparse keeps no public list of a parser's options
        if not BASE_OPTIONS.intersection(base.option_strings):
            continue
        kwargs: dict[str, Any] = {"dest": base.dest, "help": base.help, "default": SUPPRESS}
        if base.nargs == 0:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=base.type, choices=base.choices, metavar=base.metavar)
        subparser.add_argument(*base.option_strings, **kwargs)


def add_action_arguments(parser: CommandParser, action: Action) -> None:
    accepted = ", ".join(sorted(action.accepts))
    parser.add_argument(
        "job_ids",
        nargs="*",
        metavar="ID",
        help="Job ids (not with filters), separated by spaces or commas (4512 4513, "
        "4512,4513). One that is not a job's, or not in a state the action takes, is named "
        "in the report.",
    )
    parser.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="PATH",
        help="Jobs of this task (a dotted path), or of every task whose path starts with "
        "PREFIX given as 'PREFIX*'. Repeat for several.",
    )
    parser.add_argument(
        "--queue",
        action="append",
        default=[],
        metavar="NAME",
        help="Jobs of this queue, or 'PREFIX*'. Repeat for several.",
    )
    parser.add_argument(
        "--status",
        action="append",
        default=[],
        metavar="STATUS",
        help=f"Jobs in this status (comma-separated or repeated), of: {accepted} (the "
        "default: all of them).",
    )
    for name, side in (("--since", "at or after"), ("--until", "before")):
        parser.add_argument(
            name,
            metavar="WHEN",
            help=f"Jobs that failed (or ended), else were enqueued, {side} WHEN: a duration "
            "ago (90s, 30m, 2h, 3d, 1w) or an ISO 8601 date or date and time (in the "
            "current time zone unless it names one).",
        )
    parser.add_argument(
        "--all",
        action="store_true",
        dest="all_jobs",
        help=f"Every job in a status the action takes ({accepted}), with no other filter.",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="Say what would be done, and change nothing.",
    )
    parser.add_argument(
        "--yes",
        "--no-input",
        "--noinput",
        action="store_true",
        dest="yes",
        help="Act without asking for confirmation (for scripts).",
    )
    parser.add_argument(
        "--batch-size",
        type=batch_size,
        default=DEFAULT_BATCH_SIZE,
        help=f"Jobs read per batch (default {DEFAULT_BATCH_SIZE:,}, at most "
        f"{MAX_BATCH_SIZE:,}); each job is still its own transaction.",
    )


def refuse_callers_transaction(db: str, action: Action) -> None:
    """Refuse to run inside a transaction of the caller's (``call_command`` within
    ``transaction.atomic()``, or with autocommit off): every job would then share it, a
    retry locking a job's row after another job's semaphore, against the lock order
    (docs/design.md section 4), and nothing would be committed before the caller's
    commit. A test case's own transaction is let through, as Django lets a
    ``durable=True`` block through it."""
    connection = connections[db]
    blocks = connection.atomic_blocks
    if blocks and getattr(blocks[-1], "_from_testcase", False):
        return
    if connection.in_atomic_block or not connection.get_autocommit():
        raise CommandError(
            f"jobs {action.name} acts on each job in a transaction of its own; inside a "
            f"transaction of the caller's (transaction.atomic() on the database {db!r}) they "
            "would all share it: call it outside any atomic block. Nothing was changed.",
            returncode=USAGE,
        )


def refuse_filters(options: dict[str, Any]) -> None:
    if options["all_jobs"] or any(options[name] for name in FILTERS):
        raise CommandError(
            "give job ids, or filters (--task, --queue, --status, --since, --until) or "
            "--all, not both",
            returncode=USAGE,
        )


def filters(action: Action, options: dict[str, Any]) -> Filters:
    """The filters typed, checked; a ``CommandError`` names what cannot be read."""
    if not options["all_jobs"] and not any(options[name] for name in FILTERS):
        raise CommandError(
            f"say which jobs to {action.name}: job ids, filters (--task, --queue, --status, "
            "--since, --until), or --all",
            returncode=USAGE,
        )
    now = timezone.now()
    try:
        chosen = Filters(
            statuses=statuses(action, options["status"]),
            tasks=tuple(parse_pattern(text, "--task") for text in options["task"]),
            queues=tuple(parse_pattern(text, "--queue") for text in options["queue"]),
            since=parse_when(options["since"], "--since", now) if options["since"] else None,
            until=parse_when(options["until"], "--until", now) if options["until"] else None,
        )
    except SelectionError as exc:
        raise CommandError(printable(str(exc)), returncode=USAGE) from exc
    if chosen.since and chosen.until and chosen.since >= chosen.until:
        raise CommandError(
            f"--since ({chosen.since.isoformat()}) is not before --until "
            f"({chosen.until.isoformat()}): no job can match",
            returncode=USAGE,
        )
    return chosen


def statuses(action: Action, typed: list[str]) -> frozenset[str]:
    """``--status`` values (comma-separated or repeated), each one the action takes."""
    names = {name.strip() for value in typed for name in value.split(",") if name.strip()}
    if not names:
        return action.accepts
    accepted = ", ".join(sorted(action.accepts))
    for name in sorted(names):
        if name not in JobStatus.values:
            raise SelectionError(
                f"--status {printable_arg(name)} is no status; {action.name} takes: {accepted}"
            )
        if name not in action.accepts:
            raise SelectionError(f"{action.name} does not act on {name} jobs; it takes: {accepted}")
    return frozenset(names)


def async_capacity(process: ProcessInfo) -> str:
    """A worker's ``async def`` jobs at once ("0": they run on its threads; "?": its row does
    not say); empty for the other kinds."""
    if process.kind != Process.Kind.WORKER:
        return ""
    return "?" if process.async_jobs is None else f"{process.async_jobs:,}"


def loop_stalls(process: ProcessInfo) -> str:
    """A worker's event loop stalls and their seconds ("3 (4.2 s)"; "?" for a figure its
    row does not hold as a number); empty for the other kinds."""
    if process.kind != Process.Kind.WORKER:
        return ""
    if process.loop_stalls is None:
        return "?"
    if not process.loop_stalls:
        return "0"
    seconds = process.loop_stalled_seconds
    return f"{process.loop_stalls:,} ({'?' if seconds is None else f'{seconds:,.1f}'} s)"


def stalled_for(process: ProcessInfo) -> str:
    """ ", 4.2 s in all" for the warning line; nothing when the seconds are unknown."""
    seconds = process.loop_stalled_seconds
    return "" if seconds is None else f", {seconds:,.1f} s in all"


def fair_row(
    found: FairQueue,
    label: str,
    group: FairGroup | None,
    ready: int = 0,
    starts: int = 0,
) -> list[str]:
    """A row of a fair queue's table: a group's (``label`` its key), or the other groups'
    or the ungrouped jobs' figures."""
    if group is not None:
        ready, starts = group.ready, group.starts
    turns = group.turns_queued if group is not None else None
    return [
        printable(label),
        f"{ready:,}",
        f"{starts:,}",
        f"{starts / found.starts:.1%}" if found.starts else "-",
        "-" if turns is None else f"{turns:,.1f}",
    ]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    ]
    return "\n".join(lines)
