"""The admin's recurring tasks and batches pages through Django's test client: the facts
each shows, what each action does, who may do it, and that a batch's page costs the
same number of queries however many items it has."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_jobs import enqueue_batch
from django_jobs.admin import batches as batches_admin
from django_jobs.core.batches import current_job_id
from django_jobs.core.claimed import fail_job, finish_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.recurring import enqueue_tick, parse_entry, sync_recurring_tasks
from django_jobs.core.rows import ErrorInfo
from django_jobs.core.starting import start_job
from django_jobs.models import Batch, Job, JobStatus, RecurringExecution, RecurringTask
from tests import batch_tasks as bt
from tests.test_admin import messages_of, text

pytestmark = pytest.mark.django_db

DB = "default"
NIGHTLY = {
    "task": "tests.tasks.echo",
    "schedule": "0 3 * * *",
    "timezone": "Europe/Paris",
    "args": ["nightly"],
    "description": "the nightly report",
}
FAST = {"task": "tests.tasks.add", "schedule": "every 30 seconds", "args": [1, 2]}
RECURRING = {"DJANGO_JOBS": {"recurring": {"nightly": NIGHTLY, "fast": FAST}}}
BOOM = ErrorInfo("builtins.ValueError", "boom", "ValueError: boom")


def url(name: str, *args) -> str:
    return reverse(f"admin:django_jobs_{name}", args=args)


RECURRING_PAGE = "recurringtask_changelist"


def rows_of(response) -> dict:
    return {row.key: row for row in response.context["tasks"]}


def next_3am_paris(now: datetime) -> datetime:
    """03:00 in Paris after ``now``, by calendar arithmetic (not the scheduler's code)."""
    paris = ZoneInfo("Europe/Paris")
    day = now.astimezone(paris).date()
    while True:
        candidate = datetime(day.year, day.month, day.day, 3, tzinfo=paris)
        if candidate > now:
            return candidate.astimezone(UTC)
        day += timedelta(days=1)


# --- recurring tasks --------------------------------------------------------------------


@override_settings(**RECURRING)
def test_recurring_page_merges_settings_with_rows(admin_client):
    sync_recurring_tasks(DB, [parse_entry("nightly", NIGHTLY)])
    tick = datetime(2026, 1, 5, 2, tzinfo=UTC)
    job_id = enqueue_tick(DB, parse_entry("nightly", NIGHTLY), tick)
    RecurringTask.objects.create(key="gone", task_path="tests.tasks.add", schedule="@daily")

    response = admin_client.get(url(RECURRING_PAGE))
    assert response.status_code == 200
    rows = rows_of(response)
    assert list(rows) == ["fast", "gone", "nightly"]
    nightly, fast, gone = rows["nightly"], rows["fast"], rows["gone"]
    now = response.context["now"]

    assert (nightly.task_path, nightly.schedule, nightly.time_zone) == (
        "tests.tasks.echo",
        "0 3 * * *",
        "Europe/Paris",
    )
    assert nightly.in_settings and nightly.synced and nightly.enabled
    assert (nightly.last_run_at, nightly.last_job_id) == (tick, job_id)
    assert [(e.run_at, e.job_id) for e in nightly.executions] == [(tick, job_id)]
    assert nightly.next_run_at == next_3am_paris(now)

    # Not synced yet: still shown, with its next tick on the 30-second grid.
    assert fast.in_settings and not fast.synced and fast.enabled and fast.last_run_at is None
    seconds = int(now.timestamp())
    assert fast.next_run_at == datetime.fromtimestamp((seconds // 30 + 1) * 30, UTC)

    assert not gone.in_settings and gone.next_run_at is None

    body = text(response)
    assert "not in settings" in body and "not synced yet" in body
    assert "the nightly report" in body and "Europe/Paris" in body
    assert url("job_change", job_id) in response.content.decode()
    # A button for each configured key, none for the key that left the settings.
    assert response.content.decode().count(">Run now</button>") == 2


@override_settings(**RECURRING)
def test_run_now_enqueues_one_job_even_before_the_first_sync(admin_client):
    response = admin_client.post(url("recurringtask_run_now"), {"key": "fast"}, follow=True)
    (job,) = Job.objects.all()
    assert (job.task_path, job.args) == ("tests.tasks.add", [1, 2])
    assert RecurringExecution.objects.get(task_key="fast").job_id == job.pk
    assert RecurringTask.objects.get(key="fast").last_job_id == job.pk
    assert messages_of(response) == [f"Recurring task “fast” enqueued now: job #{job.pk}."]
    assert rows_of(response)["fast"].last_job_id == job.pk


@override_settings(**RECURRING)
def test_disable_and_enable_flip_the_row_and_the_next_run(admin_client):
    # No row yet: disabling syncs the entries first.
    response = admin_client.post(url("recurringtask_disable"), {"key": "nightly"}, follow=True)
    assert RecurringTask.objects.get(key="nightly").enabled is False
    assert any("“nightly” disabled" in m for m in messages_of(response))
    nightly = rows_of(response)["nightly"]
    assert not nightly.enabled and nightly.next_run_at is None
    assert "Enable" in text(response)

    again = admin_client.post(url("recurringtask_disable"), {"key": "nightly"}, follow=True)
    assert any("already disabled" in m for m in messages_of(again))

    before = timezone.now()
    response = admin_client.post(url("recurringtask_enable"), {"key": "nightly"}, follow=True)
    row = RecurringTask.objects.get(key="nightly")
    assert row.enabled and row.active_since >= before
    assert any("“nightly” enabled" in m for m in messages_of(response))
    assert rows_of(response)["nightly"].next_run_at == next_3am_paris(response.context["now"])


@override_settings(**RECURRING)
def test_an_unknown_key_is_a_clear_error(admin_client):
    for action in ("run_now", "enable", "disable"):
        response = admin_client.post(url(f"recurringtask_{action}"), {"key": "nope"}, follow=True)
        assert messages_of(response) == [
            "No recurring task “nope”: it is not in DJANGO_JOBS['recurring']."
        ], action
    assert not Job.objects.exists() and not RecurringTask.objects.exists()


@override_settings(**RECURRING)
def test_view_only_users_see_recurring_tasks_but_cannot_act(viewer):
    sync_recurring_tasks(DB, [parse_entry("nightly", NIGHTLY)])
    response = viewer.get(url(RECURRING_PAGE))
    assert response.status_code == 200 and set(rows_of(response)) == {"nightly", "fast"}
    assert "<form" not in response.content.decode().split('id="recurring"')[1]
    refused = [
        viewer.post(url("recurringtask_run_now"), {"key": "nightly"}).status_code,
        viewer.post(url("recurringtask_disable"), {"key": "nightly"}).status_code,
        viewer.post(url("recurringtask_enable"), {"key": "nightly"}).status_code,
    ]
    assert refused == [403, 403, 403]
    assert not Job.objects.exists() and RecurringTask.objects.get(key="nightly").enabled


@override_settings(**RECURRING)
def test_recurring_actions_need_post_and_a_csrf_token(admin_user, admin_client):
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    assert client.post(url("recurringtask_run_now"), {"key": "nightly"}).status_code == 403
    assert admin_client.get(url("recurringtask_run_now")).status_code == 403
    assert not Job.objects.exists()


# --- batches ----------------------------------------------------------------------------


def finish_items(n_ok: int, n_failed: int) -> None:
    """Claim every ready job and finish ``n_ok``, fail ``n_failed`` of them (by id order)."""
    worker = register_process(DB, "worker")
    claimed = sorted(
        claim_jobs(DB, worker.pk, QueueSelector(("*",)), n_ok + n_failed), key=lambda j: j.pk
    )
    assert len(claimed) == n_ok + n_failed
    for i, job in enumerate(claimed):
        assert start_job(DB, job, worker.pk, worker.name)
        if i < n_ok:
            finish_job(DB, job.pk, worker.pk, None)
        else:
            fail_job(DB, job.pk, worker.pk, BOOM)


def items(n: int):
    return [(bt.item, [i], {}) for i in range(n)]


def test_batch_list_shows_progress_and_filters_finished(admin_client):
    running = enqueue_batch(items(3), description="import").id
    finish_items(1, 0)
    empty = enqueue_batch([], on_finish=bt.callback, description="empty").id

    def listed(query: str = "") -> list[int]:
        response = admin_client.get(url("batch_changelist") + query)
        assert response.status_code == 200
        return [batch.pk for batch in response.context["cl"].result_list]

    assert listed() == [empty, running]
    assert listed("?finished=yes") == [empty]
    assert listed("?finished=no") == [running]
    body = text(admin_client.get(url("batch_changelist")))
    assert "import" in body and "1/3" in body and "0/0" in body


def test_batch_page_counts_callbacks_parent_and_children(admin_client):
    batch_id = enqueue_batch(
        items(3),
        on_finish=bt.callback,
        on_success=bt.report_callback,
        on_failure=bt.callback,
        description="import",
    ).id
    response = admin_client.get(url("batch_change", batch_id))
    states = {cb["name"]: cb["state"] for cb in response.context["callbacks"]}
    assert states == dict.fromkeys(("on_finish", "on_success", "on_failure"), "not yet enqueued")
    assert 'value="0"' in response.content.decode()  # the progress bar, empty

    finish_items(2, 1)
    batch = Batch.objects.get(pk=batch_id)
    response = admin_client.get(url("batch_change", batch_id))
    assert response.context["done"] == 3 and response.context["percent"] == 100
    callbacks = {cb["name"]: cb for cb in response.context["callbacks"]}
    assert callbacks["on_finish"]["job_id"] == batch.callback_jobs["on_finish"]
    assert callbacks["on_finish"]["state"] == JobStatus.READY
    assert callbacks["on_failure"]["job_id"] == batch.callback_jobs["on_failure"]
    assert callbacks["on_success"] == {
        "name": "on_success",
        "task_path": "tests.batch_tasks.report_callback",
        "job_id": None,
        "state": "not run: an item failed",
    }
    body = text(response)
    assert "3/3" in body and "succeeded 2" in body and "failed 1" in body
    assert "not a task" in body  # no parent: enqueued directly

    # The on_finish callback runs and enqueues the next stage: a child batch.
    parent_job = batch.callback_jobs["on_finish"]
    token = current_job_id.set(parent_job)
    try:
        child = enqueue_batch(items(2), description="next stage").id
    finally:
        current_job_id.reset(token)
    response = admin_client.get(url("batch_change", batch_id))
    assert [c.pk for c in response.context["children"]] == [child]
    assert url("batch_change", child) in response.content.decode()
    response = admin_client.get(url("batch_change", child))
    assert response.context["parent"].pk == parent_job
    assert url("job_change", parent_job) in response.content.decode()
    assert response.context["children"] == []


def test_batch_page_caps_its_items_and_links_the_job_list(admin_client, monkeypatch):
    monkeypatch.setattr(batches_admin, "ITEMS_SHOWN", 3)
    made = enqueue_batch(items(5), description="big")
    other = enqueue_batch(items(2)).id
    ids = [int(r.id) for r in made.results]
    response = admin_client.get(url("batch_change", made.id))
    assert [job.pk for job in response.context["items"]] == sorted(ids)[:3]
    assert response.context["more_items"]
    assert "The first 3 of 5" in text(response)
    link = f"{url('job_changelist')}?batch={made.id}"
    assert link in response.content.decode()

    listed = admin_client.get(link).context["cl"].result_list
    assert sorted(job.pk for job in listed) == sorted(ids)
    assert other not in {job.batch_id for job in listed}
    assert (
        list(admin_client.get(url("job_changelist") + "?batch=x").context["cl"].result_list) == []
    )


def test_batch_page_queries_do_not_grow_with_its_items(admin_client, django_assert_max_num_queries):
    small = enqueue_batch(items(2), on_finish=bt.callback).id
    finish_items(2, 0)
    big = enqueue_batch(items(batches_admin.ITEMS_SHOWN + 40), on_finish=bt.callback).id
    finish_items(30, 10)
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(url("batch_change", small)).status_code == 200
    with django_assert_max_num_queries(len(queries)):
        response = admin_client.get(url("batch_change", big))
    assert len(response.context["items"]) == batches_admin.ITEMS_SHOWN
    for sql in (q["sql"] for q in queries):
        assert not ("COUNT(" in sql.upper() and "django_jobs_job" in sql), sql


def test_batch_page_reads_the_start_of_each_items_arguments(admin_client):
    """An item's arguments may take 1 MiB of JSON: the page reads their start only."""
    made = enqueue_batch([(bt.item, ["x" * 200_000], {}), (bt.item, [1], {})])
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(url("batch_change", made.id))
    big, small = response.context["items"]
    assert len(big.args_start) == batches_admin.ARGS_READ
    assert big.args_start.startswith('["xxx') and small.args_start == "[1]"
    assert "<code>[1]</code>" in response.content.decode()
    # Not read whole: its start is cut in the query.
    assert "args" in big.get_deferred_fields()
    (read,) = [q["sql"] for q in queries if "args" in q["sql"] and "batch_id" in q["sql"]]
    assert f", {batches_admin.ARGS_READ})" in read, read


def test_job_page_shows_its_batch_and_unique_key(admin_client):
    made = enqueue_batch(items(1))
    item = int(made.results[0].id)
    body = admin_client.get(url("job_change", item)).content.decode()
    assert url("batch_change", made.id) in body

    unique = int(bt.unique_report.enqueue(7).id)
    key = Job.objects.get(pk=unique).unique_key
    assert key and "report:7" in key
    body = text(admin_client.get(url("job_change", unique)))
    assert f"{key} (unique until it finishes (waiting and running jobs); held now)" in body


def test_view_only_users_see_batches_and_cannot_change_them(viewer):
    batch_id = enqueue_batch(items(2), description="import").id
    assert viewer.get(url("batch_changelist")).status_code == 200
    response = viewer.get(url("batch_change", batch_id))
    assert response.status_code == 200 and "import" in text(response)
    assert viewer.post(url("batch_change", batch_id), {"pending": 0}).status_code == 403
    assert Batch.objects.get(pk=batch_id).pending == 2


def test_both_pages_are_linked_from_the_app_index_and_the_dashboard(admin_client):
    index = admin_client.get(reverse("admin:app_list", args=["django_jobs"])).content.decode()
    dashboard = admin_client.get(url("dashboard_changelist")).content.decode()
    for name in (RECURRING_PAGE, "batch_changelist"):
        assert url(name) in index and url(name) in dashboard
        assert admin_client.get(url(name)).status_code == 200


def test_staff_without_job_permissions_are_kept_out(client):
    client.force_login(User.objects.create_user("staff", password="pw", is_staff=True))
    batch_id = enqueue_batch(items(1)).id
    for page in (url(RECURRING_PAGE), url("batch_changelist"), url("batch_change", batch_id)):
        assert client.get(page).status_code == 403, page


def test_page_entries_expose_no_stock_edit_form(admin_client):
    """The proxies' (and recurring tasks') model rows are changed only through actions."""
    job_id = int(bt.item.enqueue(1).id)
    RecurringTask.objects.create(key="nightly", task_path="tests.tasks.echo", schedule="@daily")
    row = RecurringTask.objects.get().pk
    for model, pk in (("dashboard", job_id), ("stuckjob", job_id), ("recurringtask", row)):
        for what in ("change", "delete", "history"):
            path = f"/admin/django_jobs/{model}/{pk}/{what}/"
            assert admin_client.get(path).status_code == 404, path
    post = admin_client.post(f"/admin/django_jobs/dashboard/{job_id}/change/", {"priority": 9})
    assert post.status_code == 404
    assert Job.objects.get(pk=job_id).priority == 0
