"""The job list's search (django_jobs/admin/search.py) and the statement timeout of every jobs
admin page (admin/base.py, ``bounded_view``), through the real admin on whichever database
``DATABASE_URL`` names: each form finds what it says, the page says what it searched, a scan
reads only the newest jobs, PostgreSQL answers the argument and prefix forms from their
indexes, and no input (10,000 characters, ``%``, ``_``, ``\\``, quotes, NUL, a page past the
end, an ordering that is no column) answers 500."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connections
from django.db.models import Q
from django.db.models.expressions import RawSQL
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from hypothesis import given, settings
from hypothesis import strategies as st

from django_jobs.admin import search
from django_jobs.admin.jobs import JobAdmin
from django_jobs.db import ops
from django_jobs.models import Batch, Job, Workflow
from tests.factories import FinishedJobFactory, JobFactory

pytestmark = pytest.mark.django_db

LIST = "admin:django_jobs_job_changelist"
# Runs for minutes unless interrupted: a page's statement that a timeout must stop.
# (A thousand rows cubed: MariaDB stops a recursive CTE at 1,000 iterations by default.)
SLOW_SQL = (
    "WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < 1000) "
    "SELECT COUNT(*) FROM s a, s b, s c"
)


def listed(client, q: str, **params: str) -> set[int]:
    response = client.get(reverse(LIST), {"q": q, **params})
    assert response.status_code == 200, q
    return {job.pk for job in response.context["cl"].result_list}


@pytest.fixture
def jobs(db):
    batch = Batch.objects.create(description="b", pending=1)
    workflow = Workflow.objects.create(name="w")
    made = {
        "sync": FinishedJobFactory(
            task_path="shop.tasks.sync", kwargs={"customer_id": 4242}, args=[]
        ),
        "sync_text_id": FinishedJobFactory(
            task_path="shop.tasks.sync_all", kwargs={"customer_id": "4242"}, args=[]
        ),
        "other_customer": FinishedJobFactory(
            task_path="shop.tasks.sync", kwargs={"customer_id": 42}, args=[]
        ),
        "positional": JobFactory(task_path="shop.reports.daily", args=[4242, "x"], kwargs={}),
        "emails": JobFactory(task_path="mail.send", queue_name="emails", kwargs={"to": "a@b"}),
        "keyed": JobFactory(
            task_path="mail.send", concurrency_key="mail.send/account:42", kwargs={}
        ),
        "unique": JobFactory(task_path="mail.send", unique_key="invoice:7", kwargs={}),
        "batched": JobFactory(task_path="mail.send", batch_id=batch.pk),
        "node": JobFactory(task_path="mail.send", workflow_id=workflow.pk),
        # Characters LIKE takes as wildcards or escapes, in a task path.
        "percent": JobFactory(task_path="odd.100%_done\\x"),
        "underscore_twin": JobFactory(task_path="odd.100xxdone"),
    }
    made["batch"], made["workflow"] = batch, workflow
    return made


def ids(jobs, *names: str) -> set[int]:
    return {jobs[name].pk for name in names}


def test_each_form_finds_what_it_says(admin_client, jobs):
    job = jobs["sync"].pk
    mysql = connections["default"].vendor == "mysql"
    cases = {
        str(job): ("sync",),
        f"#{job}": ("sync",),
        f"id:{job}": ("sync",),
        "task:shop.tasks.sync": ("sync", "sync_text_id", "other_customer"),
        "task:shop.": ("sync", "sync_text_id", "other_customer", "positional"),
        "queue:emails": ("emails",),
        "key:mail.send/account:42": ("keyed",),
        "key:invoice:7": ("unique",),
        "key:mail.send/acc*": ("keyed",),
        "key:invoice*": ("unique",),
        f"batch:{jobs['batch'].pk}": ("batched",),
        f"workflow:#{jobs['workflow'].pk}": ("node",),
        "customer_id=4242": ("sync", "sync_text_id"),
        # MariaDB compares JSON scalars as text there: its scan also finds the number.
        'customer_id="4242"': ("sync", "sync_text_id") if mysql else ("sync_text_id",),
        "to=a@b": ("emails",),
        "text:a@b": ("emails",),
        # A bare word: a task path prefix, a queue, or a key.
        "shop.reports": ("positional",),
        "emails": ("emails",),
        "invoice:7": ("unique",),
        # LIKE's wildcards and escape are text.
        "task:odd.100%_done\\": ("percent",),
        "task:odd.100_": (),
    }
    for q, expected in cases.items():
        assert listed(admin_client, q) == ids(jobs, *expected), q


def test_arg_finds_a_positional_or_keyword_value(admin_client, jobs):
    found = listed(admin_client, "arg:4242")
    if connections["default"].vendor == "postgresql":
        # Equality, from the GIN indexes.
        assert found == ids(jobs, "sync", "sync_text_id", "positional")
    else:
        # No index there: the text, in the newest jobs' arguments.
        assert ids(jobs, "sync", "sync_text_id", "positional") <= found
        assert jobs["other_customer"].pk not in found


@pytest.mark.parametrize(
    ("q", "said"),
    [
        ("12", "Searched job #12."),
        ("task:shop.", "Searched task paths starting \u201cshop.\u201d."),
        ("queue:emails", "Searched queue \u201cemails\u201d."),
        (
            "text:needle",
            "Searched \u201cneedle\u201d in the arguments of the newest 100,000 jobs: a scan, "
            "not an index lookup.",
        ),
        ("workflow:x", "Searched nothing: \u201cx\u201d is no workflow id."),
        ("x" * 10_000, "Searched nothing: a search is at most 500 characters."),
    ],
)
def test_the_page_says_what_it_searched(admin_client, jobs, q, said):
    response = admin_client.get(reverse(LIST), {"q": q})
    assert response.status_code == 200
    assert said in response.content.decode()


def test_a_scan_reads_only_the_newest_jobs(admin_client, monkeypatch, db):
    monkeypatch.setattr(search, "SCAN_WINDOW", 3)
    made = [JobFactory(kwargs={"note": "needle"}) for _ in range(5)]
    assert listed(admin_client, "text:needle") == {job.pk for job in made[-3:]}
    assert listed(admin_client, "key:need*") == set()
    body = admin_client.get(reverse(LIST), {"q": "text:needle"}).content.decode()
    assert "the newest 3 jobs: a scan" in body
    # A scan is not refreshed on a timer; an index lookup is.
    assert "django_jobs/refresh.js" not in body
    assert "django_jobs/refresh.js" in admin_client.get(reverse(LIST), {"q": "12"}).content.decode()


@pytest.mark.skipif(
    connections["default"].vendor != "postgresql", reason="the GIN and pattern-ops indexes"
)
@pytest.mark.parametrize(
    ("q", "index"),
    [
        ("customer_id=4242", "jobs_job_kwargs_gin"),
        ("arg:4242", "jobs_job_kwargs_gin"),
        ("arg:4242", "jobs_job_args_gin"),
        ("task:shop.tasks.", "jobs_job_task_prefix"),
    ],
)
def test_postgresql_answers_from_the_index(jobs, q, index):
    """The plan can take the index: sequential scans and the primary key's ordered scan
    priced out, as a big table prices them (the test table is tiny); bench figures in
    docs/admin.md show the same plans on three million jobs."""
    connection = connections["default"]
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_indexscan = off")
    # An argument search reads its matches' ids first (search.newest_matches): every
    # statement of the search is explained, and one of them must take the index.
    with CaptureQueriesContext(connection) as queries:
        found = search.parse(q, "default")
        assert found is not None and not found.scan
        queryset = found.apply(Job.objects.all()).order_by("-pk")[:50]
        list(queryset)
    plans = []
    with connection.cursor() as cursor:
        for query in queries.captured_queries:
            cursor.execute(f"EXPLAIN {query['sql']}")
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
    assert any(index in plan for plan in plans), plans


BAD_TERMS = [
    "x" * 10_000,
    "%",
    "_",
    "\\",
    "'",
    '"',
    "%%%",
    "task:%",
    "task:_",
    "task:\\",
    "task:'",
    "key:%*",
    "key:*",
    "queue:'; DROP TABLE x; --",
    'arg:"',
    "arg:'",
    'arg:"\\u0000"',
    "arg:9" + "9" * 400,
    "arg:1e400",
    "customer_id=%",
    "customer_id='",
    "a=\\",
    "text:%_\\",
    "id:",
    "id:-1",
    "batch:99999999999999999999999",
    "#",
    "\U0010ffff",
    "task:\U0010ffff",
]


@pytest.mark.parametrize("q", BAD_TERMS)
def test_bad_search_terms_answer_a_page(admin_client, jobs, q):
    response = admin_client.get(reverse(LIST), {"q": q})
    assert response.status_code == 200, q


def test_a_nul_in_the_search_answers_400(admin_client, jobs):
    for q in ("\x00", "task:a\x00", "arg:\x00", "customer_id=\x00"):
        assert admin_client.get(reverse(LIST), {"q": q}).status_code == 400, q


@pytest.mark.parametrize(
    "params",
    [
        {"p": "999999"},
        {"p": "-1"},
        {"p": "x"},
        {"o": "zz"},
        {"o": "99"},
        {"o": "-99.zz"},
        {"o": "2"},
        {"o": "1.2.3.4.5.6"},
        {"q": "task:shop.", "o": "-1", "p": "5"},
    ],
)
def test_bad_pages_and_orderings_answer_a_page(admin_client, jobs, params):
    """Past the end: Django's redirect to ``?e=1`` (the list says the lookup was wrong);
    an ordering that is no column, or no sortable one, is ignored."""
    response = admin_client.get(reverse(LIST), params)
    assert response.status_code in (200, 302), params


def test_only_the_id_and_enqueue_columns_sort(admin_client, jobs):
    """Sorting by queue, state, key or finished time would read every job: no link."""
    cl = admin_client.get(reverse(LIST)).context["cl"]
    sortable = {
        name
        for name in cl.list_display
        if getattr(getattr(cl.model_admin, name, None), "admin_order_field", None)
    }
    assert sortable == {"job", "enqueued"}
    newest_first = [job.pk for job in cl.result_list]
    by_enqueue = admin_client.get(reverse(LIST), {"o": "5"}).context["cl"].result_list
    assert [job.pk for job in by_enqueue] == sorted(newest_first)


@settings(max_examples=80, deadline=None)
@given(
    prefix=st.sampled_from(["", *(f"{kind}:" for kind in search.PREFIXES), "customer_id="]),
    value=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=60),
)
def test_any_search_answers_a_page(admin_client, prefix, value):
    response = admin_client.get(reverse(LIST), {"q": prefix + value})
    assert response.status_code == 200, prefix + value


def test_the_statement_timeout_stops_a_statement_and_is_lifted_after(db):
    connection = connections["default"]
    with pytest.raises(DatabaseError) as stopped:
        with ops("default").statement_timeout("default", 0.2):
            with connection.cursor() as cursor:
                cursor.execute(SLOW_SQL)
                cursor.fetchall()
    assert ops("default").is_statement_timeout(stopped.value)
    assert not ops("default").is_statement_timeout(DatabaseError("something else"))
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SHOW statement_timeout")
            assert cursor.fetchone()[0] == "0"
        elif connection.vendor == "mysql":
            cursor.execute("SELECT @@SESSION.max_statement_time")
            assert float(cursor.fetchone()[0]) == 0
        cursor.execute("SELECT 1")
        assert cursor.fetchone()[0] == 1
    assert Job.objects.count() == 0


def test_a_page_whose_statement_runs_out_says_so(admin_client, monkeypatch, db):
    """Any jobs page, through the wrapper every jobs admin class's URLs get: a 503 page
    that says what happened, not a 500; the next request is served as usual."""
    JobFactory()
    monkeypatch.setattr(JobAdmin, "statement_timeout", 0.2)
    slow = search.Search(Q(pk__gte=RawSQL(f"({SLOW_SQL})", [])), "a slow search")
    monkeypatch.setattr(search, "parse", lambda term, db: slow if term == "slow" else None)
    response = admin_client.get(reverse(LIST), {"q": "slow"})
    assert response.status_code == 503
    assert "ran for more than 0.2 seconds and was stopped" in response.content.decode()
    assert admin_client.get(reverse(LIST)).status_code == 200
