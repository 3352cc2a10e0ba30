"""The Prometheus endpoint: each metric's value for planted rows, its cost, and who may read it.

Rows are planted in the real database and read back through the endpoint's HTTP
response, parsed with prometheus_client's own parser: a metric computed wrongly, labelled
wrongly or missing fails here.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from django_jobs.metrics.collector import JobsCollector  # noqa: E402
from django_jobs.models import JobStatus, Process  # noqa: E402
from tests import tasks  # noqa: E402
from tests.factories import (  # noqa: E402
    AwaitingExecutionFactory,
    BlockedExecutionFactory,
    ClaimedExecutionFactory,
    FinishedJobFactory,
    JobFactory,
    PauseFactory,
    ProcessFactory,
    ReadyExecutionFactory,
    ScheduledExecutionFactory,
    SemaphoreFactory,
)
from tests.harness import app_permissions  # noqa: E402

URL = "/jobs/metrics"
TOKEN = "scrape-token-for-tests"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(autouse=True)
def metrics_settings(settings):
    settings.DJANGO_JOBS_METRICS = {"bearer_tokens": [TOKEN]}
    return settings


def scrape(**headers: str) -> Samples:
    response = Client().get(URL, headers={"Authorization": f"Bearer {TOKEN}", **headers})
    assert response.status_code == 200, response.content
    return parse(response.content.decode())


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[f"django_jobs_{name}", frozenset(labels.items())]


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == f"django_jobs_{name}"}


def ago(**delta: float):
    return timezone.now() - timedelta(**delta)


# -- Values ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_jobs_per_queue_and_state_oldest_ready_age_and_paused_queues():
    ReadyExecutionFactory(created_at=ago(minutes=10))
    ReadyExecutionFactory(created_at=ago(minutes=1))
    ReadyExecutionFactory(job__queue_name="emails", created_at=ago(seconds=30))
    PauseFactory(queue_name="emails")
    ScheduledExecutionFactory(scheduled_at=timezone.now() + timedelta(hours=1))
    ScheduledExecutionFactory(scheduled_at=timezone.now() + timedelta(hours=2))
    BlockedExecutionFactory()
    AwaitingExecutionFactory()
    ClaimedExecutionFactory()
    ReadyExecutionFactory(job__queue_name="unlisted")  # not in QUEUES: still reported

    samples = scrape()

    jobs = {
        (dict(labels)["queue"], dict(labels)["state"]): v
        for labels, v in series(samples, "jobs").items()
    }
    assert {k: v for k, v in jobs.items() if k[0] == "default"} == {
        ("default", "ready"): 2,
        ("default", "scheduled"): 2,
        ("default", "blocked"): 1,
        ("default", "awaiting"): 1,
        ("default", "running"): 1,
    }
    assert jobs["emails", "ready"] == 1 and jobs["unlisted", "ready"] == 1
    # A queue of QUEUES without a job has its series, at 0: an alert needs no absent().
    states = ("ready", "scheduled", "blocked", "awaiting", "running")
    assert [jobs["reports", state] for state in states] == [0, 0, 0, 0, 0]
    assert value(samples, "oldest_ready_job_age_seconds", queue="default") == pytest.approx(
        600, abs=10
    )
    assert value(samples, "oldest_ready_job_age_seconds", queue="emails") == pytest.approx(
        30, abs=10
    )
    assert value(samples, "oldest_ready_job_age_seconds", queue="reports") == 0
    assert value(samples, "queue_paused", queue="emails") == 1
    assert value(samples, "queue_paused", queue="default") == 0


@pytest.mark.django_db
def test_finished_in_the_last_minute_per_queue_and_outcome():
    for _ in range(3):
        FinishedJobFactory(finished_at=ago(seconds=5))
    FinishedJobFactory(status=JobStatus.FAILED, finished_at=ago(seconds=20))
    FinishedJobFactory(status=JobStatus.DISCARDED, finished_at=ago(seconds=40))
    FinishedJobFactory(queue_name="emails", finished_at=ago(seconds=1))
    FinishedJobFactory(queue_name="elsewhere", finished_at=ago(seconds=1))
    # Older than the minute.
    FinishedJobFactory.create_batch(2, finished_at=ago(minutes=10))
    FinishedJobFactory(status=JobStatus.FAILED, finished_at=ago(minutes=30))
    # Neither.
    FinishedJobFactory(finished_at=ago(hours=2))
    FinishedJobFactory(status=JobStatus.FAILED, finished_at=ago(days=3))
    # Waiting or running jobs are not finished, whatever their timestamps say.
    JobFactory(status=JobStatus.RUNNING, finished_at=None)

    samples = scrape()

    minute = {
        (dict(labels)["queue"], dict(labels)["status"]): v
        for labels, v in series(samples, "finished_jobs_last_minute").items()
    }
    assert minute["default", "succeeded"] == 3
    assert minute["default", "failed"] == 1
    assert minute["default", "discarded"] == 1
    assert minute["emails", "succeeded"] == 1
    assert minute["emails", "failed"] == 0 and minute["reports", "succeeded"] == 0
    # A queue outside QUEUES that only finished jobs still gets its series.
    assert minute["elsewhere", "succeeded"] == 1
    assert value(samples, "jobs", queue="elsewhere", state="ready") == 0


@pytest.mark.django_db
def test_blocked_keys_top_n_with_holders_limit_and_oldest_wait(settings):
    settings.DJANGO_JOBS_METRICS = {"bearer_tokens": [TOKEN], "top_keys": 2}

    def block(key: str, n: int, waited: timedelta) -> None:
        for _ in range(n):
            BlockedExecutionFactory(
                job__concurrency_key=key, concurrency_key=key, created_at=timezone.now() - waited
            )

    SemaphoreFactory(key="acct:1", limit=1, value=0)
    ReadyExecutionFactory(job=JobFactory(concurrency_key="acct:1"), concurrency_key="acct:1")
    block("acct:1", 3, timedelta(minutes=7))
    SemaphoreFactory(key="acct:2", limit=1, value=0)
    block("acct:2", 1, timedelta(minutes=1))  # fewest: left out of the top 2
    SemaphoreFactory(key="acct:3", limit=2, value=0)
    for _ in range(2):
        ClaimedExecutionFactory(job__concurrency_key="acct:3")
    block("acct:3", 2, timedelta(seconds=20))

    samples = scrape()

    assert value(samples, "blocked_keys") == 3
    assert series(samples, "key_blocked_jobs") == {
        frozenset({("key", "acct:1")}): 3,
        frozenset({("key", "acct:3")}): 2,
    }
    assert value(samples, "key_holders", key="acct:1") == 1
    assert value(samples, "key_holders", key="acct:3") == 2
    assert value(samples, "key_limit", key="acct:1") == 1
    assert value(samples, "key_limit", key="acct:3") == 2
    assert value(samples, "key_oldest_blocked_job_age_seconds", key="acct:1") == pytest.approx(
        420, abs=10
    )
    assert value(samples, "key_oldest_blocked_job_age_seconds", key="acct:3") == pytest.approx(
        20, abs=10
    )
    assert not any(dict(labels).get("key") == "acct:2" for _, labels in samples)


@pytest.mark.django_db
def test_top_keys_zero_lists_no_key_but_still_counts_them(settings):
    settings.DJANGO_JOBS_METRICS = {"bearer_tokens": [TOKEN], "top_keys": 0}
    BlockedExecutionFactory(job__concurrency_key="a", concurrency_key="a")
    BlockedExecutionFactory(job__concurrency_key="b", concurrency_key="b")
    samples = scrape()
    assert value(samples, "blocked_keys") == 2
    assert series(samples, "key_blocked_jobs") == {}


@pytest.mark.django_db
def test_processes_alive_dead_heartbeat_age_and_running_jobs_per_process():
    worker = ProcessFactory(name="worker-a", hostname="host-1", last_heartbeat_at=ago(seconds=12))
    idle = ProcessFactory(name="worker-b", hostname="host-2", last_heartbeat_at=ago(seconds=1))
    dead = ProcessFactory(name="worker-c", hostname="host-2", last_heartbeat_at=ago(hours=1))
    ProcessFactory(name="dispatcher-a", kind=Process.Kind.DISPATCHER)
    ClaimedExecutionFactory.create_batch(2, process=worker)
    ClaimedExecutionFactory(process=dead)

    samples = scrape()

    def labels(process: Process) -> dict[str, str]:
        return {"process": process.name, "kind": process.kind, "host": process.hostname}

    assert value(samples, "process_running_jobs", **labels(worker)) == 2
    assert value(samples, "process_running_jobs", **labels(idle)) == 0
    assert value(samples, "process_running_jobs", **labels(dead)) == 1
    assert value(samples, "process_alive", **labels(worker)) == 1
    assert value(samples, "process_alive", **labels(dead)) == 0
    assert value(samples, "process_heartbeat_age_seconds", **labels(worker)) == pytest.approx(
        12, abs=5
    )
    assert value(samples, "process_heartbeat_age_seconds", **labels(dead)) == pytest.approx(
        3600, abs=10
    )
    assert value(samples, "processes", kind="worker", state="alive") == 2
    assert value(samples, "processes", kind="worker", state="dead") == 1
    assert value(samples, "processes", kind="dispatcher", state="alive") == 1
    # Kinds with no process are there at 0, so "no live worker" is a value to alert on.
    assert value(samples, "processes", kind="scheduler", state="alive") == 0
    assert value(samples, "processes", kind="supervisor", state="dead") == 0


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_jobs_run_by_a_worker_process_show_as_finished_in_the_last_minute(run_jobs):
    for n in range(3):
        tasks.add.enqueue(n, 1)
    tasks.always_fails.enqueue()  # 3 attempts, backoff 0: failed for good within the run
    before = scrape()
    assert value(before, "jobs", queue="default", state="ready") == 4
    assert value(before, "finished_jobs_last_minute", queue="default", status="succeeded") == 0

    proc = run_jobs("--once")
    assert proc.wait(60) == 0, proc.output()

    after = scrape()
    assert value(after, "jobs", queue="default", state="ready") == 0
    assert value(after, "finished_jobs_last_minute", queue="default", status="succeeded") == 3
    assert value(after, "finished_jobs_last_minute", queue="default", status="failed") == 1
    assert value(after, "oldest_ready_job_age_seconds", queue="default") == 0


# -- Cost -------------------------------------------------------------------------------------


def count_scrape_queries() -> int:
    with CaptureQueriesContext(connection) as queries:
        scrape()
    return len(queries)


@pytest.mark.django_db
def test_a_scrape_costs_the_same_few_queries_however_many_rows_keys_and_processes():
    SemaphoreFactory(key="k0", limit=1, value=0)
    BlockedExecutionFactory(job__concurrency_key="k0", concurrency_key="k0")
    ProcessFactory()
    FinishedJobFactory()
    small = count_scrape_queries()

    for n in range(1, 30):
        SemaphoreFactory(key=f"k{n}", limit=1, value=0)
        BlockedExecutionFactory.create_batch(
            2, job__concurrency_key=f"k{n}", concurrency_key=f"k{n}"
        )
        ClaimedExecutionFactory(job__concurrency_key=f"k{n}", process=ProcessFactory())
    FinishedJobFactory.create_batch(20)
    ReadyExecutionFactory.create_batch(10, job__queue_name="emails")
    large = count_scrape_queries()

    assert small == large
    # Execution tables 5, pauses 1, last minute 1, blocked keys 2 + inspection.blocked_keys
    # 5, processes 2: docs/metrics.md lists them.
    assert large == 16


@pytest.mark.django_db
def test_no_blocked_key_saves_the_per_key_queries():
    assert count_scrape_queries() == 16 - 6


# -- Formats and registries -------------------------------------------------------------------


@pytest.mark.django_db
def test_openmetrics_is_served_to_a_scraper_that_asks_for_it():
    response = Client().get(
        URL,
        headers={
            "Authorization": f"Bearer {TOKEN}",
            "Accept": "application/openmetrics-text; version=1.0.0",
        },
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().endswith("# EOF\n")
    assert "no-cache" in response["Cache-Control"]


@pytest.mark.django_db
def test_registering_the_collector_in_a_describing_registry_reads_nothing():
    registry = CollectorRegistry(auto_describe=True)
    with CaptureQueriesContext(connection) as queries:
        registry.register(JobsCollector())
    assert len(queries) == 0
    ReadyExecutionFactory()
    assert (
        registry.get_sample_value("django_jobs_jobs", {"queue": "default", "state": "ready"}) == 1
    )


@pytest.mark.django_db
def test_a_database_error_answers_503_not_a_page(monkeypatch):
    def broken(*args, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr("django_jobs.metrics.collector.gather", broken)
    response = Client().get(URL, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 503


# -- Access control ---------------------------------------------------------------------------


def staff_client(*, perms: tuple[str, ...] = (), staff: bool = True) -> Client:
    from django.contrib.auth.models import Permission, User

    app_permissions()
    user = User.objects.create_user(f"user-{len(perms)}-{staff}", password="pw", is_staff=staff)
    user.user_permissions.add(*Permission.objects.filter(codename__in=perms))
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", "Bearer ", "Bearer", f"Basic {TOKEN}", f"Bearer {TOKEN}x"],
)
def test_without_a_listed_token_a_scraper_gets_401(authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = Client().get(URL, headers=headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"django_jobs" not in response.content


@pytest.mark.django_db
def test_any_listed_token_is_accepted_and_the_scheme_is_case_insensitive(settings):
    settings.DJANGO_JOBS_METRICS = {"bearer_tokens": ["first", "second"]}
    for header in ("Bearer first", "bearer second"):
        assert Client().get(URL, headers={"Authorization": header}).status_code == 200


@pytest.mark.django_db
def test_no_token_is_accepted_by_default(settings):
    del settings.DJANGO_JOBS_METRICS
    assert Client().get(URL, headers={"Authorization": "Bearer "}).status_code == 401
    assert Client().get(URL).status_code == 401


@pytest.mark.django_db
def test_staff_with_view_or_change_job_may_look_others_get_403(viewer):
    assert viewer.get(URL).status_code == 200
    assert staff_client(perms=("change_job",)).get(URL).status_code == 200
    assert staff_client().get(URL).status_code == 403
    assert staff_client(perms=("view_job",), staff=False).get(URL).status_code == 403


@pytest.mark.django_db
def test_allow_staff_false_leaves_tokens_only(settings, viewer):
    settings.DJANGO_JOBS_METRICS = {"bearer_tokens": [TOKEN], "allow_staff": False}
    assert viewer.get(URL).status_code == 403
    assert scrape()  # the token still works


@pytest.mark.django_db
def test_a_wrong_token_is_refused_even_with_a_staff_session(viewer):
    response = viewer.get(URL, headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401


@pytest.mark.django_db
def test_only_get_and_head(viewer):
    assert viewer.post(URL).status_code == 405
    assert viewer.head(URL).status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"bearer_tokens": [""]}, "non-empty strings"),
        ({"bearer_tokens": "one-token"}, "non-empty strings"),
        ({"bearer_tokens": None}, "non-empty strings"),
        ({"bearer_token": ["x"]}, "Did you mean 'bearer_tokens'?"),
        ({"top_keys": -1}, "top_keys"),
        ({"allow_staff": "yes"}, "allow_staff"),
        (["bearer_tokens"], "must be a dict"),
    ],
)
def test_a_wrong_setting_is_an_error_not_an_open_or_broken_endpoint(settings, config, message):
    settings.DJANGO_JOBS_METRICS = config
    with pytest.raises(ImproperlyConfigured, match=message):
        Client().get(URL, headers={"Authorization": "Bearer "})


def test_without_prometheus_client_the_urlconf_says_which_extra_to_install(monkeypatch):
    import importlib
    import sys

    for name in [m for m in sys.modules if m.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    import django_jobs.metrics

    for name in ("urls", "views", "collector"):
        monkeypatch.delitem(sys.modules, f"django_jobs.metrics.{name}", raising=False)
        # "from . import views" takes the package's attribute if there is one.
        monkeypatch.delattr(django_jobs.metrics, name, raising=False)
    with pytest.raises(ImproperlyConfigured, match=r"django-db-jobs\[prometheus\]"):
        importlib.import_module("django_jobs.metrics.urls")
