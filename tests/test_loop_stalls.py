"""A worker's async capacity and its event loop's stalls, on every surface an operator looks
at: ``manage.py jobs`` (text and ``--json``), the admin's dashboard and process list, the
Prometheus metrics, and ``manage.py jobs_health``.

Process rows are planted with the metadata ``run_jobs`` writes (``runtime/registration.py``,
``runtime/loop_monitor.py``) and with what a hand edit may leave there: strings, negative
numbers, booleans, ``1e400`` (infinity on MariaDB and SQLite, a 401-digit integer on
PostgreSQL), integers past a float's exact range, metadata that is no object at all. Each
is written as JSON text by SQL, so the database holds exactly that text. Every surface must
show the figures the row holds, "unknown" for the others, and never fail. A real
``run_jobs`` then runs an ``async def`` job that blocks its loop, and the same surfaces
report the stall its loop monitor recorded.
"""

from __future__ import annotations

import json
import math
import re
import signal
from datetime import timedelta
from io import StringIO
from typing import Any, NamedTuple

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_jobs.conf import JobsSettings
from django_jobs.models import JobStatus, Process
from django_jobs.observability.process_metadata import (
    MAX_COUNT,
    async_loop,
    bounded_count,
    bounded_seconds_or_none,
    served_queues,
)
from django_jobs.runtime.registration import capacity
from tests import async_tasks
from tests.factories import ProcessFactory
from tests.harness import REPO_ROOT, job_row, wait_until

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from django_jobs.metrics.collector import families  # noqa: E402

TOKEN = "loop-stalls-scrape-token"
STALL_GAUGES = (
    "django_jobs_process_async_jobs",
    "django_jobs_event_loop_stalls",
    "django_jobs_event_loop_stalled_seconds",
)


class Planted(NamedTuple):
    """A process row to plant: its metadata as JSON text, and what every surface must read
    from it: (async_jobs, loop_stalls, loop_stalled_seconds)."""

    name: str
    metadata: str
    expected: tuple[int | None, int | None, float | None]
    kind: str = Process.Kind.WORKER
    alive: bool = True


UNKNOWN: tuple[None, None, None] = (None, None, None)
PLANTED = [
    Planted(
        "stalled",
        '{"queues": ["emails"], "threads": 3, "async_jobs": 200, "loop_stalls": 3, '
        '"loop_stalled_seconds": 4.5}',
        (200, 3, 4.5),
    ),
    # As registered, before any stall: no stall keys yet, and async jobs on threads.
    Planted("calm", '{"queues": ["default"], "threads": 2, "async_jobs": 0}', (0, 0, 0.0)),
    # JSON has one kind of number: 2.0 is the count 2, an integer is seconds.
    Planted(
        "whole-floats",
        '{"async_jobs": 200.0, "loop_stalls": 2.0, "loop_stalled_seconds": 7}',
        (200, 2, 7.0),
    ),
    Planted(
        "strings",
        '{"async_jobs": "200", "loop_stalls": "3", "loop_stalled_seconds": "4.5"}',
        UNKNOWN,
    ),
    Planted(
        "negative",
        '{"async_jobs": -1, "loop_stalls": -2, "loop_stalled_seconds": -0.5}',
        UNKNOWN,
    ),
    Planted(
        "fractions",
        '{"async_jobs": 2.5, "loop_stalls": 0.5, "loop_stalled_seconds": 1e-400}',
        (None, None, 0.0),
    ),
    Planted(
        "infinite",
        '{"async_jobs": 1e400, "loop_stalls": 1e400, "loop_stalled_seconds": 1e400}',
        UNKNOWN,
    ),
    Planted(
        "past-bounds",
        '{"async_jobs": 100001, "loop_stalls": 9007199254740992, "loop_stalled_seconds": 1e10}',
        UNKNOWN,
    ),
    Planted(
        "beyond-bigint",
        f'{{"async_jobs": {10**30}, "loop_stalls": {10**30}, "loop_stalled_seconds": {10**30}}}',
        UNKNOWN,
    ),
    Planted(
        "booleans",
        '{"async_jobs": true, "loop_stalls": true, "loop_stalled_seconds": false}',
        UNKNOWN,
    ),
    Planted(
        "nested",
        '{"async_jobs": [200], "loop_stalls": {"n": 1}, "loop_stalled_seconds": null}',
        UNKNOWN,
    ),
    # Metadata that is no object: no figure at all, so no stall recorded.
    Planted("a-list", "[1, 2]", (None, 0, 0.0)),
    Planted("a-string", '"loop_stalls"', (None, 0, 0.0)),
    Planted("json-null", "null", (None, 0, 0.0)),
    Planted(
        "dead",
        '{"queues": ["x"], "async_jobs": 50, "loop_stalls": 5, "loop_stalled_seconds": 9.5}',
        (50, 5, 9.5),
        alive=False,
    ),
    # Only a worker runs jobs: whatever a dispatcher's row says, it has no event loop.
    Planted(
        "dispatcher",
        '{"queues": ["*"], "threads": 3, "async_jobs": 200, "loop_stalls": 1}',
        UNKNOWN,
        kind=Process.Kind.DISPATCHER,
    ),
]
BY_NAME = {planted.name: planted for planted in PLANTED}
LIVE_STALLED = {"stalled": (3, 4.5), "whole-floats": (2, 7.0)}


def store_metadata(process: Process, text: str) -> None:
    """Write ``text`` as the row's metadata, exactly: what a hand edit in SQL leaves."""
    table = connection.ops.quote_name(Process._meta.db_table)
    value = "CAST(%s AS jsonb)" if connection.vendor == "postgresql" else "%s"
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET metadata = {value} WHERE id = %s", [text, process.pk])


@pytest.fixture
def planted(db) -> dict[str, Process]:
    now = timezone.now()
    rows = {}
    for plant in PLANTED:
        process = ProcessFactory(
            name=f"{plant.kind}-{plant.name}",
            kind=plant.kind,
            last_heartbeat_at=now - timedelta(seconds=2 if plant.alive else 3600),
        )
        store_metadata(process, plant.metadata)
        rows[plant.name] = process
    return rows


def refuse_constant(name: str) -> Any:
    raise AssertionError(f"{name} in the JSON: not a number any JSON reader takes")


def jobs_json() -> dict[str, Any]:
    out = StringIO()
    call_command("jobs", "--json", stdout=out)
    return json.loads(out.getvalue(), parse_constant=refuse_constant)


def jobs_text() -> str:
    out = StringIO()
    call_command("jobs", stdout=out, no_color=True)
    return out.getvalue()


def processes_table(report: str) -> dict[int, dict[str, str]]:
    """The text report's processes table: pid -> column -> cell, cut at the header's
    column starts (cells may be empty)."""
    lines = report.split("Processes\n", 1)[1].splitlines()
    header = lines[0]
    names = re.findall(r"\S+(?: \S+)*", header)
    starts = [header.index(name) for name in names]
    table = {}
    for line in lines[1:]:
        if not line.startswith("  ") or line.startswith("   "):
            break
        cells = {
            name: line[start:end].strip()
            for name, start, end in zip(names, starts, [*starts[1:], None], strict=True)
        }
        if not cells["pid"].isdigit():
            break
        table[int(cells["pid"])] = cells
    return table


# -- Reading the metadata ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "count"),
    [
        (0, 0),
        (3, 3),
        (3.0, 3),
        (MAX_COUNT, MAX_COUNT),
        (MAX_COUNT + 1, None),
        pytest.param(10**400, None, id="10**400"),
        (-1, None),
        (0.5, None),
        (math.nan, None),
        (math.inf, None),
        (-math.inf, None),
        (True, None),
        (False, None),
        ("3", None),
        (None, None),
        ([3], None),
        ({"n": 3}, None),
    ],
)
def test_a_count_is_an_integer_in_range_or_unknown(value, count):
    assert bounded_count(value) == count


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (4.5, 4.5),
        (7, 7.0),
        (3e9, 3e9),
        (1e10, None),  # more than a century
        pytest.param(10**400, None, id="10**400"),  # float() of it raises OverflowError
        (-0.5, None),
        (math.nan, None),
        (math.inf, None),
        (True, None),
        ("4.5", None),
        (None, None),
    ],
)
def test_seconds_are_a_finite_number_in_range_or_unknown(value, seconds):
    assert bounded_seconds_or_none(value) == seconds


def test_only_a_worker_has_an_event_loop_and_its_stalls_start_at_zero():
    assert async_loop(Process.Kind.DISPATCHER, {"async_jobs": 200, "loop_stalls": 1}) is None
    loop = async_loop(Process.Kind.WORKER, {"async_jobs": 200})
    assert loop is not None
    assert (loop.async_jobs, loop.stalls, loop.stalled_seconds, loop.stalled) == (200, 0, 0, False)


def test_served_queues_are_the_strings_of_a_queues_list():
    assert served_queues({"queues": ["emails", 3, None, "reports*"]}) == ("emails", "reports*")
    assert served_queues({"queues": "emails"}) == ()
    assert served_queues(["emails"]) == ()


def test_registration_writes_the_async_capacity_beside_queues_and_threads():
    conf = JobsSettings.load(queues=("emails",), threads=3, async_jobs=200)
    assert capacity(conf) == {"queues": ["emails"], "threads": 3, "async_jobs": 200}


# -- manage.py jobs ---------------------------------------------------------------------------


def test_jobs_json_gives_each_process_the_figures_its_row_holds(planted):
    processes = {p["id"]: p for p in jobs_json()["processes"]}
    for plant in PLANTED:
        process = processes[planted[plant.name].pk]
        figures = (process["async_jobs"], process["loop_stalls"], process["loop_stalled_seconds"])
        assert figures == plant.expected, plant.name


def test_jobs_text_shows_async_and_stalls_per_worker_and_warns_of_each_live_stall(planted):
    report = jobs_text()
    table = processes_table(report)
    cells = {
        name: (table[process.pid]["async"], table[process.pid]["loop stalls"])
        for name, process in planted.items()
    }
    assert cells["stalled"] == ("200", "3 (4.5 s)")
    assert cells["calm"] == ("0", "0")
    assert cells["whole-floats"] == ("200", "2 (7.0 s)")
    assert cells["dead"] == ("50", "5 (9.5 s)")
    assert cells["fractions"] == ("?", "?")
    for name in ("strings", "negative", "infinite", "past-bounds", "beyond-bigint", "booleans"):
        assert cells[name] == ("?", "?"), name
    for name in ("a-list", "a-string", "json-null"):
        assert cells[name] == ("?", "0"), name
    assert cells["dispatcher"] == ("", "")
    warnings = [line for line in report.splitlines() if "its event loop was blocked" in line]
    assert warnings == [
        "  worker-stalled: its event loop was blocked 3 times, 4.5 s in all since it started: "
        "an async job did blocking work and every other async job of the process waited (its "
        "log names the job; do such work in a sync task or through sync_to_async)",
        "  worker-whole-floats: its event loop was blocked 2 times, 7.0 s in all since it "
        "started: an async job did blocking work and every other async job of the process "
        "waited (its log names the job; do such work in a sync task or through sync_to_async)",
    ]


def test_a_stall_whose_seconds_are_unknown_is_still_warned_of(db):
    process = ProcessFactory(name="worker-half-known")
    store_metadata(process, '{"async_jobs": 10, "loop_stalls": 1, "loop_stalled_seconds": "x"}')
    report = jobs_text()
    assert processes_table(report)[process.pid]["loop stalls"] == "1 (? s)"
    assert "  worker-half-known: its event loop was blocked 1 time since it started" in report


# -- The admin --------------------------------------------------------------------------------


def admin_page(name: str) -> str:
    return reverse(f"admin:django_jobs_{name}_changelist")


def dashboard_cells(html: str, process: Process) -> tuple[str, str]:
    """(what it serves, the line under it about its event loop) of the process's row on
    the dashboard, both from its queues cell."""
    found = re.search(rf'<tr id="process-{process.pk}">(.*?)</tr>', html, re.S)
    assert found, process.name
    queues = re.search(r'<td class="jobs-queues">(.*?)</td>', found.group(1), re.S)
    assert queues, found.group(1)
    serves, _, note = queues.group(1).partition("<br>")
    return serves, note


def visible(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def test_the_dashboard_shows_async_capacity_and_flags_a_stalled_loop(admin_client, planted):
    response = admin_client.get(admin_page("dashboard"))
    assert response.status_code == 200
    html = response.content.decode()
    cells = {name: dashboard_cells(html, process) for name, process in planted.items()}

    serves, note = cells["stalled"]
    assert serves == "emails · 3 threads · 200 async"
    assert 'class="jobs-stalled"' in note
    assert visible(note) == "event loop: 3 stalls, 4.5 s blocked"
    assert "event_loop_block_threshold" in note  # its title says what it means
    # No async: nothing said of it; never blocked: no line.
    assert cells["calm"] == ("default · 2 threads", "")
    assert visible(cells["whole-floats"][1]) == "event loop: 2 stalls, 7.0 s blocked"
    assert visible(cells["dead"][1]) == "event loop: 5 stalls, 9.5 s blocked"
    hostile = ("strings", "negative", "fractions", "infinite", "past-bounds", "beyond-bigint")
    for name in (*hostile, "booleans", "nested"):
        assert visible(cells[name][1]) == "event loop stalls: unknown", name
        assert 'class="jobs-help"' in cells[name][1], name
    for name in ("a-list", "a-string", "json-null", "dispatcher"):
        assert cells[name] == ("\u2013", ""), name
    flagged = [name for name, (_, note) in cells.items() if "jobs-stalled" in note]
    assert sorted(flagged) == ["dead", "stalled", "whole-floats"]


def test_a_stall_with_unknown_seconds_is_flagged_and_says_so(admin_client, db):
    process = ProcessFactory(name="worker-half-known")
    store_metadata(process, '{"async_jobs": 10, "loop_stalls": 1, "loop_stalled_seconds": -3}')
    html = admin_client.get(admin_page("dashboard")).content.decode()
    _, note = dashboard_cells(html, process)
    assert 'class="jobs-stalled"' in note
    assert visible(note) == "event loop: 1 stall, seconds unknown"


def process_list_cells(html: str) -> dict[str, tuple[str, str]]:
    """The process list: name -> (what it serves, the line under it about its event loop),
    both from its queues cell, as HTML."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", html.split('id="result_list"', 1)[1], re.S):
        name = re.search(r'<th class="field-name">.*?>([^<]+)</a>', row, re.S)
        queues = re.search(r'<td class="field-queues">(.*?)</td>', row, re.S)
        if name and queues:
            serves, _, note = queues.group(1).partition("<br>")
            rows[name.group(1)] = (serves, note)
    return rows


def test_the_process_list_says_the_same(admin_client, planted):
    response = admin_client.get(admin_page("process"))
    assert response.status_code == 200
    cells = process_list_cells(response.content.decode())
    assert len(cells) == len(PLANTED)
    dashboard = admin_client.get(admin_page("dashboard")).content.decode()
    for plant in PLANTED:
        process = planted[plant.name]
        assert cells[process.name] == dashboard_cells(dashboard, process), plant.name
    assert visible(cells["worker-stalled"][1]) == "event loop: 3 stalls, 4.5 s blocked"


def test_every_page_that_lists_processes_answers_with_hostile_metadata(admin_client, planted):
    for name in ("dashboard", "process", "stuckjob"):
        assert admin_client.get(admin_page(name)).status_code == 200, name
    for process in planted.values():
        url = reverse("admin:django_jobs_process_change", args=[process.pk])
        assert admin_client.get(url).status_code == 200, process.name


# -- The metrics ------------------------------------------------------------------------------


def scrape(settings) -> dict[str, dict[str, float]]:
    """Each stall gauge's samples, by process label."""
    settings.DJANGO_JOBS_METRICS = {"bearer_tokens": [TOKEN]}
    response = Client().get("/jobs/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.content
    samples: dict[str, dict[str, float]] = {name: {} for name in STALL_GAUGES}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            if sample.name in samples:
                assert sample.labels["kind"] == "worker"
                samples[sample.name][sample.labels["process"]] = sample.value
    return samples


def test_the_metrics_give_each_live_worker_its_figures_and_nothing_else(settings, planted):
    samples = scrape(settings)
    for gauge, index in zip(STALL_GAUGES, range(3), strict=True):
        expected = {
            f"worker-{plant.name}": plant.expected[index]
            for plant in PLANTED
            if plant.kind == Process.Kind.WORKER
            and plant.alive
            and plant.expected[index] is not None
        }
        assert samples[gauge] == expected, gauge
    assert samples["django_jobs_event_loop_stalls"]["worker-stalled"] == 3
    assert samples["django_jobs_event_loop_stalled_seconds"]["worker-stalled"] == 4.5
    # A dead worker's series end with it; a figure its row does not hold is left out.
    assert all("worker-dead" not in by_process for by_process in samples.values())
    assert "worker-strings" not in samples["django_jobs_event_loop_stalls"]


def test_the_figures_cost_the_scrape_no_query(settings, planted):
    scrape(settings)  # the URLconf and the collector loaded
    with CaptureQueriesContext(connection) as queries:
        scrape(settings)
    # docs/metrics.md: 10 queries when no job is blocked, processes included.
    assert len(queries) == 10


# -- jobs_health ------------------------------------------------------------------------------


def test_jobs_health_takes_metadata_that_is_no_object(db):
    worker = ProcessFactory(hostname="probe-host")
    store_metadata(worker, '["single_process"]')
    dispatcher = ProcessFactory(kind=Process.Kind.DISPATCHER, hostname="probe-host")
    store_metadata(dispatcher, '"text"')
    out = StringIO()
    call_command("jobs_health", "--host", "probe-host", stdout=out)
    assert out.getvalue().startswith("ok on host probe-host: worker pid")


# -- A real worker ----------------------------------------------------------------------------


@pytest.mark.workers
def test_a_job_that_blocks_the_loop_shows_as_a_stall_everywhere(run_jobs, settings):
    result = async_tasks.block_the_loop.enqueue(1.0)
    proc = run_jobs(
        "--threads",
        "1",
        "--async-jobs",
        "20",
        env={"JOBS_EVENT_LOOP_BLOCK_THRESHOLD": "0.1"},
    )

    def stalled_worker() -> Process | None:
        worker = Process.objects.filter(kind=Process.Kind.WORKER).first()
        stalls = worker.metadata.get("loop_stalls", 0) if worker else 0
        return worker if stalls >= 1 else None

    wait_until(stalled_worker, 30, what="the worker's row to count a loop stall")
    wait_until(lambda: job_row(result).status == JobStatus.SUCCEEDED, 30, what="the job")
    worker = Process.objects.get(kind=Process.Kind.WORKER)
    assert worker.metadata["async_jobs"] == 20 and worker.metadata["threads"] == 1
    # The one job held the loop for its second (a busy machine may add a stall of its own).
    assert worker.metadata["loop_stalled_seconds"] >= 0.9, worker.metadata

    process = {p["id"]: p for p in jobs_json()["processes"]}[worker.pk]
    assert process["alive"] and process["async_jobs"] == 20
    assert process["loop_stalls"] >= 1 and process["loop_stalled_seconds"] >= 0.9
    assert f"  {worker.name}: its event loop was blocked " in jobs_text()
    samples = scrape(settings)
    assert samples["django_jobs_event_loop_stalls"][worker.name] >= 1
    assert samples["django_jobs_event_loop_stalled_seconds"][worker.name] >= 0.9
    assert samples["django_jobs_process_async_jobs"][worker.name] == 20
    # The log named the job that held the loop.
    proc.wait_for_output(f"job {result.id} (tests.async_tasks.block_the_loop)")

    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()


def test_every_metric_is_a_row_of_the_docs_table():
    page = (REPO_ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(django_jobs_\w+)` \|", page, re.M))
    assert {family.name for family in families().values()} == documented
