"""The jobs admin in a real browser: Debian's Chromium, headless, driven by Playwright.

Each test logs in through the login form and clicks what an operator would
click; the database is then checked, not only the page. A screenshot of each
test's last page is saved under ``artifacts/screenshots/`` (or
``$JOBS_TEST_ARTIFACTS/screenshots``) whether it passed or not.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.utils import timezone

import django_jobs
from django_jobs import enqueue_batch
from django_jobs import task as jobs_task
from django_jobs.admin.dashboard import DashboardAdmin
from django_jobs.admin.jobs import JobAdmin
from django_jobs.core.claimed import finish_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import (
    ClaimedExecution,
    Job,
    JobStatus,
    Pause,
    RecurringExecution,
    Semaphore,
)
from tests import batch_tasks, progress_tasks, tasks
from tests.factories import (
    FailedExecutionFactory,
    FinishedJobFactory,
    JobFactory,
    ProcessFactory,
    ReadyExecutionFactory,
)
from tests.harness import app_permissions, error_paths, job_row, wait_until

if os.environ.get("CI"):
    from playwright import sync_api as playwright  # CI must run these, never skip them
else:
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[browser]'")

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("JOBS_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("JOBS_TEST_ARTIFACTS", Path(__file__).parent.parent / "artifacts"))
PASSWORD = "correct horse battery staple"
one_at_a_time = jobs_task(tasks.echo.func, concurrency_key="acct:{value}", concurrency_limit=1)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """One browser for this module only: Playwright's sync API keeps an asyncio loop
    in this thread while it runs, which would break ``async_to_sync`` in the tests
    that follow (the executor's async tasks) if it outlived the module."""
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} not found: install Debian's chromium package (apt-get install chromium) "
            "or point JOBS_CHROMIUM at a Chromium binary"
        )
    # The test's own ORM calls (planting rows, checking them) are synchronous and
    # safe, but Django refuses them while an event loop runs in the thread.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
            )
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser, live_server, request) -> Iterator:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    tab = context.new_page()
    tab.base_url = live_server.url
    yield tab
    shots = ARTIFACTS / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{request.node.name}-{connection.vendor}")
    tab.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    context.close()


def log_in(page, username: str, *, view_only: bool = False, path: str = "/admin/") -> None:
    user = User.objects.create_user(username, password=PASSWORD, is_staff=True)
    if view_only:
        app_permissions()
        user.user_permissions.add(Permission.objects.get(codename="view_job"))
    else:
        user.is_superuser = True
        user.save()
    page.goto(f"{page.base_url}/admin/login/?next={path}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{path}")


def message(page) -> str:
    return page.locator("ul.messagelist").inner_text()


def test_log_in_and_read_the_dashboard(page):
    now = timezone.now()
    ReadyExecutionFactory.create_batch(2, job__queue_name="emails")
    FinishedJobFactory.create_batch(3, queue_name="emails", finished_at=now)
    FinishedJobFactory(queue_name="emails", status=JobStatus.FAILED, finished_at=now)
    ProcessFactory(hostname="box-1", pid=4242)
    log_in(page, "ops", path="/admin/")
    page.click("text=Dashboard")
    page.wait_for_url("**/admin/django_jobs/dashboard/")
    row = page.locator("#queue-emails")
    # ready, scheduled, blocked, awaiting, running, succeeded (1h), failed (1h), discarded (1h)
    counts = ["2", "0", "0", "0", "0", "3", "1", "0"]
    assert row.locator("td.jobs-num").all_inner_texts() == counts
    assert page.locator("svg.jobs-chart rect.ok").count() == 1
    assert page.locator("svg.jobs-chart rect.failed").count() == 1
    assert "box-1" in page.locator("#processes").inner_text()


def test_filter_the_job_list(page):
    failed = FailedExecutionFactory(job__finished_at=timezone.now()).job
    JobFactory.create_batch(3)
    log_in(page, "ops", path="/admin/django_jobs/job/")
    assert page.locator("#result_list tbody tr").count() == 4
    page.locator("#changelist-filter").get_by_role("link", name="Failed", exact=True).click()
    page.wait_for_url("**status__exact=failed**")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    assert rows.first.locator("th a").inner_text() == f"#{failed.pk} add"


def test_retry_a_failed_job(page):
    job = FailedExecutionFactory(job__finished_at=timezone.now()).job
    log_in(page, "ops", path=f"/admin/django_jobs/job/{job.pk}/change/")
    assert "ValueError" in page.locator("#attempts").inner_text()
    page.get_by_role("button", name="Retry").click()
    assert f"Job #{job.pk} will be retried" in message(page)
    assert page.locator("#job-state").inner_text() == "ready"
    assert Job.objects.get(pk=job.pk).status == JobStatus.READY


def test_discard_a_blocked_job_and_run_another_now(page):
    holder, blocked, other = (int(one_at_a_time.enqueue(1).id) for _ in range(3))
    log_in(page, "ops", path=f"/admin/django_jobs/job/{blocked}/change/")
    page.get_by_role("button", name="Discard").click()
    assert f"Job #{blocked} was discarded" in message(page)
    assert Job.objects.get(pk=blocked).status == JobStatus.DISCARDED

    page.goto(f"{page.base_url}/admin/django_jobs/blockedkey/")
    page.get_by_role("link", name="run now").click()
    assert "bypasses the concurrency limit" in page.locator(".jobs-warning").inner_text()
    page.get_by_role("button", name="Yes, run 1 job now").click()
    assert "1 job made ready past their limit" in message(page)
    assert Job.objects.get(pk=other).status == JobStatus.READY
    assert Job.objects.get(pk=holder).status == JobStatus.READY
    assert Semaphore.objects.get().value == -1


def test_pause_and_resume_a_queue(page):
    ReadyExecutionFactory(job__queue_name="emails")
    log_in(page, "ops", path="/admin/django_jobs/dashboard/")
    page.locator("#queue-emails").get_by_role("button", name="Pause").click()
    assert "Queue “emails” paused" in message(page)
    assert "paused" in page.locator("#queue-emails").inner_text()
    assert list(Pause.objects.values_list("queue_name", flat=True)) == ["emails"]
    page.locator("#queue-emails").get_by_role("button", name="Resume").click()
    assert "Queue “emails” resumed" in message(page)
    assert not Pause.objects.exists()


def test_the_stuck_page_shows_a_planted_stuck_job(page):
    dead = ProcessFactory(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    claim = ClaimedExecution.objects.create(job=JobFactory(status=JobStatus.RUNNING), process=dead)
    dispatcher = register_process("default", "dispatcher", metadata={"queues": ["*"]})
    log_in(page, "ops", path="/admin/django_jobs/stuckjob/")
    assert page.inner_text("#dispatcher-status") == f"A dispatcher is running: {dispatcher.name}."
    assert "No dispatcher" not in page.inner_text("#content")
    section = page.locator("#stuck-claimed_by_dead_process")
    assert section.locator(".jobs-stuck-count").inner_text() == "1"
    section.get_by_role("link", name=f"#{claim.job_id}").click()
    assert "claimed" in page.locator("#execution").inner_text()


def test_run_a_recurring_task_now_and_follow_a_batch(page, settings):
    settings.DJANGO_JOBS = {
        **settings.DJANGO_JOBS,
        "recurring": {
            "nightly": {"task": "tests.tasks.echo", "schedule": "0 3 * * *", "args": ["x"]}
        },
    }
    batch = enqueue_batch(
        [(batch_tasks.item, [n], {}) for n in range(3)],
        on_finish=batch_tasks.callback,
        description="import",
    )
    worker = register_process("default", "worker")
    (first,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
    assert start_job("default", first, worker.pk, worker.name)
    finish_job("default", first.pk, worker.pk, None)

    log_in(page, "ops", path="/admin/django_jobs/dashboard/")
    page.locator("#content").get_by_role("link", name="Recurring tasks").click()
    row = page.locator("#recurring-nightly")
    assert "0 3 * * *" in row.inner_text()
    row.get_by_role("button", name="Run now").click()
    (job,) = Job.objects.filter(task_path="tests.tasks.echo")
    assert f"Recurring task “nightly” enqueued now: job #{job.pk}." in message(page)
    assert f"#{job.pk}" in page.locator("#recurring-nightly .jobs-last-run").inner_text()
    assert RecurringExecution.objects.get().job_id == job.pk

    page.locator("#content").get_by_role("link", name="Batches").click()
    page.locator("#result_list").get_by_role("link", name="import").click()
    page.wait_for_url(f"**/admin/django_jobs/batch/{batch.id}/change/")
    assert page.locator("#batch-done").inner_text() == "1/3"
    assert page.locator("#batch-bar").get_attribute("value") == "1"
    assert "not yet enqueued" in page.locator("#callback-on_finish").inner_text()
    page.locator("#batch-all-items").click()
    page.wait_for_url(f"**batch={batch.id}")
    assert page.locator("#result_list tbody tr").count() == 3
    page.go_back()  # end on the batch page, for the screenshot
    page.wait_for_url(f"**/admin/django_jobs/batch/{batch.id}/change/")


def test_a_view_only_user_sees_the_job_but_cannot_act(page):
    job = FailedExecutionFactory(job__finished_at=timezone.now()).job
    log_in(page, "viewer", view_only=True, path=f"/admin/django_jobs/job/{job.pk}/change/")
    assert "ValueError" in page.locator("#attempts").inner_text()
    assert page.get_by_role("button", name="Retry").count() == 0
    # Forge the POST the Retry button would send, with a valid CSRF token.
    status = page.evaluate(
        """async (url) => {
            const token = document.cookie.match(/csrftoken=([^;]+)/)[1];
            const response = await fetch(url, {method: "POST", headers: {"X-CSRFToken": token}});
            return response.status;
        }""",
        f"/admin/django_jobs/job/{job.pk}/retry/",
    )
    assert status == 403
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED


# --- the polish of issue 15 -------------------------------------------------------------


def breadcrumbs_style(page) -> dict:
    return page.evaluate(
        """() => {
            const crumbs = document.querySelector("nav[aria-label] .breadcrumbs");
            const style = getComputedStyle(crumbs);
            return {tag: crumbs.tagName, background: style.backgroundColor,
                    padding: style.paddingLeft, color: style.color};
        }"""
    )


def test_breadcrumbs_look_like_the_admins_own(page):
    job = FailedExecutionFactory(job__finished_at=timezone.now()).job
    batch = enqueue_batch([(tasks.add, [1, 2], {})], description="b")
    log_in(page, "ops", path="/admin/django_jobs/")
    admins_own = breadcrumbs_style(page)  # Django's own app index
    assert admins_own["background"] != "rgba(0, 0, 0, 0)"
    for path in (
        "/admin/django_jobs/dashboard/",
        "/admin/django_jobs/blockedkey/",
        "/admin/django_jobs/stuckjob/",
        "/admin/django_jobs/recurringtask/",
        f"/admin/django_jobs/job/{job.pk}/change/",
        f"/admin/django_jobs/batch/{batch.id}/change/",
    ):
        page.goto(page.base_url + path)
        assert breadcrumbs_style(page) == admins_own, path
    crumbs = page.locator("nav[aria-label] .breadcrumbs")
    assert crumbs.locator("a").all_inner_texts() == ["Home", "Jobs", "Batches"]
    assert crumbs.inner_text().strip().endswith(f"#{batch.id}")


def test_the_job_list_fits_its_area_and_shows_keys_without_the_task_path(page):
    for n in range(3):
        one_at_a_time.enqueue(12345678 + n)
    FailedExecutionFactory(
        job__finished_at=timezone.now(),
        job__task_path="myproject.billing.tasks.charge_customer_card_for_invoice",
    )
    log_in(page, "ops", path="/admin/django_jobs/job/")  # 1280 px wide, with the nav sidebar
    results = page.locator("#changelist .results")
    widths = results.evaluate("el => [el.scrollWidth, el.clientWidth]")
    assert widths[0] <= widths[1], f"the list is {widths[0]} px wide in {widths[1]} px"
    key = page.locator("#result_list .jobs-key").first
    assert key.inner_text() == "acct:12345680"
    assert key.get_attribute("title") == "tests.tasks.echo/acct:12345680"
    task = page.locator("#result_list .jobs-task").first
    assert task.get_attribute("title") == "myproject.billing.tasks.charge_customer_card_for_invoice"


def ticks(page) -> int:
    return page.evaluate("Number(document.documentElement.dataset.jobsRefreshTicks || 0)")


def wait_for_ticks(page, n: int) -> None:
    """Until the refresh timer has fired ``n`` more times (whatever it then did)."""
    page.wait_for_function(
        "n => Number(document.documentElement.dataset.jobsRefreshTicks || 0) >= n",
        arg=ticks(page) + n,
    )


def test_the_dashboard_refreshes_itself_while_nobody_uses_it(page, monkeypatch):
    monkeypatch.setattr(DashboardAdmin, "refresh_seconds", 1)
    log_in(page, "ops", path="/admin/django_jobs/dashboard/")
    toggle = page.locator("#jobs-refresh-toggle")
    assert toggle.is_visible() and toggle.is_checked()
    ready = page.locator("#queue-emails td.jobs-num").first
    ReadyExecutionFactory(job__queue_name="emails")
    playwright.expect(ready).to_have_text("1")
    assert page.evaluate("document.documentElement.dataset.jobsRefreshes") is not None

    # Typing a queue name to pause: the page stays as it is, and says why.
    page.fill("#pause-queue", "repo")
    ReadyExecutionFactory(job__queue_name="emails")
    wait_for_ticks(page, 2)
    assert ready.inner_text() == "1"
    assert page.input_value("#pause-queue") == "repo"
    assert "Paused: a field has the focus" in page.inner_text("#jobs-refresh-status")
    page.fill("#pause-queue", "")
    page.locator("#pause-queue").blur()
    playwright.expect(ready).to_have_text("2")

    # Switched off, it stays off, across a reload too.
    page.locator("#jobs-refresh-toggle").uncheck()
    ReadyExecutionFactory(job__queue_name="emails")
    wait_for_ticks(page, 2)
    assert ready.inner_text() == "2"
    page.reload()
    playwright.expect(ready).to_have_text("3")
    assert not page.locator("#jobs-refresh-toggle").is_checked()
    ReadyExecutionFactory(job__queue_name="emails")
    wait_for_ticks(page, 2)
    assert ready.inner_text() == "3"
    page.locator("#jobs-refresh-toggle").check()
    playwright.expect(ready).to_have_text("4")


def test_the_job_list_reloads_itself_unless_a_row_is_ticked(page, monkeypatch):
    monkeypatch.setattr(JobAdmin, "refresh_seconds", 1)
    JobFactory.create_batch(2)
    log_in(page, "ops", path="/admin/django_jobs/job/")
    rows = page.locator("#result_list tbody tr")
    JobFactory()
    playwright.expect(rows).to_have_count(3)

    # A ticked row is a selection in progress: no reload under it.
    page.evaluate("window.jobsMarker = 'before'")
    rows.first.locator("input.action-select").check()
    JobFactory()
    wait_for_ticks(page, 2)
    assert rows.count() == 3
    assert page.evaluate("window.jobsMarker") == "before"
    assert rows.first.locator("input.action-select").is_checked()
    assert "Paused: a form is being filled in" in page.inner_text("#jobs-refresh-status")

    rows.first.locator("input.action-select").uncheck()
    playwright.expect(rows).to_have_count(4)
    assert page.evaluate("window.jobsMarker") is None  # reloaded, not patched in place
    # Django's own script still works on the reloaded page.
    page.locator("#action-toggle").check()
    playwright.expect(page.locator(".action-counter")).to_have_text("4 of 4 selected")


# --- job control (issue 14): cancel from the admin, progress on the job's page ----------


def test_cancel_a_running_job_from_its_page_and_watch_its_progress(page, run_jobs, tmp_path):
    # The job sees the cancel at once (NOTIFY on PostgreSQL) but stops only once the
    # gate exists: the page after the click must show a cancel still pending.
    gate = tmp_path / "gate"
    result = progress_tasks.reports_until_cancelled.enqueue(str(gate))
    proc = run_jobs("--processes", "1", "--threads", "2")
    wait_until(
        lambda: django_jobs.progress(result.id) is not None,
        30,
        what=f"the job's first progress report; run_jobs said:\n{proc.output()}",
    )
    log_in(page, "ops", path=f"/admin/django_jobs/job/{result.id}/change/")
    assert page.locator("#job-state").inner_text() == "running"
    bar = page.locator("#job-progress-bar")
    assert bar.get_attribute("max") == "200" and 0 < int(bar.get_attribute("value")) < 200
    assert re.fullmatch(r"row \d+ of 200", page.locator("#job-progress-message").inner_text())

    page.locator("#job-actions").get_by_role("button", name="Cancel").click()
    assert f"Job #{result.id}: stop requested." in message(page)
    assert "Cancel requested at" in page.locator("#job-cancel-requested").inner_text()
    gate.touch()
    wait_until(lambda: job_row(result).status == JobStatus.FAILED, 30, what="the job to stop")
    page.reload()
    assert page.locator("#job-state").inner_text() == "failed"
    assert "django_jobs.exceptions.JobCancelled" in page.locator("#attempts").inner_text()
    actions = page.locator("#job-actions")
    assert actions.get_by_role("button", name="Cancel").count() == 0  # ended: nothing to stop
    assert actions.get_by_role("button", name="Retry").count() == 1  # an operator may, by hand
    assert error_paths(result) == ["django_jobs.exceptions.JobCancelled"]  # never retried
    assert job_row(result).attempts == 1
    # Its last report stays on the page, from the attempt that ran.
    assert "(by its last attempt that ran)" in page.locator("#job-progress").inner_text()


def test_cancel_selected_waiting_jobs_from_the_list(page):
    ready = int(tasks.add.enqueue(1, 2).id)
    later = int(tasks.add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1, 2).id)
    holder, blocked = (int(one_at_a_time.enqueue(7).id) for _ in range(2))
    kept = int(tasks.add.enqueue(3, 4).id)
    log_in(page, "ops", path="/admin/django_jobs/job/")
    for job_id in (ready, later, blocked):
        page.locator(f"#result_list input.action-select[value='{job_id}']").check()
    page.select_option("select[name=action]", "cancel_selected")
    page.locator("#changelist-form .actions button[name=index]").click()  # "Go", or 6.1's "Run"
    assert "3 jobs cancelled." in message(page)
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert [statuses[pk] for pk in (ready, later, blocked)] == [JobStatus.FAILED] * 3
    assert statuses[holder] == statuses[kept] == JobStatus.READY
    for job_id in (ready, later, blocked):
        assert error_paths(job_id) == ["django_jobs.exceptions.JobCancelled"]
    rows = page.locator("#result_list tbody tr")
    assert rows.filter(has_text=f"#{blocked} ").locator(".jobs-state").inner_text() == "failed"


def test_the_job_list_shows_a_running_jobs_progress_whole_in_its_narrow_state_cell(page):
    worker = register_process("default", "worker")
    tasks.echo.enqueue("x")
    (job,) = claim_jobs("default", worker.pk, QueueSelector(("*",)), 1)
    assert start_job("default", job, worker.pk, worker.name)
    Job.objects.filter(pk=job.pk).update(
        progress_done=1234, progress_total=2000, progress_at=timezone.now()
    )
    FinishedJobFactory.create_batch(3)
    log_in(page, "ops", path="/admin/django_jobs/job/")  # 1280 px wide, with the nav sidebar
    cell = (
        page.locator("#result_list tbody tr")
        .filter(has_text=f"#{job.pk} ")
        .locator("td.field-state")
    )
    progress = cell.locator(".jobs-progress")
    assert progress.inner_text().strip() == "61%"
    assert progress.locator("progress").get_attribute("value") == "61"
    # Whole: neither the cell nor the list is cut or scrolled.
    assert cell.evaluate("el => el.scrollWidth <= el.clientWidth")
    shown = progress.evaluate(
        "el => { const r = el.getBoundingClientRect(), c = el.closest('td')"
        ".getBoundingClientRect(); return r.right <= c.right + 0.5 && r.width > 0; }"
    )
    assert shown
    results = page.locator("#changelist .results")
    widths = results.evaluate("el => [el.scrollWidth, el.clientWidth]")
    assert widths[0] <= widths[1]


def test_a_worker_whose_event_loop_was_blocked_is_flagged_and_the_dashboard_still_fits(page):
    # Names as run_jobs makes them in a Kubernetes pod: the widest a row gets.
    stalled = ProcessFactory(
        name="worker-app-7f9c6d5b8-x2kqp-48213-k3j9sd",
        hostname="app-7f9c6d5b8-x2kqp",
        metadata={
            "queues": ["emails", "reports*"],
            "threads": 3,
            "async_jobs": 200,
            "loop_stalls": 12,
            "loop_stalled_seconds": 63.25,
        },
    )
    calm = ProcessFactory(metadata={"queues": ["default"], "threads": 2, "async_jobs": 0})
    log_in(page, "ops", path="/admin/django_jobs/dashboard/")  # 1280 px, with the nav sidebar
    queues = page.locator(f"#process-{stalled.pk} .jobs-queues")
    flag = queues.locator(".jobs-stalled")
    assert flag.inner_text() == "event loop: 12 stalls, 63.2 s blocked"
    assert "200 async" in queues.inner_text()
    assert "event_loop_block_threshold" in flag.get_attribute("title")
    style = flag.evaluate("el => [getComputedStyle(el).color, getComputedStyle(el).fontWeight]")
    assert style == ["rgb(186, 33, 33)", "700"]  # the red and the weight of "dead"
    assert page.locator(f"#process-{calm.pk} .jobs-queues").inner_text() == "default · 2 threads"
    widths = page.locator("#processes").evaluate("el => [el.scrollWidth, el.clientWidth]")
    assert widths[0] <= widths[1], f"the processes are {widths[0]} px wide in {widths[1]} px"

    page.goto(page.base_url + "/admin/django_jobs/process/")
    row = page.locator("#result_list tbody tr").filter(has_text=stalled.name)
    flag = row.locator(".field-queues .jobs-stalled")
    assert flag.inner_text() == "event loop: 12 stalls, 63.2 s blocked"
    assert flag.evaluate("el => getComputedStyle(el).color") == "rgb(186, 33, 33)"
