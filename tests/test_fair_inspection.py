"""What the admin, ``manage.py jobs`` and the metrics say of the fair queues (issue 38): each
fair queue's groups with the most ready jobs and their shares of the recent starts, from
``inspection.fair_groups``, on real enqueues, claims, starts and finishes.

Every read is bounded by a number of rows, never by the number of keys: the counts are of the
queue's next ready jobs in claim order (at most ``sample``), the shares of the latest
finished jobs (at most ``starts`` per outcome) and the running ones, and only the ``top``
groups are shown (and get metric series). The last tests count the queries for 5 keys and
for 200, and the series for 50 keys.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_jobs import bulk_enqueue
from django_jobs.conf import JobsSettings
from django_jobs.core.claimed import finish_job
from django_jobs.core.fairness import TURN_SCALE
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import Job, JobStatus, Process, ReadyExecution
from django_jobs.observability import inspection
from django_jobs.observability.inspection import FairQueue, fair_groups, fair_queue_list
from tests.fair_tasks import plain_default, tenant_report, unkeyed_report

pytestmark = pytest.mark.django_db

DB = "default"
REPORTS = QueueSelector(("reports",))
FAIR = {**settings.DJANGO_JOBS, "fair_queues": ["reports"]}
TOKEN = "fair-scrape-token"


@pytest.fixture
def fair():
    with override_settings(DJANGO_JOBS=FAIR):
        yield


@pytest.fixture
def worker() -> Process:
    return register_process(DB, "worker")


def enqueue(tenant: str, count: int) -> list[int]:
    """One bulk enqueue of ``count`` jobs of ``tenant``'s group."""
    return [int(r.id) for r in bulk_enqueue([(tenant_report, (tenant,), {}) for _ in range(count)])]


def enqueue_groups(groups: dict[str, int]) -> None:
    """Each group's jobs, one bulk enqueue for all."""
    bulk_enqueue(
        [(tenant_report, (tenant,), {}) for tenant, count in groups.items() for _ in range(count)]
    )


def run(worker: Process, count: int, finish: int = 0) -> list[Job]:
    """Claim and start the next ``count`` jobs of the fair queue, then finish the first
    ``finish`` of them; the jobs, in claim order."""
    jobs = claim_jobs(DB, worker.pk, REPORTS, count)
    for job in jobs:
        assert start_job(DB, job, worker.pk, worker.name)
    for job in jobs[:finish]:
        assert finish_job(DB, job.pk, worker.pk, None)
    return jobs


def groups(db: str = DB, **kwargs: Any) -> FairQueue:
    (found,) = fair_groups(db, ["reports"], timezone.now(), **kwargs)
    return found


def by_key(found: FairQueue) -> dict[str, tuple[int, int]]:
    return {group.key: (group.ready, group.starts) for group in found.groups}


# -- inspection ----------------------------------------------------------------------------


def test_the_groups_with_the_most_ready_jobs_and_their_shares_of_the_starts(fair, worker):
    enqueue_groups({"A": 30, "B": 20, "C": 5})
    for n in range(3):
        unkeyed_report.enqueue(n)
    plain_default.enqueue(1)  # another queue: never counted
    started = run(worker, 8, finish=5)
    took = Counter(job.fair_key for job in started)
    # Fair turns: every group had a job among the first eight.
    assert set(took) == {"A", "B", "C", ""}

    found = groups(top=2)

    assert found.queue == "reports"
    assert [g.key for g in found.groups] == ["A", "B"]
    assert by_key(found) == {"A": (30 - took["A"], took["A"]), "B": (20 - took["B"], took["B"])}
    assert found.ready_read == 58 - 8 and not found.ready_capped
    assert found.ready_text == "50"
    assert found.groups_seen == 4
    assert found.other_ready == (5 - took["C"]) + (3 - took[""])
    assert found.ungrouped_ready == 0 and found.ungrouped_starts == 0
    assert found.starts == 8 and found.other_starts == took["C"] + took[""]
    for group in found.groups:
        assert group.share == pytest.approx(took[group.key] / 8)
    assert not found.starts_cut
    assert found.starts_since <= timezone.now() - timedelta(minutes=59)
    # Where the claims are now: the first ready row in claim order.
    assert found.head_priority == 0 and found.head_turn is not None


def test_a_tie_goes_to_the_key_first_by_name_and_the_no_key_group_is_one(fair):
    enqueue_groups({"b": 2, "a": 2})
    unkeyed_report.enqueue(1)
    unkeyed_report.enqueue(2)
    found = groups(top=3)
    assert [(g.key, g.ready) for g in found.groups] == [("", 2), ("a", 2), ("b", 2)]
    assert found.groups[0].share is None  # nothing started: no share to give


def test_past_the_sample_the_groups_are_counted_among_the_jobs_the_claims_take_next(fair, worker):
    enqueue("A", 12)
    enqueue_groups({"B": 3, "C": 3})

    found = groups(sample=7)

    assert found.ready_read == 7 and found.ready_capped and found.ready_text == "7+"
    counted = {g.key: g.ready for g in found.groups}
    # The next seven claims take exactly the jobs counted.
    claimed = Counter(job.fair_key for job in claim_jobs(DB, worker.pk, REPORTS, 7))
    assert counted == dict(claimed)
    assert sum(counted.values()) == 7


def test_past_the_starts_read_only_the_latest_are_counted_and_it_says_so(fair, worker):
    enqueue_groups({"A": 6, "B": 6})
    run(worker, 6, finish=6)
    run(worker, 2)  # running: counted whatever the cap on the finished

    everything = groups()
    assert everything.starts == 8 and not everything.starts_cut

    cut = groups(starts=4)
    assert cut.starts_cut
    assert cut.starts_since > timezone.now() - timedelta(minutes=59)
    # The latest four successes read, the fourth's instant the window's start: three of
    # them, and no running job past the read's cap of four (two run).
    assert cut.starts == 3 + 2
    assert sum(g.starts for g in cut.groups) == cut.starts

    nothing = groups(starts=0)
    assert nothing.starts == 0 and all(g.share is None for g in nothing.groups)


def test_a_job_discarded_before_it_started_and_older_jobs_are_no_starts(fair, worker):
    (waiting,) = enqueue("A", 1)
    Job.objects.filter(pk=waiting).update(
        status=JobStatus.DISCARDED, finished_at=timezone.now(), last_attempted_at=None
    )
    (old,) = enqueue("B", 1)
    Job.objects.filter(pk=old).update(
        status=JobStatus.SUCCEEDED,
        finished_at=timezone.now() - timedelta(hours=2),
        last_attempted_at=timezone.now() - timedelta(hours=2),
    )
    ReadyExecution.objects.filter(job_id__in=[waiting, old]).delete()  # ended, as planted
    enqueue("C", 2)
    run(worker, 1, finish=1)
    found = groups()
    assert found.starts == 1
    assert by_key(found) == {"C": (1, 1)}


def test_jobs_enqueued_before_the_queue_was_fair_are_of_no_group(worker):
    unkeyed_report.enqueue(1)  # "reports" not fair yet: fair_key NULL
    with override_settings(DJANGO_JOBS=FAIR):
        enqueue("A", 2)
        found = groups()
    assert by_key(found) == {"A": (2, 0)}
    assert found.ungrouped_ready == 1 and found.groups_seen == 1 and found.other_ready == 0


def test_turns_queued_say_how_far_back_each_groups_newest_job_stands(fair):
    enqueue("A", 10)
    enqueue("B", 2)
    found = groups()
    queued = {g.key: g.turns_queued for g in found.groups}
    # Each group's stamp is its newest ready job's turn: how far that job stands behind the
    # lowest turn ready (whatever turns the rule gives, core/fairness.py).
    turns = list(ReadyExecution.objects.values_list("job__fair_key", "turn"))
    head = min(turn for _, turn in turns)
    newest = {key: max(turn for k, turn in turns if k == key) for key in ("A", "B")}
    assert queued == {key: (newest[key] - head) / TURN_SCALE for key in ("A", "B")}
    # A's ten jobs, a turn apart: its newest stands 9 turns behind its first, the head.
    assert queued["A"] == 9.0 and queued["A"] > queued["B"] >= 1.0
    assert found.head_turn == head
    assert all(g.turns_queued is None for g in groups(stamps=False).groups)


def test_no_fair_queue_reads_nothing():
    conf = JobsSettings.load()
    assert fair_queue_list(conf) == []
    with CaptureQueriesContext(connection) as queries:
        assert fair_groups(DB, fair_queue_list(conf), timezone.now()) == []
    assert len(queries) == 0


@pytest.mark.parametrize("value", ["reports", ["reports", "*"], [""]])
def test_a_malformed_setting_makes_no_queue_fair_here_either(value):
    with override_settings(DJANGO_JOBS={**settings.DJANGO_JOBS, "fair_queues": value}):
        assert fair_queue_list(JobsSettings.load()) == []


def plant(keys: int, worker: Process) -> None:
    """Three jobs per key, a running and a finished job among them."""
    enqueue_groups({f"tenant-{n}": 3 for n in range(keys)})
    run(worker, min(keys, 10), finish=min(keys, 10) // 2)


def count_queries(call) -> int:
    with CaptureQueriesContext(connection) as queries:
        call()
    return len(queries)


def test_the_reads_cost_the_same_for_5_keys_and_for_200(fair, worker):
    plant(5, worker)
    few = count_queries(groups)
    Job.objects.all().delete()
    plant(200, worker)
    many = count_queries(groups)
    # Per queue: ready rows, their keys, the stamps; once: running, 3 outcomes.
    assert few == many == 3 + 4
    found = groups(sample=100)
    assert found.ready_capped and found.groups_seen <= 100 and len(found.groups) == 10


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's plan")
def test_the_ready_rows_are_one_range_of_the_claims_index_with_a_limit(fair):
    enqueue_groups({f"t{n}": 20 for n in range(25)})
    bulk_enqueue([(plain_default, (n,), {}) for n in range(5000)])  # another queue's backlog
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_jobs_readyexecution")
        cursor.execute("ANALYZE django_jobs_job")
    rows = inspection.fair_ready_rows(DB, "reports", 101)
    assert len(rows) == 101
    # The first statement of fair_ready_rows, explained: the claims' index read in its
    # order, a LIMIT ending it, nothing sorted, no table read (the index has every column).
    # The second takes those 101 ids, by the primary key.
    query = (
        ReadyExecution.objects.filter(queue_name="reports")
        .order_by("-priority", "turn", "job_id")
        .values_list("priority", "turn", "job_id")[:101]
    )
    plan = query.explain()
    assert "jobs_ready_poll" in plan and "Limit" in plan, plan
    assert "Sort" not in plan and "Seq Scan" not in plan, plan


# -- the admin -------------------------------------------------------------------------------


def dashboard(client: Client) -> str:
    response = client.get(reverse("admin:django_jobs_dashboard_changelist"))
    assert response.status_code == 200
    return response.content.decode()


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_the_dashboard_shows_each_fair_queues_groups(fair, worker, viewer):
    enqueue_groups({f"tenant-{n:02}": 12 - n for n in range(12)})
    unkeyed_report.enqueue(1)
    run(worker, 4, finish=2)
    html = dashboard(viewer)
    assert 'id="fair-queues"' in html and 'data-queue="reports"' in html
    body = text(html)
    found = groups()
    assert f"reports : {found.ready_text} ready, 13 groups; 4 recent starts" in body
    assert "tenant-00" in body and "tenant-09" in body
    # Ten shown; the other three groups (two tenants and no key) on one line.
    assert "tenant-10" not in body and "3 other groups" in body
    first = found.groups[0]
    assert f"{first.key} {first.ready} " in body


def test_the_dashboard_escapes_the_keys(fair, admin_client):
    enqueue("<script>alert(1)</script>", 2)
    html = dashboard(admin_client)
    assert "<script>alert(1)" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_capped_counts_say_so_on_the_dashboard(fair, admin_client, monkeypatch):
    monkeypatch.setattr(inspection, "FAIR_READY_READ", 5)
    enqueue("A", 8)
    body = text(dashboard(admin_client))
    assert "5+ ready" in body and "among the next 5" in body
    assert "More than 5 jobs are ready" in body


def test_no_fair_queue_no_section(admin_client):
    unkeyed_report.enqueue(1)
    html = dashboard(admin_client)
    assert "fair-queues" not in html and "Fair queues" not in html


# -- manage.py jobs --------------------------------------------------------------------------


def report(*args: str) -> str:
    out = StringIO()
    call_command("jobs", *args, stdout=out)
    return out.getvalue()


def test_the_command_lists_each_fair_queues_groups(fair, worker):
    enqueue_groups({"acme": 5, "globex": 3, "evil\x1b[2J\nforged": 3})
    unkeyed_report.enqueue(1)
    unkeyed_report.enqueue(2)
    run(worker, 4, finish=2)
    out = report()
    assert "Fair queues (the groups with the most ready jobs)" in out
    assert "reports: 9 ready, 4 groups; 4 recent starts: running, or finished since" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    started = Counter(
        Job.objects.filter(status__in=["running", "succeeded"]).values_list("fair_key", flat=True)
    )
    acme = groups().groups[0]
    assert acme.key == "acme" and acme.ready == 5 - started["acme"]
    assert lines["acme"][1:4] == [str(acme.ready), str(started["acme"]), f"{acme.share:.1%}"]
    # A key's control characters are escaped: no forged line, no escape sequence.
    assert "\x1b" not in out and "\nforged" not in out and "evil\\x1b[2J\\nforged" in out

    data = json.loads(report("--json"))
    (queue,) = data["fair_queues"]
    assert queue["queue"] == "reports" and queue["ready_read"] == 9
    assert queue["groups"][0]["key"] == "acme"
    assert queue["starts"] == 4


def test_the_command_caps_what_it_reads(fair, worker, monkeypatch):
    monkeypatch.setattr(inspection, "FAIR_READY_READ", 4)
    enqueue("A", 6)
    out = report()
    assert "reports: 4+ ready, 1 group among the next 4" in out


def test_no_fair_queue_no_section_in_the_command():
    unkeyed_report.enqueue(1)
    assert "Fair queues" not in report()
    assert json.loads(report("--json"))["fair_queues"] == []


# -- metrics ---------------------------------------------------------------------------------


@pytest.fixture
def scrape(settings):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    def read(**metrics_settings: Any) -> dict[str, dict[frozenset, float]]:
        settings.DJANGO_JOBS_METRICS = {"bearer_tokens": [TOKEN], **metrics_settings}
        response = Client().get("/jobs/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200, response.content
        found: dict[str, dict[frozenset, float]] = {}
        for family in text_string_to_metric_families(response.content.decode()):
            for sample in family.samples:
                found.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
        return found

    return read


def labels(**pairs: str) -> frozenset:
    return frozenset(pairs.items())


def test_metrics_list_the_top_groups_only(fair, worker, scrape):
    enqueue_groups({f"tenant-{n:02}": 60 - n for n in range(50)})
    run(worker, 10, finish=4)
    found = groups()
    samples = scrape()

    ready = samples["django_jobs_fair_group_ready_jobs"]
    assert len(ready) == 10  # 50 keys, 10 series
    for group in found.groups:
        assert ready[labels(queue="reports", fair_key=group.key)] == group.ready
    shares = samples["django_jobs_fair_group_start_share"]
    assert len(shares) == 10
    assert sum(shares.values()) <= 1
    queue = labels(queue="reports")
    assert samples["django_jobs_fair_groups"][queue] == 50
    assert samples["django_jobs_fair_ready_jobs_read"][queue] == found.ready_read
    assert samples["django_jobs_fair_ready_jobs_capped"][queue] == 0
    assert samples["django_jobs_fair_recent_starts"][queue] == 10
    assert samples["django_jobs_fair_other_ready_jobs"][queue] == found.ready_read - sum(
        ready.values()
    )

    assert len(scrape(top_fair_keys=3)["django_jobs_fair_group_ready_jobs"]) == 3
    assert "django_jobs_fair_group_ready_jobs" not in scrape(top_fair_keys=0)


def test_a_scrape_costs_the_same_for_5_keys_and_for_200(fair, worker, scrape):
    plant(5, worker)
    few = count_queries(scrape)
    Job.objects.all().delete()
    plant(200, worker)
    many = count_queries(scrape)
    # docs/metrics.md: 10 queries without blocked jobs, and 2 + 4 with one fair queue.
    assert few == many == 10 + 6


def test_metrics_have_no_fair_series_when_no_queue_is_fair(scrape):
    unkeyed_report.enqueue(1)
    samples = scrape()
    assert not [name for name in samples if name.startswith("django_jobs_fair_")]


@pytest.mark.parametrize("value", [-1, True, "10", 2.5])
def test_a_wrong_top_fair_keys_is_an_error_naming_it(settings, value):
    from django.core.exceptions import ImproperlyConfigured

    from django_jobs.metrics.conf import MetricsSettings

    settings.DJANGO_JOBS_METRICS = {"top_fair_keys": value}
    with pytest.raises(ImproperlyConfigured, match="top_fair_keys"):
        MetricsSettings.load()


@pytest.mark.django_db
def test_a_jobs_page_names_its_fair_group_and_weight(fair, admin_client):
    from tests.fair_tasks import plain_default, unkeyed_report

    pages = {}
    for name, result in (
        ("keyed", tenant_report.using(fair_weight=2.5).enqueue("<acme>")),
        ("unkeyed", unkeyed_report.enqueue()),
        ("unfair", plain_default.enqueue()),
    ):
        url = reverse("admin:django_jobs_job_change", args=[int(result.id)])
        pages[name] = admin_client.get(url).content.decode()
    assert (
        "Fair group" in pages["keyed"] and "<code>&lt;acme&gt;</code>, weight 2.5" in pages["keyed"]
    )
    assert "the jobs of no key, weight 1" in pages["unkeyed"]
    assert "Fair group" not in pages["unfair"]
