"""The jobs admin through Django's test client: what each page shows, what each action
does, who may do it, and that no page load counts or scans the whole job table."""

from __future__ import annotations

import re
from datetime import timedelta
from zoneinfo import ZoneInfo

import django
import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django.utils.csp import CSP

from django_jobs import enqueue_batch
from django_jobs import task as jobs_task
from django_jobs.admin import filters, pagination
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import (
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    Semaphore,
)
from django_jobs.observability import inspection
from tests import tasks
from tests.factories import (
    AwaitingExecutionFactory,
    FailedExecutionFactory,
    FinishedJobFactory,
    JobFactory,
    PauseFactory,
    ProcessFactory,
    ReadyExecutionFactory,
    ScheduledExecutionFactory,
)

pytestmark = pytest.mark.django_db

one_at_a_time = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_limit=1)
KEY = "tests.tasks.echo/acct:1"
PAGES = ("dashboard", "job", "blockedkey", "stuckjob", "process", "workflow")


def page(name: str) -> str:
    return reverse(f"admin:django_jobs_{name}_changelist")


def job_url(job_id: int, what: str = "change") -> str:
    if what == "change":
        return reverse("admin:django_jobs_job_change", args=[job_id])
    return reverse(f"admin:django_jobs_job_{what}", args=[job_id])


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def text(response) -> str:
    """The page's visible text, tags stripped and whitespace squeezed."""
    html = response.content.decode()
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def failed_job(**kwargs) -> Job:
    failure = FailedExecutionFactory(
        job__finished_at=timezone.now(), job__args=["needle-in-args"], **kwargs
    )
    return failure.job


def test_every_page_is_linked_from_the_app_index_and_renders(admin_client):
    index = admin_client.get(reverse("admin:app_list", args=["django_jobs"]))
    assert index.status_code == 200
    for name in PAGES:
        assert page(name) in index.content.decode()
        assert admin_client.get(page(name)).status_code == 200


def test_dashboard_counts_chart_processes_and_paused_queues(admin_client):
    now = timezone.now()
    ReadyExecutionFactory.create_batch(3, job__queue_name="emails")
    ScheduledExecutionFactory(job__queue_name="emails", scheduled_at=now + timedelta(hours=1))
    AwaitingExecutionFactory(job__queue_name="emails")  # waits for the jobs it depends on
    FinishedJobFactory.create_batch(4, queue_name="emails", finished_at=now)
    FinishedJobFactory(queue_name="emails", status=JobStatus.FAILED, finished_at=now)
    FinishedJobFactory(queue_name="emails", finished_at=now - timedelta(hours=3))  # too old
    PauseFactory(queue_name="reports")
    worker = ProcessFactory(hostname="box-1", pid=4242)
    claim = ClaimedExecution.objects.create(
        job=JobFactory(status=JobStatus.RUNNING), process=worker
    )

    response = admin_client.get(page("dashboard"))
    assert response.status_code == 200
    queues = {q["name"]: q for q in response.context["queues"]}
    # ready, scheduled, blocked, awaiting, running, succeeded (1h), failed (1h), discarded (1h)
    assert queues["emails"]["counts"] == [3, 1, 0, 1, 0, 4, 1, 0]
    assert queues["default"]["counts"] == [0, 0, 0, 0, 1, 0, 0, 0]
    assert response.context["columns"][3] == "Awaiting"
    assert queues["reports"]["paused"] and not queues["emails"]["paused"]
    chart = response.context["chart"]
    assert (chart["succeeded"], chart["failed"], chart["peak"]) == (4, 1, 5)
    assert len(chart["bars"]) == 60
    last = chart["bars"][-1]
    assert last.succeeded_height > 0 and last.failed_height > 0
    body = text(response)
    assert "box-1" in body and "4242" in body and f"#{claim.job_id}" in body
    assert 'class="failed"' in response.content.decode()  # the SVG draws the failure
    assert "Resume" in body and "Pause" in body


def test_pause_and_resume_from_the_dashboard(admin_client):
    response = admin_client.post(
        reverse("admin:django_jobs_dashboard_pause"), {"queue": "emails"}, follow=True
    )
    assert Pause.objects.filter(queue_name="emails").exists()
    assert any("paused" in m for m in messages_of(response))
    again = admin_client.post(
        reverse("admin:django_jobs_dashboard_pause"), {"queue": "emails"}, follow=True
    )
    assert any("already paused" in m for m in messages_of(again))
    response = admin_client.post(
        reverse("admin:django_jobs_dashboard_resume"), {"queue": "emails"}, follow=True
    )
    assert not Pause.objects.exists()
    assert any("resumed" in m for m in messages_of(response))
    empty = admin_client.post(
        reverse("admin:django_jobs_dashboard_pause"), {"queue": " "}, follow=True
    )
    assert not Pause.objects.exists()
    assert any("Give the name" in m for m in messages_of(empty))


def test_job_list_filters_and_search(admin_client):
    failed = failed_job()
    old_failed = failed_job()
    Job.objects.filter(pk=old_failed.pk).update(finished_at=timezone.now() - timedelta(days=3))
    report = JobFactory(queue_name="reports", task_path="tests.tasks.echo")
    keyed = JobFactory(concurrency_key="acct:7")
    FinishedJobFactory()

    def listed(query: str) -> set[int]:
        response = admin_client.get(page("job") + query)
        assert response.status_code == 200, query
        return {job.pk for job in response.context["cl"].result_list}

    assert listed("?status=failed") == {failed.pk, old_failed.pk}
    assert listed("?status=failed&finished_since=24h") == {failed.pk}
    assert listed("?queue_name=reports") == {report.pk}
    assert listed("?task_path=tests.tasks.echo") == {report.pk}
    assert listed("?concurrency_key=acct:7") == {keyed.pk}
    assert listed(f"?q={keyed.pk}") == {keyed.pk}
    assert listed(f"?q=%23{keyed.pk}") == {keyed.pk}
    assert listed("?q=text:needle-in") == {failed.pk, old_failed.pk}
    assert listed("?q=task:tests.tasks.ec") == {report.pk}
    assert listed("?q=queue:reports") == {report.pk}
    assert listed("?q=key:acct:7") == {keyed.pk}
    # The filter sidebar offers the values it found, without a DISTINCT over all jobs.
    body = admin_client.get(page("job")).content.decode()
    assert "?queue_name=reports" in body and "?concurrency_key=acct%3A7" in body


def test_no_page_counts_or_scans_the_whole_job_table(admin_client, monkeypatch):
    monkeypatch.setattr(pagination, "COUNT_CAP", 5)
    FinishedJobFactory.create_batch(8)
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(page("job"))
    assert "more than 5 jobs" in text(response)
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"].upper()]
    assert counts, "the list must count (capped)"
    for sql in counts:
        assert "LIMIT" in sql.upper(), f"uncapped count: {sql}"


def test_filter_choices_come_from_recent_jobs_not_the_whole_history(admin_client, monkeypatch):
    monkeypatch.setattr(filters, "RECENT", 3)
    for n in range(8):
        FinishedJobFactory(task_path=f"old.tasks.t{n}")
    for n in range(3):
        FinishedJobFactory(task_path=f"new.tasks.t{n}")
    ReadyExecutionFactory(job__task_path="old.tasks.t0", job__queue_name="backlog")
    response = admin_client.get(page("job"))
    (task_filter,) = [f for f in response.context["cl"].filter_specs if f.title == "task"]
    offered = {value for value, _ in task_filter.lookup_choices}
    # The three most recent jobs: the ready one, and two of the new ones.
    assert offered == {"old.tasks.t0", "new.tasks.t1", "new.tasks.t2"}
    (queue_filter,) = [f for f in response.context["cl"].filter_specs if f.title == "queue"]
    assert "backlog" in {value for value, _ in queue_filter.lookup_choices}
    # A value not offered still filters when asked for.
    listed = admin_client.get(page("job") + "?task_path=old.tasks.t5").context["cl"]
    assert [job.task_path for job in listed.result_list] == ["old.tasks.t5"]


def test_job_page_shows_arguments_attempts_tracebacks_timeline_and_execution(admin_client):
    job = failed_job()
    FailedExecutionFactory(
        job=job, attempt=2, message="second", traceback="Traceback\nKeyError: 'x'"
    )
    body = text(admin_client.get(job_url(job.pk)))
    assert "needle-in-args" in body
    assert "Attempt 1" in body and "Attempt 2" in body and "KeyError" in body
    assert "Enqueued" in body and "Finished" in body
    assert "None: the job has finished (it failed)" in body
    assert "Retry" in body and "Discard" in body

    ready = ReadyExecutionFactory(job__queue_name="emails").job
    body = text(admin_client.get(job_url(ready.pk)))
    assert "Table ready" in body and "Retry" not in body and "Discard" in body

    worker = ProcessFactory(name="w-7", hostname="box-9", pid=77)
    running = JobFactory(status=JobStatus.RUNNING)
    ClaimedExecution.objects.create(job=running, process=worker)
    body = text(admin_client.get(job_url(running.pk)))
    assert "Table claimed" in body and "w-7 on box-9 (pid 77)" in body
    assert "Discard" not in body and "Retry" not in body

    assert admin_client.get(job_url(10**9)).status_code == 404
    assert admin_client.post(job_url(job.pk), {}).status_code == 403  # no editing a job


def test_retry_discard_and_their_messages(admin_client):
    job = failed_job()
    response = admin_client.post(job_url(job.pk, "retry"), follow=True)
    assert Job.objects.get(pk=job.pk).status == JobStatus.READY
    assert any("will be retried" in m for m in messages_of(response))
    response = admin_client.post(job_url(job.pk, "retry"), follow=True)
    assert any("not retried" in m for m in messages_of(response))
    response = admin_client.post(job_url(job.pk, "discard"), follow=True)
    assert Job.objects.get(pk=job.pk).status == JobStatus.DISCARDED
    assert not ReadyExecution.objects.filter(job_id=job.pk).exists()
    assert any("was discarded" in m for m in messages_of(response))
    assert admin_client.get(job_url(job.pk, "retry")).status_code == 405


def test_a_running_job_is_never_discarded(admin_client):
    worker = register_process("default", "worker")
    job_id = int(tasks.echo.enqueue("x").id)
    (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
    assert start_job("default", job, worker.pk, worker.name)
    response = admin_client.post(job_url(job_id, "discard"), follow=True)
    assert any("not discarded" in m for m in messages_of(response))
    assert Job.objects.get(pk=job_id).status == JobStatus.RUNNING
    assert ClaimedExecution.objects.filter(job_id=job_id).exists()
    response = admin_client.post(
        page("job"), {"action": "discard_selected", "_selected_action": [job_id]}, follow=True
    )
    assert any("1 job not discarded" in m for m in messages_of(response))
    assert Job.objects.get(pk=job_id).status == JobStatus.RUNNING


def test_bulk_retry_and_discard(admin_client):
    failed = [failed_job().pk for _ in range(3)]
    ready = ReadyExecutionFactory().job_id
    response = admin_client.post(
        page("job"),
        {"action": "retry_selected", "_selected_action": [*failed, ready]},
        follow=True,
    )
    assert set(Job.objects.filter(pk__in=failed).values_list("status", flat=True)) == {"ready"}
    assert any("3 jobs retried" in m for m in messages_of(response))
    assert any("1 job not retried" in m for m in messages_of(response))
    response = admin_client.post(
        page("job"), {"action": "discard_selected", "_selected_action": failed}, follow=True
    )
    assert any("3 jobs discarded" in m for m in messages_of(response))
    assert not ReadyExecution.objects.filter(job_id__in=failed).exists()


def test_run_now_asks_first_then_bypasses_the_limit_once(admin_client):
    holder, blocked, waiting = (int(one_at_a_time.enqueue(1).id) for _ in range(3))
    confirm = admin_client.get(job_url(blocked, "run_now"))
    assert confirm.status_code == 200 and "bypasses the concurrency limit" in text(confirm)
    assert Job.objects.get(pk=blocked).status == JobStatus.BLOCKED
    response = admin_client.post(job_url(blocked, "run_now"), follow=True)
    assert any("1 job made ready past their limit" in m for m in messages_of(response))
    assert Job.objects.get(pk=blocked).status == JobStatus.READY
    assert Job.objects.get(pk=waiting).status == JobStatus.BLOCKED
    assert Semaphore.objects.get(key=KEY).value == -1

    # The bulk action: a confirmation page first, then the act.
    action = {"action": "run_selected_now", "_selected_action": [waiting, holder]}
    confirm = admin_client.post(page("job"), action)
    assert 'value="Yes, run 1 job now"' in confirm.content.decode()
    assert Job.objects.get(pk=waiting).status == JobStatus.BLOCKED
    response = admin_client.post(page("job"), {**action, "confirmed": "yes"}, follow=True)
    assert Job.objects.get(pk=waiting).status == JobStatus.READY
    assert any("1 job not made ready" in m for m in messages_of(response))


def test_blocked_page_groups_by_key_and_reconciles(admin_client):
    holder, blocked, blocked_too = (int(one_at_a_time.enqueue(1).id) for _ in range(3))
    response = admin_client.get(page("blockedkey"))
    (group,) = response.context["groups"]
    assert (group["key"].key, group["key"].limit, group["key"].holders) == (KEY, 1, 1)
    assert group["key"].blocked == 2 and group["waiting"] == [blocked, blocked_too]
    assert [h.job_id for h in group["holders"]] == [holder]
    assert "run now" in text(response) and "Reconcile this key" in text(response)

    # Drift: the holder vanished without giving its slot back.
    ReadyExecution.objects.filter(job_id=holder).delete()
    Job.objects.filter(pk=holder).update(status=JobStatus.DISCARDED)
    response = admin_client.post(
        reverse("admin:django_jobs_blockedkey_reconcile"), {"key": KEY}, follow=True
    )
    assert any("1 blocked job promoted" in m for m in messages_of(response))
    assert Job.objects.get(pk=blocked).status == JobStatus.READY
    assert BlockedExecution.objects.get().job_id == blocked_too


def test_stuck_page_lists_each_kind_with_a_count(admin_client):
    now = timezone.now()
    dead = ProcessFactory(last_heartbeat_at=now - timedelta(hours=1))
    orphan = ClaimedExecution.objects.create(job=JobFactory(status=JobStatus.RUNNING), process=dead)
    overdue = ScheduledExecutionFactory(scheduled_at=now - timedelta(hours=2)).job_id
    response = admin_client.get(page("stuckjob"))
    kinds = {k["name"]: k for k in response.context["kinds"]}
    assert [j.pk for j in kinds["claimed_by_dead_process"]["jobs"]] == [orphan.job_id]
    assert [j.pk for j in kinds["scheduled_long_past_due"]["jobs"]] == [overdue]
    assert kinds["blocked_behind_free_slot"]["count"] == 0
    assert f"#{orphan.job_id}" in text(response)


def test_view_only_users_see_everything_and_change_nothing(viewer):
    job = failed_job()
    blocked = int(one_at_a_time.enqueue(1).id)
    blocked = int(one_at_a_time.enqueue(1).id)
    for name in PAGES:
        response = viewer.get(page(name))
        assert response.status_code == 200, name
        assert '<form class="jobs-inline" method="post"' not in response.content.decode()
    listing = viewer.get(page("job"))
    assert listing.context["action_form"] is None or not listing.context["actions_on_top"]
    body = text(viewer.get(job_url(job.pk)))
    assert "needle-in-args" in body and "Retry" not in body
    refused = [
        viewer.post(job_url(job.pk, "retry")),
        viewer.post(job_url(job.pk, "discard")),
        viewer.post(job_url(blocked, "run_now")),
        viewer.post(reverse("admin:django_jobs_dashboard_pause"), {"queue": "default"}),
        viewer.post(reverse("admin:django_jobs_blockedkey_reconcile"), {"key": KEY}),
    ]
    assert [r.status_code for r in refused] == [403] * 5
    viewer.post(page("job"), {"action": "retry_selected", "_selected_action": [job.pk]})
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED
    assert Job.objects.get(pk=blocked).status == JobStatus.BLOCKED
    assert not Pause.objects.exists()


def test_staff_without_job_permissions_and_anonymous_users_are_kept_out(client):
    user = User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(user)
    for name in PAGES:
        assert client.get(page(name)).status_code == 403, name
    assert client.post(reverse("admin:django_jobs_dashboard_pause"), {"queue": "x"}).status_code
    assert not Pause.objects.exists()
    anonymous = Client()
    response = anonymous.get(page("dashboard"))
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_actions_need_a_csrf_token(admin_user):
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    job = failed_job()
    assert client.post(job_url(job.pk, "retry")).status_code == 403
    assert client.post(reverse("admin:django_jobs_dashboard_pause"), {"queue": "x"}).status_code
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED
    assert not Pause.objects.exists()


# --- the polish of issue 15 -------------------------------------------------------------


def test_breadcrumbs_use_the_markup_the_running_django_styles(admin_client):
    """Django 6.1 styles <ol class="breadcrumbs"> only; 6.0 <div class="breadcrumbs">."""
    job = failed_job()
    batch = enqueue_batch([(tasks.add, [1, 2], {})], description="b")
    blocked = [int(one_at_a_time.enqueue(1).id) for _ in range(2)][1]
    pages = [
        *(page(name) for name in ("dashboard", "blockedkey", "stuckjob", "recurringtask")),
        job_url(job.pk),
        job_url(blocked, "run_now"),
        reverse("admin:django_jobs_batch_change", args=[batch.id]),
    ]
    ours, other = (
        ('<ol class="breadcrumbs">', '<div class="breadcrumbs">')
        if django.VERSION >= (6, 1)
        else ('<div class="breadcrumbs">', '<ol class="breadcrumbs">')
    )
    for url in pages:
        html = admin_client.get(url).content.decode()
        assert ours in html and other not in html, url
        trail = html.split(ours, 1)[1].split("</nav>", 1)[0]
        assert reverse("admin:app_list", args=["django_jobs"]) in trail, url
    detail = admin_client.get(job_url(job.pk)).content.decode()
    assert f'href="{page("job")}"' in detail.split("</nav>", 1)[0]


def test_the_job_page_says_why_it_has_no_execution_row_in_plain_words(admin_client):
    succeeded = FinishedJobFactory()
    discarded = FinishedJobFactory(status=JobStatus.DISCARDED)
    body = text(admin_client.get(job_url(succeeded.pk)))
    assert "None: the job has finished (it succeeded)" in body
    assert "the job is succeeded" not in body and "None: the job is" not in body
    body = text(admin_client.get(job_url(discarded.pk)))
    assert "None: the job has finished (it was discarded)" in body
    # A row that moved between the job's read and the execution tables' read.
    lost = JobFactory(status=JobStatus.READY)
    assert "None, although the job is ready" in text(admin_client.get(job_url(lost.pk)))


def test_the_stuck_page_knows_whether_a_dispatcher_is_running(admin_client):
    def said() -> tuple[str, str]:
        response = admin_client.get(page("stuckjob"))
        kinds = {k["name"]: k for k in response.context["kinds"]}
        return response.context["dispatcher_status"], kinds["scheduled_long_past_due"]["status"]

    status, overdue = said()
    assert status.startswith("No dispatcher is running") and "start run_jobs" in overdue

    # A dispatcher registered as run_jobs registers it, heartbeating.
    dispatcher = register_process("default", "dispatcher", metadata={"queues": ["*"]})
    status, overdue = said()
    assert status == f"A dispatcher is running: {dispatcher.name}."
    assert "No dispatcher" not in text(admin_client.get(page("stuckjob")))
    assert overdue.startswith("A dispatcher is running: a job listed here means it is falling")

    # Past the alive threshold it no longer counts.
    Process.objects.filter(pk=dispatcher.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert said()[0].startswith("No dispatcher is running")

    # run_jobs --single-process: one worker row, whose dispatcher is a thread.
    single = register_process(
        "default", "worker", metadata={"queues": ["*"], "threads": 2, "single_process": True}
    )
    assert said()[0] == f"A dispatcher is running: {single.name}."
    # A plain worker is no dispatcher.
    Process.objects.filter(pk=single.pk).update(metadata={"queues": ["*"], "threads": 2})
    assert said()[0].startswith("No dispatcher is running")


DEFAULT_DATE = re.compile(
    r"\b(Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\.? \d{1,2}, \d{4}|[ap]\.m\."
)
ONE_DATE = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}$")


def dates_of(html: str) -> list[str]:
    """The visible text of every <time> element of a page."""
    return [
        re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", inner)).strip()
        for inner in re.findall(r"<time [^>]*>(.*?)</time>", html, re.S)
    ]


@pytest.mark.parametrize("zone", ["UTC", "Europe/Paris"])
def test_every_page_shows_dates_in_one_format_in_the_zone_it_names(admin_client, settings, zone):
    settings.TIME_ZONE = zone
    settings.DJANGO_JOBS = {
        **settings.DJANGO_JOBS,
        "recurring": {"nightly": {"task": "tests.tasks.add", "schedule": "0 3 * * *"}},
    }
    now = timezone.now()
    failed = failed_job()
    worker = ProcessFactory(metadata={"queues": ["*"], "threads": 1})
    claimed = JobFactory(status=JobStatus.RUNNING, started_at=now, last_attempted_at=now)
    ClaimedExecution.objects.create(job=claimed, process=worker, lease_expires_at=now)
    scheduled = ScheduledExecutionFactory(scheduled_at=now - timedelta(hours=2)).job_id
    holder, blocked = (int(one_at_a_time.enqueue(1).id) for _ in range(2))
    batch = enqueue_batch([(tasks.add, [1, 2], {})], description="b")
    pages = [
        *(page(name) for name in ("dashboard", "job", "blockedkey", "stuckjob", "process")),
        page("recurringtask"),
        page("ratelimitedkey"),
        page("batch"),
        *(job_url(pk) for pk in (failed.pk, claimed.pk, scheduled, holder, blocked)),
        reverse("admin:django_jobs_process_change", args=[worker.pk]),
        reverse("admin:django_jobs_batch_change", args=[batch.id]),
    ]
    # The dashboard's chart truncates to minutes in UTC (inspection.recent_outcomes):
    # it answers on MariaDB/MySQL without their time zone tables too.
    for url in pages:
        response = admin_client.get(url)
        html = response.content.decode()
        assert response.status_code == 200, url
        assert not DEFAULT_DATE.search(text(response)), (url, DEFAULT_DATE.search(text(response)))
        assert not re.search(r"\d{2}:\d{2}:\d{2}\.\d{6}", text(response)), url  # no microseconds
        for shown in dates_of(html):
            assert ONE_DATE.match(shown), (url, shown)
        if url != reverse("admin:django_jobs_process_change", args=[worker.pk]):
            assert f"Times in {zone}" in text(response), url
    # In the zone named: the job's enqueue time as a clock there reads it.
    local = timezone.localtime(failed.enqueued_at, ZoneInfo(zone))
    assert f"{local:%Y-%m-%d %H:%M:%S}" in dates_of(
        admin_client.get(job_url(failed.pk)).content.decode()
    )


def test_the_job_list_shows_a_key_without_the_task_path_it_repeats(admin_client):
    keyed = int(one_at_a_time.enqueue(1).id)
    grouped = JobFactory(concurrency_key="billing/acct:9")  # a concurrency_group's key
    html = admin_client.get(page("job")).content.decode()
    rows = html.split('id="result_list"', 1)[1].split("</table>", 1)[0]
    assert f'<span class="jobs-key" title="{KEY}">acct:1</span>' in rows
    assert f">{KEY}<" not in rows
    assert '<span class="jobs-key" title="billing/acct:9">billing/acct:9</span>' in html
    # The task column is the job's id and task name, the full path in its title.
    assert f'#{keyed} <span class="jobs-task" title="tests.tasks.echo">echo</span>' in html
    assert grouped.pk


def test_lists_are_titled_by_their_name_and_the_app_index_offers_no_change_links(admin_client):
    index = admin_client.get(reverse("admin:app_list", args=["django_jobs"])).content.decode()
    for name in (*PAGES, "recurringtask", "batch"):
        row = re.search(rf'<tr class="model-{name}[^"]*">(.*?)</tr>', index, re.S)
        assert row, name
        assert "changelink" not in row.group(1) and "addlink" not in row.group(1), name
        assert "viewlink" in row.group(1), name
    for name, title in (("job", "Jobs"), ("batch", "Batches"), ("process", "Processes")):
        body = text(admin_client.get(page(name)))
        assert f"<h1>{title}</h1>" in admin_client.get(page(name)).content.decode(), name
        assert "to change" not in body and "to view" not in body, name
    # Still the actions for who may act: no change permission is needed for them.
    listing = admin_client.get(page("job"))
    assert {"retry_selected", "discard_selected", "run_selected_now"} <= {
        name for name, _ in listing.context["action_form"].fields["action"].choices
    }


def test_the_dashboard_counts_outcomes_as_its_chart_does(admin_client):
    now = timezone.now()
    FinishedJobFactory.create_batch(3, queue_name="emails", finished_at=now)
    FinishedJobFactory.create_batch(
        2, queue_name="emails", status=JobStatus.FAILED, finished_at=now
    )
    FinishedJobFactory(queue_name="emails", status=JobStatus.DISCARDED, finished_at=now)
    FinishedJobFactory(queue_name="reports", status=JobStatus.FAILED, finished_at=now)
    # Before the chart's first minute though within the hour: neither counts it.
    first_minute = now.replace(second=0, microsecond=0) - timedelta(minutes=59)
    FinishedJobFactory(queue_name="emails", finished_at=first_minute - timedelta(seconds=1))
    response = admin_client.get(page("dashboard"))
    columns = response.context["columns"]
    assert list(columns[-3:]) == ["Succeeded (1h)", "Failed (1h)", "Discarded (1h)"]
    assert not any("Finished" in c for c in columns)
    totals = dict(zip(columns, response.context["totals"], strict=True))
    chart = response.context["chart"]
    assert (totals["Succeeded (1h)"], totals["Failed (1h)"]) == (chart["succeeded"], 3)
    assert chart["failed"] == 3 and chart["succeeded"] == 3
    assert totals["Discarded (1h)"] == 1


def test_past_the_rows_it_reads_the_dashboard_counts_queues_over_the_latest_minutes(
    admin_client, monkeypatch
):
    """The chart counts the whole hour from the ``(status, finished_at)`` index; the
    table's outcome columns read each job for its queue, so past ``QUEUE_ROWS_READ`` jobs
    (10,000 in use, 3 here) they cover the hour's latest minutes and say which."""
    monkeypatch.setattr(inspection, "QUEUE_ROWS_READ", 3)
    now = timezone.now()
    FinishedJobFactory.create_batch(2, queue_name="emails", finished_at=now)
    FinishedJobFactory.create_batch(
        3, queue_name="reports", status=JobStatus.FAILED, finished_at=now - timedelta(minutes=10)
    )
    FinishedJobFactory(queue_name="reports", finished_at=now - timedelta(minutes=30))
    with CaptureQueriesContext(connection) as captured:
        response = admin_client.get(page("dashboard"))
    chart = response.context["chart"]
    assert (chart["succeeded"], chart["failed"]) == (3, 3)
    window = response.context["window"]
    assert re.fullmatch(r"(10|11) min", window), window
    columns = response.context["columns"]
    assert list(columns[-3:]) == [f"{s} ({window})" for s in ("Succeeded", "Failed", "Discarded")]
    rows = {queue["name"]: queue["counts"] for queue in response.context["queues"]}
    assert rows == {"emails": [0, 0, 0, 0, 0, 2, 0, 0]}
    assert "the hour held more than 3 finished jobs" in text(response)
    # Each read of finished jobs is a window of the (status, finished_at) index; only the
    # bounded one reads their queue.
    reads = [q["sql"] for q in captured.captured_queries if "finished_at" in q["sql"]]
    assert len(reads) == 2 and sum("queue_name" in sql for sql in reads) == 1, reads


def test_under_the_rows_it_reads_the_dashboard_counts_queues_over_the_hour(admin_client):
    now = timezone.now()
    FinishedJobFactory.create_batch(2, queue_name="emails", finished_at=now)
    FinishedJobFactory(queue_name="reports", finished_at=now - timedelta(minutes=50))
    response = admin_client.get(page("dashboard"))
    assert response.context["window"] == "1h" and not response.context["window_cut"]
    rows = {queue["name"]: queue["counts"][-3:] for queue in response.context["queues"]}
    assert rows == {"emails": [2, 0, 0], "reports": [1, 0, 0]}
    assert "(1h): finished in the last hour" in text(response)


def test_processes_show_the_queues_they_serve(admin_client):
    # What run_jobs writes when a process registers (runner/registration.py).
    worker = register_process(
        "default", "worker", metadata={"queues": ["emails", "reports*"], "threads": 4}
    )
    dispatcher = register_process("default", "dispatcher", metadata={"queues": ["*"]})
    dashboard = admin_client.get(page("dashboard")).content.decode()
    row = re.search(rf'<tr id="process-{worker.pk}">(.*?)</tr>', dashboard, re.S).group(1)
    assert '<td class="jobs-queues">emails, reports* · 4 threads</td>' in row
    row = re.search(rf'<tr id="process-{dispatcher.pk}">(.*?)</tr>', dashboard, re.S).group(1)
    assert '<td class="jobs-queues">\u2013</td>' in row  # a dispatcher claims nothing
    listing = text(admin_client.get(page("process")))
    assert "emails, reports* · 4 threads" in listing


def test_the_pages_that_refresh_themselves_load_one_static_script(admin_client):
    for name in ("dashboard", "job", "blockedkey", "stuckjob"):
        html = admin_client.get(page(name)).content.decode()
        assert html.count("django_jobs/refresh.js") == 1, name
        assert 'id="jobs-refresh" data-seconds="10"' in html, name
        assert re.search(r'<span class="jobs-refresh" id="jobs-refresh"[^>]* hidden>', html), name
        assert 'django_jobs/refresh.js" defer></script>' in html, name  # no csp processor
    # A scan of the newest jobs' arguments: never on a timer.
    html = admin_client.get(page("job") + "?q=text:needle").content.decode()
    assert "django_jobs/refresh.js" not in html
    assert "Not refreshed by itself while it shows a scan of the arguments" in html
    assert "django_jobs/refresh.js" in admin_client.get(page("job") + "?q=12").content.decode()
    for name in ("recurringtask", "process"):
        assert "django_jobs/refresh.js" not in admin_client.get(page(name)).content.decode()


def test_the_refresh_script_carries_the_csp_nonce(admin_user, settings):
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "django.middleware.csp.ContentSecurityPolicyMiddleware",
    ]
    settings.SECURE_CSP = {"default-src": [CSP.SELF], "script-src": [CSP.SELF, CSP.NONCE]}
    engine = settings.TEMPLATES[0]
    settings.TEMPLATES = [
        {
            **engine,
            "OPTIONS": {
                **engine["OPTIONS"],
                "context_processors": [
                    *engine["OPTIONS"]["context_processors"],
                    "django.template.context_processors.csp",
                ],
            },
        }
    ]
    client = Client()
    client.force_login(admin_user)
    response = client.get(page("dashboard"))
    nonce = re.search(r"'nonce-([^']+)'", response["Content-Security-Policy"]).group(1)
    tag = re.search(r'<script src="[^"]*django_jobs/refresh.js"[^>]*>', response.content.decode())
    assert tag and f'nonce="{nonce}"' in tag.group(0)


# --- job control (issue 14): cancel and progress -----------------------------------------


def running_job(**kwargs) -> Job:
    """A job claimed and started by a registered worker, as run_jobs leaves it (call it
    before making other ready jobs: it claims one)."""
    worker = register_process("default", "worker")
    job_id = int(tasks.echo.enqueue("x").id)
    (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
    assert start_job("default", job, worker.pk, worker.name)
    if kwargs:
        Job.objects.filter(pk=job_id).update(**kwargs)
    return Job.objects.get(pk=job_id)


def test_cancel_a_waiting_job_from_its_page(admin_client):
    job_id = int(tasks.echo.enqueue("x").id)
    body = admin_client.get(job_url(job_id)).content.decode()
    assert f'action="{job_url(job_id, "cancel")}"' in body
    response = admin_client.post(job_url(job_id, "cancel"), follow=True)
    assert messages_of(response) == [f"Job #{job_id} was cancelled: it will not run."]
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 0)
    assert not ReadyExecution.objects.filter(job_id=job_id).exists()
    assert list(job.failures.values_list("exception_class_path", flat=True)) == [
        "django_jobs.exceptions.JobCancelled"
    ]
    # Ended: no Cancel button any more, and cancelling again says why it did nothing.
    assert "Cancel</button>" not in response.content.decode()
    response = admin_client.post(job_url(job_id, "cancel"), follow=True)
    assert messages_of(response) == [f"Job #{job_id} was not cancelled: it has already ended."]
    assert admin_client.get(job_url(job_id, "cancel")).status_code == 405
    response = admin_client.post(job_url(10**9, "cancel"), follow=True)
    assert messages_of(response) == [f"Job #{10**9} was not cancelled: there is no such job."]


def test_cancel_a_running_job_from_its_page_asks_its_worker(admin_client):
    job = running_job()
    body = admin_client.get(job_url(job.pk)).content.decode()
    assert "Cancel</button>" in body and "Discard</button>" not in body
    response = admin_client.post(job_url(job.pk, "cancel"), follow=True)
    (said,) = messages_of(response)
    assert said.startswith(f"Job #{job.pk}: stop requested.")
    job.refresh_from_db()
    # Only asked: the worker that runs it stops it and records the outcome.
    assert job.status == JobStatus.RUNNING and job.cancel_requested_at is not None
    assert ClaimedExecution.objects.filter(job_id=job.pk).exists()
    assert "Cancel requested at" in text(response)


def test_bulk_cancel_says_what_happened_to_each_job(admin_client):
    running = running_job().pk  # first: it claims the one ready job there is
    waiting = [int(tasks.echo.enqueue(n).id) for n in range(2)]
    blocked = [int(one_at_a_time.enqueue(1).id) for _ in range(2)][1]
    finished = FinishedJobFactory().pk
    response = admin_client.post(
        page("job"),
        {"action": "cancel_selected", "_selected_action": [*waiting, blocked, running, finished]},
        follow=True,
    )
    assert messages_of(response) == [
        "3 jobs cancelled.",
        "1 running job: stop requested (their workers stop them within seconds).",
        "1 job not cancelled: they had already ended.",
    ]
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert [statuses[pk] for pk in [*waiting, blocked]] == [JobStatus.FAILED] * 3
    assert statuses[running] == JobStatus.RUNNING
    assert Job.objects.get(pk=running).cancel_requested_at is not None
    assert statuses[finished] == JobStatus.SUCCEEDED
    assert not BlockedExecution.objects.filter(job_id=blocked).exists()


def test_only_users_who_may_act_can_cancel(viewer, admin_user):
    job_id = int(tasks.echo.enqueue("x").id)
    assert "Cancel</button>" not in viewer.get(job_url(job_id)).content.decode()
    assert viewer.post(job_url(job_id, "cancel")).status_code == 403
    viewer.post(page("job"), {"action": "cancel_selected", "_selected_action": [job_id]})
    csrf_checked = Client(enforce_csrf_checks=True)
    csrf_checked.force_login(admin_user)
    assert csrf_checked.post(job_url(job_id, "cancel")).status_code == 403
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.cancel_requested_at) == (JobStatus.READY, None)


def test_the_job_page_shows_progress_as_a_bar_and_follows_a_running_job(admin_client):
    job = running_job(
        progress_done=42,
        progress_total=168,
        progress_message="rows imported",
        progress_at=timezone.now(),
    )
    html = admin_client.get(job_url(job.pk)).content.decode()
    assert '<progress id="job-progress-bar" max="168" value="42">25%</progress>' in html
    assert '<strong id="job-progress-done">25% · 42 of 168</strong>' in html
    assert '<span id="job-progress-message">rows imported</span>' in html
    assert 'id="jobs-refresh" data-seconds="10"' in html  # it refreshes while unfinished
    # Without a total: the count done, and a bar that says "under way" while it runs.
    Job.objects.filter(pk=job.pk).update(progress_done=1234567, progress_total=None)
    html = admin_client.get(job_url(job.pk)).content.decode()
    assert '<progress id="job-progress-bar">1,234,567 done</progress>' in html
    # A finished job keeps its last report, and its page stops refreshing.
    finished = FinishedJobFactory(progress_done=3.5, progress_total=7, progress_at=timezone.now())
    html = admin_client.get(job_url(finished.pk)).content.decode()
    assert '<strong id="job-progress-done">50% · 3.5 of 7</strong>' in html
    assert "(by its last attempt that ran)" in html
    assert "jobs-refresh" not in html
    # A job that never reported has no progress box.
    assert 'id="job-progress"' not in admin_client.get(job_url(failed_job().pk)).content.decode()


def test_the_job_list_shows_a_running_jobs_progress_in_its_state(admin_client):
    now = timezone.now()
    half = running_job(progress_done=5, progress_total=10, progress_message="half", progress_at=now)
    JobFactory(status=JobStatus.RUNNING, progress_done=12, progress_at=now)  # no total
    FinishedJobFactory(progress_done=10, progress_total=10, progress_at=now)  # not running
    html = admin_client.get(page("job")).content.decode()
    cells = re.findall(r'<td class="field-state">(.*?)</td>', html, re.S)
    assert len(cells) == 3
    with_progress = [cell for cell in cells if "jobs-progress" in cell]
    assert len(with_progress) == 2
    assert '<progress max="100" value="50"></progress> 50%</span>' in html
    assert re.search(r'<span class="jobs-progress" title="50% · 5 of 10: half \(reported ', html)
    assert '<span class="jobs-progress" title="12 done (reported ' in html
    assert ">12 done</span>" in html
    assert half.status == JobStatus.RUNNING


def plant_blocked_keys(n: int, prefix: str) -> None:
    """``n`` keys with one blocked job each, in two bulk inserts."""
    Job.objects.bulk_create(
        Job(
            task_path="tests.tasks.add",
            queue_name="default",
            status=JobStatus.BLOCKED,
            concurrency_key=f"{prefix}{i:05}",
            concurrency_limit=1,
        )
        for i in range(n)
    )
    jobs = Job.objects.filter(concurrency_key__startswith=prefix)
    BlockedExecution.objects.bulk_create(
        BlockedExecution(job_id=pk, queue_name="default", concurrency_key=key)
        for pk, key in jobs.values_list("pk", "concurrency_key")
    )


def test_a_job_page_shows_its_last_failures_and_how_many_in_all(admin_client):
    """A job may fail a million times: its page reads the last 20 failures (a LIMIT in
    the query) and says how many there are."""
    job = FinishedJobFactory(status=JobStatus.FAILED, attempts=200, max_attempts=200)
    FailedExecution.objects.bulk_create(
        FailedExecution(
            job=job, attempt=n, exception_class_path="builtins.ValueError", message=f"fail {n}!"
        )
        for n in range(1, 201)
    )
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(job_url(job.pk))
    assert [failure.attempt for failure in response.context["attempts"]] == [*range(181, 201)]
    body = text(response)
    assert "Errors (200)" in body and "The last 20 of 200 failed attempts." in body
    assert "fail 181!" in body and "fail 200!" in body and "fail 180!" not in body
    table = connection.ops.quote_name(FailedExecution._meta.db_table)
    reads = [q["sql"] for q in queries if f"FROM {table}" in q["sql"]]
    assert reads and all("LIMIT" in sql for sql in reads), reads


def test_a_job_page_cuts_long_texts_and_says_how_long_they_are(admin_client):
    """Arguments and a return value of a MiB, a 64 KiB traceback, a long message and a
    worker id per attempt: the page shows their start and end, and the total length."""
    frames = "".join(f'  File "app.py", line {n}, in f\n    f()\n' for n in range(2000))
    traceback = f"Traceback (most recent call last):\n{frames}RecursionError: the very end"
    job = FinishedJobFactory(
        args=["a" * 300_000],
        kwargs={"k": "b" * 300_000},
        return_value="c" * 300_000,
        worker_ids=[f"worker-{n}" for n in range(5000)],
    )
    FailedExecutionFactory(job=job, message="m" * 10_000, traceback=traceback)
    response = admin_client.get(job_url(job.pk))
    html = response.content.decode()
    assert len(html) < 120_000
    assert html.count("characters not shown") == 5  # args, kwargs, return, message, traceback
    assert "300,004 characters not shown" not in html  # the start and the end are shown
    assert f"of {len(traceback):,} characters not shown" in html
    assert "RecursionError: the very end" in html and "Traceback (most recent" in html
    assert "4990 earlier, then worker-4990, " in text(response)
    assert "worker-4989" not in html


def test_the_stuck_page_reads_a_bounded_number_of_blocked_keys(admin_client):
    """It looks for jobs blocked behind a free slot among the first keys only (a LIMIT in
    the grouped query), and says how many keys it left out."""
    from django_jobs.admin import stuck
    from django_jobs.observability import inspection

    plant_blocked_keys(inspection.KEYS_READ + 100, prefix="k")
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(page("stuckjob"))
    table = connection.ops.quote_name(BlockedExecution._meta.db_table)
    # The keys' grouped query (with each one's oldest blocked job), not the per-queue count.
    grouped = [q["sql"] for q in queries if f"FROM {table}" in q["sql"] and "MIN(" in q["sql"]]
    assert grouped and all(f"LIMIT {inspection.KEYS_READ}" in sql for sql in grouped), grouped
    note = f"Only the first {inspection.KEYS_READ} of {inspection.KEYS_READ + 100} keys"
    assert note in text(response)
    # The count stops past its cap too.
    note = stuck.keys_note(inspection.KEYS_READ, inspection.COUNT_CAP + 1)
    assert f"of more than {inspection.COUNT_CAP:,} keys" in note


def test_the_job_list_reads_no_arguments_or_return_values(admin_client):
    """50 rows of 1 MiB arguments and results each: the list shows neither."""
    FinishedJobFactory.create_batch(3, args=["a" * 1000], return_value="r" * 1000)
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(page("job"))
    assert len(response.context["cl"].result_list) == 3
    qn = connection.ops.quote_name
    for column in ("args", "kwargs", "return_value", "worker_ids"):
        read = f"{qn(Job._meta.db_table)}.{qn(column)}"
        assert not [q["sql"] for q in queries if read in q["sql"]], column
