"""The admin's workflows through Django's test client: the list and its states (read from
``workflow_states``), a workflow's page (its graph drawn on the server, its table of jobs),
what a job's page says of what it waits for, the cancel and retry actions and who may use
them, and that hostile names and task paths reach every page escaped."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import django_jobs
from django_jobs import workflow
from django_jobs.admin import dependencies as dependencies_admin
from django_jobs.admin import graph
from django_jobs.admin import workflows as workflows_admin
from django_jobs.core.dependencies import DEPENDENCY_FAILED_ERROR
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.workflows import workflow_states
from django_jobs.models import Job, JobDependency, JobStatus, ReadyExecution, Workflow
from tests import workflow_tasks as wt
from tests.factories import FinishedJobFactory, JobFactory
from tests.harness import error_paths, job_row
from tests.test_admin import messages_of, text
from tests.test_workflows import run

pytestmark = pytest.mark.django_db

DB = "default"
HOSTILE = '<script>alert("x")</script>&amp;'


@pytest.fixture
def worker():
    return register_process(DB, "worker")


@pytest.fixture
def commits(django_capture_on_commit_callbacks):
    """Run what a transaction leaves for after its commit, as a real commit would."""

    def capture():
        return django_capture_on_commit_callbacks(execute=True)

    return capture


def url(name: str, *args) -> str:
    return reverse(f"admin:django_jobs_{name}", args=args)


def listing(client: Client, query: str = ""):
    return client.get(url("workflow_changelist") + query)


def listed(response) -> list[int]:
    return [row.pk for row in response.context["cl"].result_list]


def pk(result) -> int:
    return int(result.id)


def chain_of_three(name: str = "three"):
    with workflow(name) as wf:
        a = wf.add(wt.step, "a")
        b = wf.add(wt.step, "b", after=[a])
        c = wf.add(wt.step, "c", after=[b])
    return wf.result, a.result, b.result, c.result


def diamond(name: str = "diamond"):
    """``top`` first, ``left`` and ``right`` after it, ``bottom`` after both."""
    with workflow(name) as wf:
        top = wf.add(wt.step, "top")
        left = wf.add(wt.step, "left", after=[top])
        right = wf.add(wt.step, "right", after=[top])
        bottom = wf.add(wt.merge, after=[left, right])
    return wf.result, [n.result for n in (top, left, right, bottom)]


@pytest.fixture
def four_states(worker, commits):
    """One workflow in each state: running, succeeded, failed, cancelled."""
    running = chain_of_three("running")[0]
    with workflow("succeeded") as done:
        only = done.add(wt.step, "x")
    run(worker, only.result)
    failed, a, _, _ = chain_of_three("failed")
    run(worker, a, fail=True, commits=commits)
    cancelled = chain_of_three("cancelled")[0]
    django_jobs.cancel_workflow(cancelled)
    return {
        "running": running.id,
        "succeeded": done.result.id,
        "failed": failed.id,
        "cancelled": cancelled.id,
    }


# --- the list -------------------------------------------------------------------------------


def test_the_list_shows_each_workflows_state_counts_and_dates(admin_client, four_states):
    response = listing(admin_client)
    assert response.status_code == 200
    assert listed(response) == sorted(four_states.values(), reverse=True)
    html = response.content.decode()
    rows = {
        int(m.group(1)): m.group(0)
        for m in re.finditer(
            r'<tr><th class="field-label"><a href="[^"]*/workflow/(\d+)/change/.*?</tr>', html
        )
    }
    for status, workflow_id in four_states.items():
        assert f'<span class="jobs-state jobs-{status}">{status}</span>' in rows[workflow_id]
    running = rows[four_states["running"]]
    assert "0/3" in running and "1 ready" in running and "2 awaiting" in running
    assert "3/3" in rows[four_states["failed"]] and "3 failed" in rows[four_states["failed"]]
    assert "1/1" in rows[four_states["succeeded"]]
    # A running workflow has not finished; an ended one shows when.
    assert 'class="field-finished">\u2013<' in running
    assert "<time" in rows[four_states["succeeded"]].split('field-finished">')[1]
    assert 'id="jobs-refresh"' in html


def test_the_status_filter_agrees_with_workflow_states(admin_client, four_states):
    states = workflow_states(DB, Workflow.objects.all())
    for status in ("running", "succeeded", "failed", "cancelled"):
        response = listing(admin_client, f"?status={status}")
        expected = sorted((pk for pk, s in states.items() if s.status == status), reverse=True)
        assert listed(response) == expected == [four_states[status]], status
    assert len(listed(listing(admin_client))) == 4


def test_a_workflow_ended_as_failed_while_its_jobs_run_is_failed_in_the_filter_too(admin_client):
    """The ending written on the row wins over the jobs still running, as in
    ``workflow_states``."""
    wf = chain_of_three()[0]
    Workflow.objects.filter(pk=wf.id).update(ended_as="failed")
    assert workflow_states(DB, [Workflow.objects.get(pk=wf.id)])[wf.id].status == "failed"
    assert listed(listing(admin_client, "?status=failed")) == [wf.id]
    assert listed(listing(admin_client, "?status=running")) == []


def test_the_list_reads_the_states_of_a_page_in_one_query(admin_client):
    def queries_for_the_list() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert listing(admin_client).status_code == 200
        return len(queries)

    chain_of_three()
    few = queries_for_the_list()
    for n in range(6):
        chain_of_three(f"more {n}")
    assert queries_for_the_list() == few


# --- a workflow's page ----------------------------------------------------------------------


def test_the_page_draws_one_node_per_job_each_a_link_in_columns_by_rank(admin_client):
    wf, (top, left, right, bottom) = diamond()
    response = admin_client.get(url("workflow_change", wf.id))
    assert response.status_code == 200
    drawing = response.context["drawing"]
    nodes = {node.id: node for node in drawing.nodes}
    assert set(nodes) == {pk(r) for r in (top, left, right, bottom)}
    column = {job: node.x for job, node in nodes.items()}
    assert column[pk(top)] < column[pk(left)] == column[pk(right)] < column[pk(bottom)]
    assert {(e.parent, e.child) for e in drawing.edges} == {
        (pk(top), pk(left)),
        (pk(top), pk(right)),
        (pk(left), pk(bottom)),
        (pk(right), pk(bottom)),
    }
    svg = response.content.decode().split('<svg class="jobs-graph"', 1)[1].split("</svg>", 1)[0]
    links = re.findall(r'<a class="jobs-graph-node jobs-node-(\w+)" href="([^"]+)"', svg)
    assert sorted(href for _, href in links) == sorted(
        url("job_change", pk(r)) for r in (top, left, right, bottom)
    )
    assert sorted(tone for tone, _ in links) == ["awaiting", "awaiting", "awaiting", "ready"]
    assert svg.count('class="jobs-graph-edge"') == 4
    assert ">merge<" in svg and f"#{pk(bottom)} · awaiting" in svg


def test_the_graph_and_table_print_numbers_unlocalized_with_thousand_separators_on(
    admin_client, settings
):
    """Coordinates past 999 (a chain's sixth column) and ids stay plain numbers: "1,088"
    is no SVG coordinate."""
    settings.USE_THOUSAND_SEPARATOR = True
    with workflow("long chain") as wf:
        previous = wf.add(wt.step, "0")
        for n in range(1, 6):
            previous = wf.add(wt.step, str(n), after=[previous])
    response = admin_client.get(url("workflow_change", wf.result.id))
    last = max(response.context["drawing"].nodes, key=lambda node: node.x)
    assert last.x >= 1000
    html = response.content.decode()
    assert f'<rect x="{last.x}"' in html and f'data-job="{last.id}"' in html
    assert f'href="{url("job_change", last.id)}">#{last.id}</a>' in html


def test_the_table_says_what_each_job_waits_for_and_how_many_remain(admin_client, worker):
    wf, (top, left, right, bottom) = diamond()
    run(worker, top)
    run(worker, left)
    response = admin_client.get(url("workflow_change", wf.id))
    rows = {row.job.pk: row for row in response.context["rows"]}
    assert [(link.id, link.status) for link in rows[pk(bottom)].waits_for] == [
        (pk(left), JobStatus.SUCCEEDED),
        (pk(right), JobStatus.READY),
    ]
    assert [link.url for link in rows[pk(bottom)].waits_for] == [
        url("job_change", pk(left)),
        url("job_change", pk(right)),
    ]
    assert rows[pk(bottom)].remaining == 1
    assert rows[pk(top)].waits_for == [] and rows[pk(top)].remaining is None
    body = text(response)
    assert f"#{pk(left)} , #{pk(right)} (ready)" in body
    assert "2/4 jobs ended" in body
    html = response.content.decode()
    assert url("job_changelist") + f"?workflow={wf.id}" in html
    # Nothing failed: no retry button; jobs still to end: a cancel button.
    assert ">Retry</button>" not in html and ">Cancel workflow</button>" in html


def test_a_page_costs_the_same_queries_whatever_the_workflows_size(admin_client):
    small = diamond()[0]
    with workflow("wide") as wf:
        first = wf.add(wt.step, "first")
        for n in range(40):
            wf.add(wt.step, f"n{n}", after=[first])
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(url("workflow_change", small.id)).status_code == 200
    with CaptureQueriesContext(connection) as wide:
        response = admin_client.get(url("workflow_change", wf.result.id))
    assert len(wide) == len(queries)
    assert len(response.context["drawing"].nodes) == 41


def test_a_workflow_past_the_cap_is_not_drawn_and_its_table_is_cut(admin_client, monkeypatch):
    monkeypatch.setattr(graph, "MAX_DRAWN", 3)
    monkeypatch.setattr(workflows_admin, "NODES_SHOWN", 3)
    with workflow("big") as wf:
        for n in range(5):
            wf.add(wt.step, f"n{n}")
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(url("workflow_change", wf.result.id))
    assert response.context["drawing"] is None
    assert "Graph too large: 5 nodes" in text(response)
    assert 'class="jobs-graph"' not in response.content.decode()
    assert len(response.context["rows"]) == 3 and response.context["more_jobs"]
    assert "The first 3 of 5" in text(response)
    table = connection.ops.quote_name(Job._meta.db_table)
    reads = [q["sql"] for q in queries if f"FROM {table}" in q["sql"] and "workflow_id" in q["sql"]]
    assert any("LIMIT 4" in sql for sql in reads), reads


def test_edges_past_the_cap_leave_the_graph_undrawn_and_say_so(admin_client, monkeypatch):
    monkeypatch.setattr(workflows_admin, "EDGES_READ", 2)
    wf, (_, left, right, bottom) = diamond()
    response = admin_client.get(url("workflow_change", wf.id))
    assert response.context["drawing"] is None and response.context["edges_cut"]
    assert "more than 2 dependencies" in text(response)
    rows = {row.job.pk: row for row in response.context["rows"]}
    assert rows[pk(left)].more == 0
    assert rows[pk(right)].more is None and rows[pk(bottom)].more is None


def test_hostile_names_and_task_paths_are_escaped_everywhere(admin_client):
    hostile = Workflow.objects.create(name=HOSTILE)
    parent = JobFactory(task_path=f"app.{HOSTILE}", workflow=hostile, args=[HOSTILE])
    child = JobFactory(
        task_path=f"app.tasks.{HOSTILE}", workflow=hostile, status=JobStatus.AWAITING
    )
    JobDependency.objects.create(job=child, depends_on=parent)
    pages = [
        listing(admin_client),
        admin_client.get(url("workflow_change", hostile.pk)),
        admin_client.get(url("job_change", child.pk)),
        admin_client.get(url("job_changelist") + f"?workflow={hostile.pk}"),
    ]
    for response in pages:
        assert response.status_code == 200
        html = response.content.decode()
        assert "<script>alert" not in html, response.request["PATH_INFO"]
        assert "&lt;script&gt;alert" in html, response.request["PATH_INFO"]
    svg = pages[1].content.decode().split('<svg class="jobs-graph"', 1)[1].split("</svg>")[0]
    assert "<script" not in svg and "&lt;script&gt;" in svg
    # A name is cut on a node, whole in its title.
    assert f"#{child.pk} app.tasks.&lt;script&gt;" in svg


def test_an_unknown_status_in_a_row_draws_an_unknown_node(admin_client):
    hostile = Workflow.objects.create(name="edited")
    job = JobFactory(workflow=hostile, status='x"><b>z')  # the column holds 16 characters
    response = admin_client.get(url("workflow_change", hostile.pk))
    assert response.status_code == 200
    (node,) = response.context["drawing"].nodes
    assert node.id == job.pk and node.tone == "unknown"
    html = response.content.decode()
    assert "<b>z" not in html and 'data-status="x&quot;&gt;&lt;b&gt;z"' in html


# --- the layout -------------------------------------------------------------------------


def test_a_rank_is_the_longest_path_from_a_job_that_waits_for_nothing():
    edges = [(1, 2), (2, 3), (1, 3), (3, 4), (5, 4)]
    assert graph.ranks([1, 2, 3, 4, 5], edges) == {1: 0, 2: 1, 3: 2, 4: 3, 5: 0}


def test_a_cycle_from_an_edited_row_gets_a_column_of_its_own():
    ranked = graph.ranks([1, 2, 3, 4, 5], [(1, 2), (2, 3), (3, 2), (3, 4), (1, 5), (5, 6)])
    assert ranked == {1: 0, 5: 1, 2: 2, 3: 2, 4: 2}


def test_a_node_sits_level_with_the_jobs_it_waits_for():
    jobs = [graph.GraphJob(n, "app.tasks.step", "ready") for n in (1, 2, 3, 4)]
    # 4 waits for 2, the second of the first column: it is drawn on the second row.
    drawing = graph.layout(jobs, [(2, 4), (1, 3)])
    y = {node.id: node.y for node in drawing.nodes}
    assert y[3] == y[1] and y[4] == y[2] and y[1] < y[2]
    assert graph.short_name("app.tasks." + "x" * 40) == "x" * 19 + "\u2026"


# --- a job's page -----------------------------------------------------------------------------


def test_a_jobs_page_shows_its_workflow_what_it_waits_for_and_what_waits_for_it(
    admin_client, worker
):
    wf, (top, left, right, bottom) = diamond("shapes")
    run(worker, top)
    run(worker, left)
    response = admin_client.get(url("job_change", pk(bottom)))
    edges = response.context["edges"]
    assert [(j.id, j.status) for j in edges.waits_for.jobs] == [
        (pk(left), "succeeded"),
        (pk(right), "ready"),
    ]
    assert edges.remaining == 1 and edges.waited_by.jobs == []
    html = response.content.decode()
    assert f'href="{url("workflow_change", wf.id)}">#{wf.id} shapes</a>' in html
    assert url("job_change", pk(right)) in html
    assert response.context["execution"]["table"] == "awaiting"
    # Awaiting is waiting: it can be cancelled or discarded like a blocked job.
    assert response.context["can_cancel"] and response.context["can_discard"]

    top_page = admin_client.get(url("job_change", pk(top)))
    assert [j.id for j in top_page.context["edges"].waited_by.jobs] == [pk(left), pk(right)]
    assert "nothing" in top_page.content.decode().split('id="job-waits-for">')[1][:20]


def test_a_job_with_many_dependencies_lists_the_first_and_counts_the_rest(
    admin_client, monkeypatch
):
    monkeypatch.setattr(dependencies_admin, "LINKS_SHOWN", 2)
    parents = [wt.step.enqueue(f"p{n}") for n in range(5)]
    child = wt.merge.using(after=parents).enqueue()
    response = admin_client.get(url("job_change", pk(child)))
    side = response.context["edges"].waits_for
    assert [j.id for j in side.jobs] == [pk(p) for p in parents[:2]] and side.count == 5
    assert "and 3 more" in text(response)
    assert response.context["edges"].remaining == 5


def test_a_job_of_no_workflow_has_no_workflow_section(admin_client):
    job = FinishedJobFactory()
    assert (
        'id="job-dependencies"' not in admin_client.get(url("job_change", job.pk)).content.decode()
    )


def test_the_job_list_filters_by_workflow(admin_client):
    wf, results = diamond()
    FinishedJobFactory()
    response = admin_client.get(url("job_changelist") + f"?workflow={wf.id}")
    assert {job.pk for job in response.context["cl"].result_list} == {pk(r) for r in results}
    assert admin_client.get(url("job_changelist") + "?workflow=²").context["cl"].result_count == 0
    response = admin_client.get(url("job_changelist") + "?status__exact=awaiting")
    assert response.context["cl"].result_count == 3


# --- actions --------------------------------------------------------------------------------


def test_cancel_a_workflow_ends_its_waiting_jobs_and_stops_its_running_one(admin_client, worker):
    wf, a, b, c = chain_of_three()
    ReadyExecution.objects.filter(job_id=pk(a)).update(queue_name="default")
    (claimed,) = claim_jobs(DB, worker.pk, QueueSelector(("default",)), 1, worker_id=worker.name)
    assert claimed.pk == pk(a)
    response = admin_client.post(url("workflow_cancel", wf.id), follow=True)
    assert messages_of(response) == [
        f"Workflow #{wf.id} cancelled: 3 jobs not yet ended were cancelled, or asked to stop "
        "if running; nothing of it starts now."
    ]
    assert Workflow.objects.get(pk=wf.id).ended_as == "cancelled"
    assert job_row(a).cancel_requested_at is not None  # running: its worker stops it
    # b is cancelled; c, waiting for it, ends by its policy in the same transaction.
    assert job_row(b).status == job_row(c).status == JobStatus.FAILED
    assert error_paths(b) == ["django_jobs.exceptions.JobCancelled"]
    assert error_paths(c) == [DEPENDENCY_FAILED_ERROR]
    assert response.context["state"].status == "cancelled"


def test_cancel_is_refused_once_every_job_has_ended(admin_client, worker):
    with workflow("done") as wf:
        only = wf.add(wt.step, "x")
    run(worker, only.result)
    page = admin_client.get(url("workflow_change", wf.result.id))
    assert ">Cancel workflow</button>" not in page.content.decode()
    response = admin_client.post(url("workflow_cancel", wf.result.id), follow=True)
    assert messages_of(response) == [
        f"Workflow #{wf.result.id} was not cancelled: every job of it has ended (succeeded)."
    ]
    assert Workflow.objects.get(pk=wf.result.id).ended_as is None
    assert wf.result.status == "succeeded"


def test_retry_a_failed_job_and_be_told_why_a_dependent_is_refused(admin_client, worker, commits):
    wf, a, b, c = chain_of_three()
    run(worker, a, fail=True, commits=commits)
    page = admin_client.get(url("workflow_change", wf.id)).content.decode()
    assert page.count(">Retry</button>") == 3

    refused = admin_client.post(url("workflow_retry", wf.id, pk(b)), follow=True)
    assert messages_of(refused) == [
        f"Job #{pk(b)} was not retried: it waits for #{pk(a)}, which failed: retry that one first."
    ]
    assert job_row(b).status == JobStatus.FAILED

    retried = admin_client.post(url("workflow_retry", wf.id, pk(a)), follow=True)
    assert messages_of(retried) == [
        f"Job #{pk(a)} will be retried, and the jobs its failure ended wait for it again."
    ]
    assert [job_row(r).status for r in (a, b, c)] == ["ready", "awaiting", "awaiting"]
    assert retried.redirect_chain[-1][0] == url("workflow_change", wf.id)
    assert retried.context["state"].status == "running"


def test_the_jobs_own_page_says_why_a_retry_was_refused(admin_client, worker, commits):
    _, a, b, _ = chain_of_three()
    run(worker, a, fail=True, commits=commits)
    response = admin_client.post(url("job_retry", pk(b)), follow=True)
    assert messages_of(response) == [
        f"Job #{pk(b)} was not retried: it waits for #{pk(a)}, which failed: retry that one first."
    ]


def test_a_job_of_another_workflow_is_not_retried_through_this_one(admin_client, worker):
    wf = chain_of_three("one")[0]
    _, other, _, _ = chain_of_three("other")
    run(worker, other, fail=True)
    response = admin_client.post(url("workflow_retry", wf.id, pk(other)), follow=True)
    assert messages_of(response) == [
        f"Job #{pk(other)} was not retried: it is not a job of workflow #{wf.id}."
    ]
    assert job_row(other).status == JobStatus.FAILED


def test_a_viewer_sees_the_pages_and_can_neither_cancel_nor_retry(viewer, worker):
    wf, a, _, _ = chain_of_three()
    run(worker, a, fail=True)
    assert viewer.get(url("workflow_changelist")).status_code == 200
    page = viewer.get(url("workflow_change", wf.id))
    assert page.status_code == 200 and len(page.context["drawing"].nodes) == 3
    html = page.content.decode()
    assert "<form" not in html.split('id="content"', 1)[1]
    refused = [
        viewer.post(url("workflow_cancel", wf.id)),
        viewer.post(url("workflow_retry", wf.id, pk(a))),
    ]
    assert [r.status_code for r in refused] == [403, 403]
    assert Workflow.objects.get(pk=wf.id).ended_as is None
    assert job_row(a).status == JobStatus.FAILED


def test_actions_are_posts_with_a_csrf_token(admin_user, worker):
    wf, a, _, _ = chain_of_three()
    run(worker, a, fail=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    assert client.post(url("workflow_cancel", wf.id)).status_code == 403
    assert client.post(url("workflow_retry", wf.id, pk(a))).status_code == 403
    assert client.get(url("workflow_cancel", wf.id)).status_code == 403
    assert Workflow.objects.get(pk=wf.id).ended_as is None
    assert job_row(a).status == JobStatus.FAILED


def test_a_missing_workflow_is_404_and_its_cancel_says_so(admin_client):
    assert admin_client.get(url("workflow_change", 987654)).status_code == 404
    response = admin_client.post(url("workflow_cancel", 987654), follow=True)
    assert messages_of(response) == ["Workflow #987654 was not cancelled: there is none."]
