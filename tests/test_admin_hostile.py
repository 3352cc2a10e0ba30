"""Hostile requests against every jobs admin page, on the database under test.

Whatever a URL or a form brings (any Unicode text, NUL and control characters,
superscript digits, numbers past the bigint range, negative numbers, bytes that
are not UTF-8, long values, parameters no page knows), a page answers 200, 302,
400 or 404: never 500. Hypothesis generates the requests; each one runs in a
savepoint, so that a database error surfaces as itself and not as the aborted
transaction of the next example.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import quote, quote_from_bytes

import pytest
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from django_jobs.models import Batch, JobDependency, JobStatus, RateLimit, Workflow
from tests.factories import (
    BlockedExecutionFactory,
    FailedExecutionFactory,
    ProcessFactory,
    ReadyExecutionFactory,
    SemaphoreFactory,
)

pytestmark = pytest.mark.django_db

# The rows are planted once per test, and GET requests leave them as is (the suite's
# Hypothesis profile, tests/conftest.py, sets the rest).
PROPERTY = settings(max_examples=60)
ANSWERS = {200, 302, 400, 404}
MAX_ID = 2**63 - 1

# The values that broke a page once, or would: digits that are not ASCII, NUL, the edges of
# the bigint range, numbers Python refuses to read (over 4,300 digits) or reads as infinity.
KNOWN = [
    "²",
    "١٢",
    "\x00",
    "1\x002",
    "%00",
    "\x1b[31m",
    "\u2028",
    "-1",
    "0",
    str(MAX_ID),
    str(MAX_ID + 1),
    str(10**30),
    "9" * 5000,
    "1e400",
    "nan",
    " 12 ",
    "#12",
    "[",
    "(",
    "*",
    "%",
    "\\",
    "'",
]
# The few of them every parameter of every page is tried with.
SWEEP = ["²", "١٢", "\x00", "-1", str(MAX_ID + 1), "9" * 5000, "1e400", "["]
texts = st.text(st.characters(codec="utf-8"), max_size=40)
hostile_text = st.one_of(
    st.sampled_from(KNOWN),
    texts,
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=3).map(lambda s: s * 4000),
)
# A value as sent: UTF-8 of some text, or bytes that decode to nothing.
hostile_bytes = st.one_of(hostile_text.map(str.encode), st.binary(max_size=20))


def query(names: tuple[str, ...]) -> st.SearchStrategy[str]:
    """A query string: some of the page's own parameters and any others, each value
    hostile, a name possibly repeated."""
    name = st.one_of(st.sampled_from(names), hostile_text) if names else hostile_text
    pairs = st.lists(st.tuples(name, hostile_bytes), max_size=4)
    return pairs.map(
        lambda items: "&".join(
            f"{quote(key, safe='')}={quote_from_bytes(value, safe='')}" for key, value in items
        )
    )


LIST_FILTERS = ("p", "o", "q", "all", "e", "_facets", "_popup", "_to_field")
PAGES: dict[str, tuple[str, ...]] = {
    "job": (
        *LIST_FILTERS,
        "status",
        "status__exact",
        "status__isnull",
        "queue_name",
        "task_path",
        "concurrency_key",
        "finished_since",
        "batch",
        "workflow",
    ),
    "batch": (*LIST_FILTERS, "finished"),
    "workflow": (*LIST_FILTERS, "status"),
    "process": (
        *LIST_FILTERS,
        "kind",
        "kind__exact",
        "kind__isnull",
        "hostname",
        "hostname__exact",
        "hostname__isnull",
    ),
    "dashboard": ("p", "q"),
    "stuckjob": ("p", "q"),
    "blockedkey": ("p", "q"),
    "ratelimitedkey": ("p", "q"),
    "recurringtask": ("p", "q"),
}


@pytest.fixture
def planted(db) -> dict[str, int]:
    """A row of each kind the pages show, so that they have something to render."""
    now = timezone.now()
    batch = Batch.objects.create(description="import", total=2, pending=1)
    workflow = Workflow.objects.create(name="etl\n\x1b[31m")
    failed = FailedExecutionFactory(
        job__batch=batch, job__workflow=workflow, job__finished_at=now, message="boom\n\x1b[31m"
    ).job
    ReadyExecutionFactory(job__queue_name="emails")
    blocked = BlockedExecutionFactory(job__workflow=workflow).job
    JobDependency.objects.create(job=blocked, depends_on=failed)
    SemaphoreFactory(key="key", limit=1, value=0)
    process = ProcessFactory(last_heartbeat_at=now - timedelta(hours=1))
    RateLimit.objects.create(key="partner-api", limit=2, period=1.0, starts=[now.timestamp()])
    return {
        "job": failed.pk,
        "blocked": blocked.pk,
        "batch": batch.pk,
        "process": process.pk,
        "workflow": workflow.pk,
    }


def answer(client: Client, method: str, url: str, data: dict | None = None) -> int:
    """The status of one request, in a savepoint of its own."""
    with transaction.atomic():
        response = getattr(client, method)(url, data)
    return response.status_code


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_parameter_of_each_page_takes_the_values_that_broke_one(admin_client, planted, page):
    """Every parameter with each of ``SWEEP``: what a random search may take long to meet."""
    url = reverse(f"admin:django_jobs_{page}_changelist")
    answers = {
        (name, value[:20]): answer(admin_client, "get", url, {name: value})
        for name in PAGES[page]
        for value in SWEEP
    }
    assert {key: status for key, status in answers.items() if status not in ANSWERS} == {}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_no_query_string_makes_a_page_answer_500(admin_client, planted, page):
    url = reverse(f"admin:django_jobs_{page}_changelist")

    @PROPERTY
    @given(query(PAGES[page]))
    def check(query_string: str) -> None:
        assert answer(admin_client, "get", f"{url}?{query_string}") in ANSWERS, query_string

    check()


@pytest.mark.parametrize("model", ["job", "batch", "process", "workflow"])
def test_no_object_id_makes_a_detail_page_answer_500(admin_client, planted, model):
    """The detail pages by id, with hostile ids (and query strings): 404 for an id no row
    has, the page for a row's own."""
    page = reverse(f"admin:django_jobs_{model}_change", args=["__id__"])
    ids = st.one_of(
        st.just(str(planted[model])),
        hostile_text.filter(bool).map(lambda text: quote(text, safe="")),
        st.integers(min_value=-(10**30), max_value=10**30).map(str),
    )

    @PROPERTY
    @given(ids, query(("_changelist_filters", "_to_field", "_popup")))
    def check(object_id: str, query_string: str) -> None:
        url = page.replace("__id__", object_id) + "?" + query_string
        assert answer(admin_client, "get", url) in ANSWERS, url

    check()


def test_no_job_id_in_an_action_path_answers_500(admin_client, planted):
    """``<id>/run-now/`` and the POST actions (405 to a GET): an id past the bigint range
    is no URL (404); it once reached SQLite, which raised OverflowError."""
    ids = st.one_of(
        st.sampled_from([planted["blocked"], MAX_ID, MAX_ID + 1, 10**19, 10**30]),
        st.integers(min_value=0, max_value=10**40),
    )
    actions = st.sampled_from(["retry", "discard", "cancel", "run-now"])
    run_now = reverse("admin:django_jobs_job_run_now", args=[1])

    @PROPERTY
    @given(ids, actions, st.sampled_from(["get", "post"]))
    def check(job_id: int, action: str, method: str) -> None:
        url = run_now.replace("/1/run-now/", f"/{job_id}/{action}/")
        assert answer(admin_client, method, url) in {*ANSWERS, 405}, (method, url)

    check()


def test_no_id_in_a_workflow_action_path_answers_500(admin_client, planted):
    """``<workflow>/cancel/`` and ``<workflow>/retry/<job>/``, with ids of rows, of no
    row, and past the bigint range (404: no URL)."""
    ids = st.one_of(
        st.sampled_from([planted["workflow"], planted["job"], MAX_ID, MAX_ID + 1, 10**30]),
        st.integers(min_value=0, max_value=10**40),
    )
    cancel = reverse("admin:django_jobs_workflow_cancel", args=[1])

    @PROPERTY
    @given(ids, ids, st.sampled_from(["get", "post"]))
    def check(workflow_id: int, job_id: int, method: str) -> None:
        base = cancel.replace("/1/cancel/", f"/{workflow_id}/")
        for url in (f"{base}cancel/", f"{base}retry/{job_id}/"):
            assert answer(admin_client, method, url) in {*ANSWERS, 403}, (method, url)

    check()


def test_no_form_value_makes_an_action_answer_500(admin_client, planted):
    """The forms' own fields (a queue to pause or resume, a key to reconcile, a recurring
    task's key) and the job list's bulk actions with hostile ticked ids."""
    forms = [
        ("admin:django_jobs_dashboard_pause", "queue"),
        ("admin:django_jobs_dashboard_resume", "queue"),
        ("admin:django_jobs_blockedkey_reconcile", "key"),
        ("admin:django_jobs_recurringtask_run_now", "key"),
        ("admin:django_jobs_recurringtask_enable", "key"),
        ("admin:django_jobs_recurringtask_disable", "key"),
    ]
    bulk = ["retry_selected", "discard_selected", "cancel_selected", "run_selected_now", "x"]

    @PROPERTY
    @given(st.sampled_from(forms), hostile_text)
    def check_form(form: tuple[str, str], value: str) -> None:
        name, field = form
        assert answer(admin_client, "post", reverse(name), {field: value}) in ANSWERS, value

    @PROPERTY
    @given(st.sampled_from(bulk), st.lists(hostile_text, min_size=1, max_size=3), hostile_text)
    def check_bulk(action: str, ticked: list[str], index: str) -> None:
        data = {"action": action, "_selected_action": ticked, "index": index, "confirmed": "yes"}
        url = reverse("admin:django_jobs_job_changelist")
        assert answer(admin_client, "post", url, data) in ANSWERS, data

    check_form()
    check_bulk()


@pytest.mark.parametrize("value", ["²", "١٢"])
def test_a_search_for_digits_that_are_not_ascii_is_a_text_search(admin_client, planted, value):
    """``str.isdigit`` is True for "²" (``int`` refuses it: 500) and for "١٢" (``int``
    reads 12): both are text, looked for in the arguments."""
    response = admin_client.get(reverse("admin:django_jobs_job_changelist"), {"q": value})
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == []


def test_a_batch_filter_of_digits_that_are_not_ascii_finds_nothing(admin_client, planted):
    response = admin_client.get(reverse("admin:django_jobs_job_changelist"), {"batch": "²"})
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == []


@pytest.mark.parametrize("number", [str(MAX_ID + 1), str(10**30), "9" * 5000])
def test_an_id_no_job_can_have_finds_nothing(admin_client, planted, number):
    for param in ("q", "batch"):
        response = admin_client.get(reverse("admin:django_jobs_job_changelist"), {param: number})
        assert response.status_code == 200, param
        assert list(response.context["cl"].result_list) == [], param


def test_a_job_id_is_still_found_by_search_and_a_batch_by_its_filter(admin_client, planted):
    listing = reverse("admin:django_jobs_job_changelist")
    found = admin_client.get(listing, {"q": f"#{planted['job']}"}).context["cl"].result_list
    assert [job.pk for job in found] == [planted["job"]]
    items = admin_client.get(listing, {"batch": str(planted["batch"])}).context["cl"].result_list
    assert [job.pk for job in items] == [planted["job"]]


def test_a_nul_in_a_filter_answers_400(admin_client, planted):
    """PostgreSQL refuses a NUL in a query's text parameter: the list answered 500."""
    listing = reverse("admin:django_jobs_job_changelist")
    for param in ("queue_name", "status", "concurrency_key", "q"):
        assert admin_client.get(listing, {param: "a\x00b"}).status_code == 400, param
    pause = reverse("admin:django_jobs_dashboard_pause")
    assert admin_client.post(pause, {"queue": "a\x00b"}).status_code == 400


def test_a_lookup_no_filter_offers_answers_400(admin_client, planted):
    """Django's admin takes any lookup on a model's field from the URL; a regular
    expression the database refuses, or a lookup SQLite lacks, answered 500."""
    listing = reverse("admin:django_jobs_job_changelist")
    for lookup, value in [("attempts__regex", "["), ("args__contains", "x"), ("id__gt", "1")]:
        assert admin_client.get(listing, {lookup: value}).status_code == 400, lookup
    # The filters' own parameters, and ``status``, which the blocked page links with.
    for param, value in [("status", JobStatus.FAILED), ("status__exact", JobStatus.FAILED)]:
        response = admin_client.get(listing, {param: value})
        assert [job.pk for job in response.context["cl"].result_list] == [planted["job"]]


def test_a_ticked_id_that_is_no_id_answers_400(admin_client, planted):
    listing = reverse("admin:django_jobs_job_changelist")
    for ticked in ["²", str(MAX_ID + 1), "x"]:
        data = {"action": "retry_selected", "_selected_action": [ticked], "index": "0"}
        assert admin_client.post(listing, data).status_code == 400, ticked
