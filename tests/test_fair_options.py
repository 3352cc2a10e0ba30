"""``fair_key`` and ``fair_weight`` (issue 38): checked where they are declared and where a
call fills them, and stored on the job only in a queue of ``DJANGO_JOBS["fair_queues"]``.

A job of a fair queue takes its group from its call (``''``: the group of the jobs of no
key); a job of any other queue has none, and a task that gives one there is refused, naming
the queue and the setting, rather than quietly losing its fairness. Every refusal comes
before anything is written.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import Error
from django.tasks import default_task_backend
from django.tasks.exceptions import InvalidTask
from django.test import override_settings

from django_jobs import bulk_enqueue
from django_jobs import task as jobs_task
from django_jobs.checks import backend_checks
from django_jobs.conf import JobsSettings, fair_queue_names
from django_jobs.core import enqueue
from django_jobs.models import Job
from tests import fair_tasks as ft
from tests import tasks

FAIR = {**settings.DJANGO_JOBS, "fair_queues": ["reports"]}


def tenant_count(tenant_id: int) -> int:
    return tenant_id


def job_of(result: Any) -> Job:
    return Job.objects.get(pk=int(result.id))


def fair_columns(result: Any) -> tuple[str | None, float | None]:
    job = job_of(result)
    return job.fair_key, job.fair_weight


# --- declaration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight",
    [0, -1, 0.001, 100.5, math.nan, math.inf, -math.inf, 10**100, 10**400, True, "2", [2]],
    ids=repr,
)
def test_a_weight_out_of_bounds_fails_at_declaration_naming_the_bounds(weight):
    message = "fair_weight must be a number from 0.01 to 100 (None: 1, an even share), not "
    with pytest.raises(InvalidTask, match=re.escape(message)):
        jobs_task(tenant_count, queue_name="reports", fair_key="{tenant_id}", fair_weight=weight)
    with pytest.raises(InvalidTask, match=re.escape(message)):
        ft.tenant_report.using(fair_weight=weight)


@pytest.mark.parametrize("weight", [0.01, 1, 2.5, 100])
def test_a_weight_within_bounds_is_kept_as_given(weight):
    declared = jobs_task(tenant_count, queue_name="reports", fair_weight=weight)
    assert declared.fair_weight == weight
    assert ft.tenant_report.using(fair_weight=weight).fair_weight == weight


@pytest.mark.parametrize(
    ("fair_key", "message"),
    [
        ("{tenant}", "fair_key '{tenant}' names 'tenant', which tests.test_fair_options"),
        ("t-{0}", "fair_key fields must name arguments, e.g. '{account_id}'"),
        ("{tenant_id", "fair_key '{tenant_id' is not a valid format string"),
        ("", "fair_key must be a non-empty format string or a callable"),
        (7, "fair_key must be a non-empty format string or a callable"),
    ],
    ids=["missing-argument", "positional", "unbalanced", "empty", "int"],
)
def test_a_bad_fair_key_fails_at_declaration_and_in_using(fair_key, message):
    with pytest.raises(InvalidTask, match=re.escape(message)):
        jobs_task(tenant_count, queue_name="reports", fair_key=fair_key)
    with pytest.raises(InvalidTask, match=r"fair_key"):
        ft.tenant_report.using(fair_key=fair_key)


# --- enqueue: refused, nothing written ----------------------------------------------------


@pytest.fixture
def fair(db):
    with override_settings(DJANGO_JOBS=FAIR):
        yield


def refused(call: Any, message: str) -> None:
    """``call()`` raises ``InvalidTask`` with ``message`` in it, and writes no job."""
    before = Job.objects.count()
    with pytest.raises(InvalidTask) as info:
        call()
    assert message in str(info.value)
    assert Job.objects.count() == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: ft.tenant_report.enqueue(""),
            "fair_key of tests.fair_tasks.tenant_report gave an empty string: a fair key "
            "names a group, and '' is the group of the jobs of no key (for those, give no "
            "fair_key)",
        ),
        (
            lambda: ft.keyed_by_function.enqueue("empty"),
            "fair_key of tests.fair_tasks.keyed_by_function gave an empty string",
        ),
        (
            lambda: ft.tenant_report.enqueue("x" * 256),
            f"fair_key of tests.fair_tasks.tenant_report gave {'x' * 60!r}..., 256 characters "
            "long; it may be at most 255",
        ),
        (
            lambda: ft.keyed_by_function.enqueue("long"),
            "gave 'kkkk",
        ),
        (
            lambda: ft.keyed_by_function.enqueue("int"),
            "fair_key of tests.fair_tasks.keyed_by_function must give a string, not 7",
        ),
        (
            lambda: ft.keyed_by_function.enqueue("none"),
            "fair_key of tests.fair_tasks.keyed_by_function must give a string, not None",
        ),
        (
            lambda: ft.keyed_by_function.enqueue("nul"),
            "fair_key of tests.fair_tasks.keyed_by_function gave 'acme\\x00corp', which holds "
            "a NUL character (\\x00): no fair key may hold one",
        ),
    ],
    ids=[
        "empty-template",
        "empty-callable",
        "long-template",
        "long-callable",
        "int",
        "none",
        "nul",
    ],
)
def test_a_key_no_group_can_have_is_refused_at_enqueue(fair, call, message):
    refused(call, message)


@pytest.mark.parametrize(
    ("call", "given"),
    [
        (lambda: ft.tenant_report.using(queue_name="default").enqueue(1), "fair_key"),
        (lambda: ft.weighted_report.using(queue_name="emails").enqueue(1), "fair_key and fair"),
        (lambda: ft.plain_default.using(fair_weight=2).enqueue(), "fair_weight"),
        (lambda: ft.plain_default.using(fair_key="acme").enqueue(), "fair_key"),
    ],
    ids=["key", "key-and-weight", "weight-only", "key-by-using"],
)
def test_a_fair_key_for_a_queue_that_is_not_fair_is_refused(fair, call, given):
    before = Job.objects.count()
    with pytest.raises(InvalidTask) as info:
        call()
    message = str(info.value)
    assert f"gives {given}" in message
    assert re.search(r"for queue '(default|emails)', which is not fair", message)
    assert message.endswith("add it to DJANGO_JOBS['fair_queues']")
    assert Job.objects.count() == before


def test_without_the_setting_no_queue_is_fair(db):
    refused(
        lambda: ft.tenant_report.enqueue(1),
        "tests.fair_tasks.tenant_report gives fair_key for queue 'reports', which is not "
        "fair: add it to DJANGO_JOBS['fair_queues']",
    )
    assert fair_columns(ft.unkeyed_report.enqueue()) == (None, None)


@pytest.mark.parametrize("value", ["reports", ["rep*"], {"reports": 1}])
def test_a_setting_the_enqueue_cannot_read_makes_no_queue_fair_and_says_so(db, value):
    with override_settings(DJANGO_JOBS={**settings.DJANGO_JOBS, "fair_queues": value}):
        assert fair_queue_names() == frozenset()
        refused(lambda: ft.tenant_report.enqueue(1), "check django_jobs.E025)")
        assert fair_columns(ft.unkeyed_report.enqueue()) == (None, None)


def test_a_bulk_with_one_refused_fair_call_writes_nothing(fair):
    calls = [
        (ft.tenant_report, [1], {}),
        (ft.unkeyed_report, [], {}),
        (tasks.add, [1, 2], {}),
        (ft.keyed_by_function, ["empty"], {}),
    ]
    refused(lambda: bulk_enqueue(calls), "gave an empty string")
    calls[-1] = (ft.tenant_report.using(queue_name="default"), [2], {})
    refused(lambda: bulk_enqueue(calls), "which is not fair")


# --- enqueue: what the row holds ----------------------------------------------------------


def test_a_keyed_job_of_a_fair_queue_stores_its_key_as_resolved(fair):
    assert fair_columns(ft.tenant_report.enqueue(42)) == ("42", None)
    assert fair_columns(ft.tenant_report.enqueue(tenant_id="acme", day="friday")) == (
        "acme",
        None,
    )
    # Not the task's path in front, unlike a concurrency key: tasks share a tenant's group.
    assert fair_columns(ft.keyed_by_function.enqueue("42")) == ("42", None)
    assert fair_columns(ft.weighted_report.enqueue(7)) == ("tenant-7", 2.5)
    assert isinstance(job_of(ft.weighted_report.enqueue(8)).fair_weight, float)


def test_a_job_of_no_key_in_a_fair_queue_joins_the_group_of_no_key(fair):
    assert fair_columns(ft.unkeyed_report.enqueue()) == ("", None)
    # A plain Django task, and our task of another queue moved into the fair one.
    assert fair_columns(tasks.add.using(queue_name="reports").enqueue(1, 2)) == ("", None)
    assert fair_columns(ft.plain_default.using(queue_name="reports").enqueue()) == ("", None)
    # A weight alone: the group of no key, at that weight.
    assert fair_columns(ft.unkeyed_report.using(fair_weight=3).enqueue()) == ("", 3.0)


def test_a_job_of_a_queue_that_is_not_fair_has_no_group(fair):
    assert fair_columns(ft.plain_default.enqueue()) == (None, None)
    assert fair_columns(tasks.add.enqueue(1, 2)) == (None, None)
    assert fair_columns(tasks.echo.enqueue("x")) == (None, None)  # queue "emails"


def test_using_gives_a_call_its_own_key_and_weight(fair):
    chosen = ft.unkeyed_report.using(fair_key="acme", fair_weight=2)
    assert fair_columns(chosen.enqueue(1)) == ("acme", 2.0)
    assert fair_columns(ft.tenant_report.using(fair_key="{day}").enqueue(1, "sunday")) == (
        "sunday",
        None,
    )
    assert fair_columns(ft.weighted_report.using(fair_weight=0.5).enqueue(3)) == (
        "tenant-3",
        0.5,
    )
    assert fair_columns(ft.weighted_report.using(fair_weight=None).enqueue(4)) == (
        "tenant-4",
        None,
    )


def test_a_bulk_enqueue_reads_the_setting_once_per_task(fair, monkeypatch):
    reads: list[int] = []

    def counted() -> frozenset[str]:
        reads.append(1)
        return fair_queue_names()

    monkeypatch.setattr(enqueue, "fair_queue_names", counted)
    results = bulk_enqueue(
        [(ft.tenant_report, [n], {}) for n in range(5)]
        + [(ft.unkeyed_report, [n], {}) for n in range(5)]
    )
    assert len(reads) == 2
    assert [job_of(r).fair_key for r in results] == ["0", "1", "2", "3", "4", *[""] * 5]


# --- the setting --------------------------------------------------------------------------


def fair_errors(value: Any) -> list[Error]:
    with override_settings(DJANGO_JOBS={"fair_queues": value}):
        errors = backend_checks(default_task_backend)
    return [e for e in errors if e.id == "django_jobs.E025"]


@pytest.mark.parametrize("value", [[], (), ["reports"], ("reports", "slow")])
def test_a_list_of_declared_queues_passes_the_check(value):
    assert fair_errors(value) == []
    with override_settings(DJANGO_JOBS={"fair_queues": value}):
        assert JobsSettings.load().fair_queues == tuple(value)
        assert fair_queue_names() == frozenset(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("reports", "DJANGO_JOBS['fair_queues'] must be a list of queue names, not 'reports'."),
        (None, "DJANGO_JOBS['fair_queues'] must be a list of queue names, not None."),
        ({"reports": 1}, "must be a list of queue names, not {'reports': 1}."),
        (["reports", ""], "must hold queue names (non-empty strings), not ''."),
        (["  "], "must hold queue names (non-empty strings), not '  '."),
        ([7], "must hold queue names (non-empty strings), not 7."),
        (
            ["report*"],
            "DJANGO_JOBS['fair_queues'] names queues exactly, without patterns: 'report*' "
            "has a '*'.",
        ),
        (["*"], "without patterns: '*' has a '*'."),
        (["q" * 129], "which is longer than 128 characters (no queue's name is)."),
    ],
    ids=["string", "none", "dict", "empty", "blank", "int", "pattern", "star", "long"],
)
def test_a_malformed_setting_is_error_e025(value, message):
    (error,) = fair_errors(value)
    assert message in error.msg
    assert error.hint == "e.g. ['tenant-reports']: the queues whose jobs take turns by fair_key."


def test_a_queue_no_backend_declares_is_error_e025_with_the_likely_one():
    errors = fair_errors(["reports", "reprots", "nope"])
    assert [e.msg for e in errors] == [
        "DJANGO_JOBS['fair_queues'] names 'reprots', which is not in QUEUES.",
        "DJANGO_JOBS['fair_queues'] names 'nope', which is not in QUEUES.",
    ]
    assert errors[0].hint == "Did you mean 'reports'?"
    assert errors[1].hint == "Known queues: default, emails, reports, reports-daily, slow."
