"""The job list's search box: a small syntax whose every form is answered from an index, and
one bounded scan for the rest (docs/admin.md, "Searching the job list").

    123  #123  id:123        the job of that id
    task:shop.tasks.sync     task paths starting with the text
    queue:emails             that queue (exact)
    key:account:42           that concurrency key or unique key (exact)
    key:account:*            keys starting with ``account:`` (the newest jobs only)
    workflow:12  batch:7     the jobs of that workflow, of that batch
    customer_id=4242         a keyword argument equal to the value (4242 or "4242")
    arg:4242                 any argument, positional or keyword, equal to the value
    text:needle              text anywhere in the arguments (the newest jobs only)
    anything else            a task path prefix, a queue, a concurrency or unique key

Why: a job table holds tens of millions of finished jobs, and the old search (any text,
``icontains`` over the arguments' JSON) read all of them, seconds per search. Each form here
is a lookup on an index of ``Job`` (the primary key, ``jobs_job_task_path`` or, on
PostgreSQL, ``jobs_job_task_prefix``, ``jobs_job_queue_status``, the key, workflow and batch
indexes, and on PostgreSQL the GIN indexes of the arguments), or a scan bounded to the newest
``SCAN_WINDOW`` jobs by id, which the page names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from django.db.models import F, Max, Q, QuerySet

from django_jobs.db import ops
from django_jobs.limits import as_id
from django_jobs.models import Job

# How many of the newest jobs (by id) a scan reads: a range of the primary key, so its cost
# is the same at a thousand jobs or a hundred million.
SCAN_WINDOW = 100_000
# How many matches of an argument search are read (the newest by id): one more than the
# list ever counts (admin/pagination.py), so the count still says "10,000+".
MATCHES_READ = 10_001
# Longer searches are refused whole (no column we look in holds more than 255 characters).
MAX_TERM = 500
# A keyword argument's name in ``name=value``: a Python identifier, as a task's are.
KWARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
PREFIXES = ("id", "task", "queue", "key", "workflow", "batch", "arg", "text")


@dataclass(frozen=True)
class Search:
    """What the search box asked for, as a condition on the jobs and a sentence for the page.

    ``scan``: a scan of the newest ``SCAN_WINDOW`` jobs, not an index lookup (the page says
    so). ``matches_first``: the matches' ids are read first (``newest_matches``). ``condition``
    None: nothing can match (an id no job can have, a refused search). Parsing reads nothing;
    ``apply`` may.
    """

    condition: Q | None
    said: str
    scan: bool = False
    matches_first: bool = False

    def apply(self, queryset: QuerySet) -> QuerySet:
        if self.condition is None:
            return queryset.none()
        if self.scan:
            floor = newest_floor(queryset.db)
            if floor is not None:
                queryset = queryset.filter(pk__gt=floor)
        if self.matches_first:
            return queryset.filter(newest_matches(queryset.db, self.condition))
        return queryset.filter(self.condition)


def newest_floor(db: str) -> int | None:
    """The id below the newest ``SCAN_WINDOW`` jobs (the primary key's last entry, one
    index probe); None when there are fewer jobs than that in the id range."""
    top = Job.objects.using(db).aggregate(top=Max("pk"))["top"]
    if top is None or top <= SCAN_WINDOW:
        return None
    return top - SCAN_WINDOW


def values_of(text: str) -> list[Any]:
    """The JSON values a typed value may stand for: the text itself, and the number, true,
    false or null it reads as (``4242`` finds ``{"customer_id": 4242}`` and ``"4242"``).
    Quotes around it keep it text only."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return [text[1:-1]]
    values: list[Any] = [text]
    if re.fullmatch(r"-?[0-9]{1,30}", text):
        values.append(int(text))
    elif re.fullmatch(r"-?[0-9]{1,30}\.[0-9]{1,30}", text):
        values.append(float(text))
    elif text in ("true", "false"):
        values.append(text == "true")
    elif text == "null":
        values.append(None)
    return values


def quoted(text: str) -> str:
    return f"\u201c{text}\u201d"


def parse(term: str, db: str) -> Search | None:
    """The search ``term`` typed in the box; None for an empty one (the whole list)."""
    term = term.strip()
    if not term:
        return None
    if len(term) > MAX_TERM:
        return Search(None, f"nothing: a search is at most {MAX_TERM} characters")
    if term.startswith("#") or (term.isascii() and term.isdigit()):
        return by_id(term.removeprefix("#"))
    kind, colon, value = term.partition(":")
    kind = kind.strip().lower()
    if colon and kind in PREFIXES:
        value = value.strip()
        if not value:
            return Search(None, f"nothing: {kind}: needs a value after it")
        return FORMS[kind](value, db)
    name, equals, value = term.partition("=")
    if equals and KWARG.fullmatch(name.strip()) and value.strip():
        return by_keyword(name.strip(), value.strip(), db)
    return by_word(term, db)


def by_id(text: str) -> Search:
    job_id = as_id(text.strip()) if text.strip().isascii() else None
    if job_id is None:
        return Search(None, f"nothing: {quoted(text)} is no job id")
    return Search(Q(pk=job_id), f"job #{job_id}")


def by_task(prefix: str, db: str) -> Search:
    return Search(
        ops(db).prefix_condition("task_path", prefix), f"task paths starting {quoted(prefix)}"
    )


def by_queue(name: str, db: str) -> Search:
    return Search(Q(queue_name=name), f"queue {quoted(name)}")


def by_key(key: str, db: str) -> Search:
    """Exact on both keys' indexes; ``key:prefix*`` scans the newest jobs (a prefix of a key
    has no index on every database: the key indexes hold only the keyed jobs, as equality)."""
    if key.endswith("*") and len(key) > 1:
        prefix = key[:-1]
        condition = Q(concurrency_key__startswith=prefix) | Q(unique_key__startswith=prefix)
        return Search(
            condition,
            f"concurrency and unique keys starting {quoted(prefix)} "
            f"among the newest {SCAN_WINDOW:,} jobs",
            scan=True,
        )
    return Search(
        Q(concurrency_key=key) | Q(unique_key=key), f"concurrency or unique key {quoted(key)}"
    )


def by_row(column: str, label: str):
    def search(text: str, db: str) -> Search:
        row_id = as_id(text.removeprefix("#")) if text.isascii() else None
        if row_id is None:
            return Search(None, f"nothing: {quoted(text)} is no {label} id")
        return Search(Q(**{column: row_id}), f"the jobs of {label} #{row_id}")

    return search


def newest_matches(db: str, condition: Q) -> Q:
    """The newest ``MATCHES_READ`` jobs that an argument index finds, by their ids, read
    first in a query of their own.

    Ordered by ``id + 0``, which no index provides, so the planner reads the matches from
    the argument index and sorts them. Asked for the newest 50 directly, PostgreSQL walked
    the primary key back from the newest job testing each row: at 30M jobs it estimated
    6,000 matches for a customer who had 300, spread over the whole table, and the search
    ran into the statement timeout (bench/history.py).
    """
    ids = (
        Job.objects.using(db)
        .filter(condition)
        .order_by((F("pk") + 0).desc())
        .values_list("pk", flat=True)[:MATCHES_READ]
    )
    return Q(pk__in=list(ids))


def by_keyword(name: str, value: str, db: str) -> Search:
    condition = ops(db).keyword_argument_condition(name, values_of(value))
    if condition is not None:
        return Search(condition, f"keyword argument {name} = {quoted(value)}", matches_first=True)
    fallback = ops(db).scanned_keyword_condition(name, values_of(value))
    return Search(
        fallback,
        f"keyword argument {name} = {quoted(value)} in the arguments of the newest "
        f"{SCAN_WINDOW:,} jobs",
        scan=True,
    )


def by_argument(value: str, db: str) -> Search:
    condition = ops(db).any_argument_condition(values_of(value))
    if condition is not None:
        return Search(condition, f"any argument equal to {quoted(value)}", matches_first=True)
    return by_text(value, db)


def by_text(text: str, db: str) -> Search:
    return Search(
        Q(args__icontains=text) | Q(kwargs__icontains=text),
        f"{quoted(text)} in the arguments of the newest {SCAN_WINDOW:,} jobs",
        scan=True,
    )


def by_word(word: str, db: str) -> Search:
    """A bare word: whatever of the indexed columns it may be."""
    condition = (
        ops(db).prefix_condition("task_path", word)
        | Q(queue_name=word)
        | Q(concurrency_key=word)
        | Q(unique_key=word)
    )
    return Search(
        condition,
        f"task paths starting {quoted(word)}, and queue, concurrency key or unique key "
        f"{quoted(word)} (arg:{word} or text:{word} searches the arguments)",
    )


FORMS = {
    "id": lambda text, db: by_id(text),
    "task": by_task,
    "queue": by_queue,
    "key": by_key,
    "workflow": by_row("workflow_id", "workflow"),
    "batch": by_row("batch_id", "batch"),
    "arg": by_argument,
    "text": by_text,
}
