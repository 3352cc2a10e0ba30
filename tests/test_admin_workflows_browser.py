"""The admin's workflows in a real browser (Debian's Chromium, headless, driven by
Playwright, as tests/test_admin_browser.py drives it, with its fixtures): open the list and a
workflow's page, follow its graph's links, cancel it, retry its failed jobs; the database is
then checked, not only the page."""

from __future__ import annotations

import re

import pytest

from django_jobs import workflow
from django_jobs.core.processes import register_process
from django_jobs.models import Job, JobStatus, Workflow
from tests import test_admin_browser as browser_tests
from tests import workflow_tasks as wt
from tests.harness import error_paths, job_row
from tests.test_workflows import run

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

DB = "default"
# The browser tests' own fixtures and helpers: one Chromium for this module, a fresh page
# (its screenshot saved) per test, the login form.
browser, page = browser_tests.browser, browser_tests.page
log_in, message = browser_tests.log_in, browser_tests.message


@pytest.fixture
def worker():
    return register_process(DB, "worker")


def pk(result) -> int:
    return int(result.id)


def chain_of_three(name: str):
    with workflow(name) as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.step, "c", after=[b])
    return wf.result, a.result, b.result, c.result


def graph_nodes(page) -> dict[int, dict[str, str]]:
    """Each node the page's SVG draws: its job id, the link it is, its status."""
    nodes = page.locator("#workflow-graph a.jobs-graph-node")
    return {
        int(node.get_attribute("data-job")): {
            "href": node.get_attribute("href"),
            "status": node.get_attribute("data-status"),
        }
        for node in nodes.all()
    }


def job_href(job_id: int) -> str:
    return f"/admin/django_jobs/job/{job_id}/change/"


def test_open_the_list_then_a_workflows_graph_and_follow_a_node_to_its_job(page, worker):
    with workflow("diamond") as wf:
        top = wf.add(wt.step, "top")
        left = wf.add(wt.step, "left", after=[top])
        right = wf.add(wt.step, "right", after=[top])
        bottom = wf.add(wt.merge, after=[left, right])
    chain_of_three("other")
    run(worker, top.result)
    ids = [pk(n.result) for n in (top, left, right, bottom)]

    log_in(page, "ops", path="/admin/django_jobs/workflow/")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 2
    diamond_row = rows.filter(has_text="diamond")
    assert diamond_row.locator(".field-status").inner_text() == "running"
    assert diamond_row.locator(".field-done").inner_text() == "1/4"
    assert rows.filter(has_text="other").locator(".field-done").inner_text() == "0/3"

    page.locator("#result_list").get_by_role("link", name="diamond").click()
    page.wait_for_url(f"**/admin/django_jobs/workflow/{wf.result.id}/change/")
    nodes = graph_nodes(page)
    assert sorted(nodes) == sorted(ids)  # one node per job, each a link to its job
    assert all(node["href"] == job_href(job_id) for job_id, node in nodes.items())
    assert [nodes[i]["status"] for i in ids] == ["succeeded", "ready", "ready", "awaiting"]
    assert page.locator("#workflow-graph path.jobs-graph-edge").count() == 4
    # A node reads as a box, not as underlined text (the admin underlines links).
    underline = page.locator(f"#workflow-graph a[data-job='{ids[0]}']").evaluate(
        "a => getComputedStyle(a).textDecorationLine"
    )
    assert underline == "none"
    # Drawn left to right: the bottom job right of the two it waits for.
    box = {i: page.locator(f"#workflow-graph a[data-job='{i}'] rect").bounding_box() for i in ids}
    assert box[ids[0]]["x"] < box[ids[1]]["x"] == box[ids[2]]["x"] < box[ids[3]]["x"]
    waits = page.locator(f"#workflow-job-{ids[3]} .jobs-waits-for").inner_text()
    assert waits == f"#{ids[1]} (ready), #{ids[2]} (ready)"

    page.locator(f"#workflow-graph a[data-job='{ids[3]}']").click()
    page.wait_for_url(f"**{job_href(ids[3])}")
    assert page.locator("#job-state").inner_text() == "awaiting"
    assert page.locator("#job-remaining").inner_text() == "2"
    waits_for = page.locator("#job-waits-for")
    assert waits_for.get_by_role("link", name=f"#{ids[1]}").count() == 1
    page.locator("#job-workflow").get_by_role("link").click()
    page.wait_for_url(f"**/admin/django_jobs/workflow/{wf.result.id}/change/")


def test_cancel_a_workflow_from_its_page(page, worker):
    wf, a, b, c = chain_of_three("nightly")
    run(worker, a)
    log_in(page, "ops", path=f"/admin/django_jobs/workflow/{wf.id}/change/")
    assert page.locator("#workflow-state").inner_text() == "running"
    page.get_by_role("button", name="Cancel workflow").click()
    assert f"Workflow #{wf.id} cancelled: 2 jobs not yet ended were cancelled" in message(page)
    assert page.locator("#workflow-state").inner_text() == "cancelled"
    assert page.get_by_role("button", name="Cancel workflow").count() == 0
    assert Workflow.objects.get(pk=wf.id).ended_as == "cancelled"
    assert [job_row(r).status for r in (a, b, c)] == ["succeeded", "failed", "failed"]
    assert error_paths(b) == ["django_jobs.exceptions.JobCancelled"]
    nodes = graph_nodes(page)
    assert [nodes[pk(r)]["status"] for r in (a, b, c)] == ["succeeded", "failed", "failed"]


def test_retry_failed_jobs_from_the_workflow_page(page, worker):
    wf, a, b, c = chain_of_three("import")
    run(worker, a, fail=True)  # committed: what waits for it ends, level by level
    assert [job_row(r).status for r in (a, b, c)] == [JobStatus.FAILED] * 3
    log_in(page, "ops", path=f"/admin/django_jobs/workflow/{wf.id}/change/")
    assert page.locator("#workflow-state").inner_text() == "failed"

    page.locator(f"#workflow-job-{pk(b)}").get_by_role("button", name="Retry").click()
    assert re.search(
        rf"Job #{pk(b)} was not retried: it waits for #{pk(a)}, which failed", message(page)
    )
    assert job_row(b).status == JobStatus.FAILED

    page.locator(f"#workflow-job-{pk(a)}").get_by_role("button", name="Retry").click()
    assert f"Job #{pk(a)} will be retried" in message(page)
    assert [job_row(r).status for r in (a, b, c)] == ["ready", "awaiting", "awaiting"]
    assert page.locator("#workflow-state").inner_text() == "running"
    nodes = graph_nodes(page)
    assert [nodes[pk(r)]["status"] for r in (a, b, c)] == ["ready", "awaiting", "awaiting"]
    assert page.get_by_role("button", name="Retry").count() == 0

    run(worker, a)
    run(worker, b)
    run(worker, c)
    page.reload()
    assert page.locator("#workflow-state").inner_text() == "succeeded"
    assert Job.objects.filter(workflow_id=wf.id, status=JobStatus.SUCCEEDED).count() == 3


def test_a_view_only_user_sees_the_graph_and_cannot_act(page, worker):
    wf, a, _, _ = chain_of_three("viewed")
    run(worker, a, fail=True)
    log_in(page, "viewer", view_only=True, path=f"/admin/django_jobs/workflow/{wf.id}/change/")
    assert len(graph_nodes(page)) == 3
    assert page.get_by_role("button", name="Retry").count() == 0
    assert page.get_by_role("button", name="Cancel workflow").count() == 0
    # Forge the POSTs the buttons would send, with a valid CSRF token.
    statuses = page.evaluate(
        """async (urls) => {
            const token = document.cookie.match(/csrftoken=([^;]+)/)[1];
            const answers = [];
            for (const url of urls) {
                const headers = {"X-CSRFToken": token};
                answers.push((await fetch(url, {method: "POST", headers})).status);
            }
            return answers;
        }""",
        [
            f"/admin/django_jobs/workflow/{wf.id}/cancel/",
            f"/admin/django_jobs/workflow/{wf.id}/retry/{pk(a)}/",
        ],
    )
    assert statuses == [403, 403]
    assert Workflow.objects.get(pk=wf.id).ended_as is None
    assert job_row(a).status == JobStatus.FAILED
