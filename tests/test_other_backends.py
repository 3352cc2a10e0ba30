"""Our tasks under Django's own test backends (``ImmediateBackend``, ``DummyBackend``) and under
ours that subclass them (``django_jobs.backend.ImmediateBackend``, ``DummyBackend``).

A project's test settings choose the backend before its task modules are imported, so each
backend gets a fresh process that imports the demo's tasks as such a project would
(tests/other_backend_tour.py) and reports what every call did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.tasks import Task
from django.tasks.backends.base import BaseTaskBackend

from tests.harness import REPO_ROOT

TOUR = REPO_ROOT / "tests" / "other_backend_tour.py"
NEEDS = "django_jobs.exceptions.NeedsJobsBackend"


def tour(backend: str, tmp_path) -> dict:
    env = {
        **os.environ,
        "JOBS_TASKS_BACKEND": backend,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'unused.sqlite3'}",
    }
    env.pop("TEST_DATABASE_NAME", None)
    done = subprocess.run(
        [sys.executable, str(TOUR)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def statuses(report: dict, name: str) -> list[str]:
    call = report["calls"][name]
    assert "raised" not in call, call
    return call["statuses"]


@pytest.fixture(scope="module", params=["immediate", "jobs-immediate"])
def immediate(request, tmp_path_factory) -> dict:
    return tour(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=["dummy", "jobs-dummy"])
def dummy(request, tmp_path_factory) -> dict:
    return tour(request.param, tmp_path_factory.mktemp(request.param))


def test_immediate_runs_each_demo_task_at_its_enqueue_ignoring_our_options(immediate):
    calls = immediate["calls"]
    assert calls["add"]["values"] == [5]
    assert calls["fetch_status (async)"]["values"] == [
        {"url": "https://example.com", "status": 200}
    ]
    assert calls["bulk_enqueue"]["values"] == ["sent to user 1", "sent to user 2"]
    # max_attempts=3 (and a per-call max_attempts=5) ignored: one attempt, failed.
    for name in ("flaky_report (max_attempts=3)", "using(max_attempts=5)"):
        assert statuses(immediate, name) == ["FAILED"]
        assert calls[name]["errors"] == [["builtins.ConnectionError"]]
    assert calls["parse_upload"]["errors"] == [["builtins.ValueError"]]
    # Neither the concurrency key nor the unique key holds anything back.
    assert statuses(immediate, "sync_account (concurrency_key)") == ["SUCCESSFUL"] * 2
    assert statuses(immediate, "rebuild_index (unique_key)") == ["SUCCESSFUL"] * 2
    # set_progress() keeps nothing instead of raising outside a django-jobs worker.
    assert calls["export_orders (set_progress)"]["values"] == ["orders-2026-10.csv"]
    # dependency_results() is empty: the fan-in then finds no quote to compare.
    assert calls["pick_cheapest (dependency_results)"]["errors"] == [["builtins.ValueError"]]


def test_dummy_keeps_each_demo_task_enqueued_and_runs_none(dummy):
    calls = dummy["calls"]
    simple = [name for name, call in calls.items() if "raised" not in call]
    assert len(simple) == 10
    assert {status for name in simple for status in calls[name]["statuses"]} == {"READY"}
    declared = dummy["keyed_by_django"]
    stored = sum(len(calls[name]["statuses"]) for name in simple)
    stored += 1 if isinstance(declared, dict) else 0
    # Every enqueue, and only those, is in the backend's list (after= adds its dependency).
    assert dummy["stored"] == stored + 1


def test_what_only_our_backend_can_do_is_refused_in_plain_words(immediate, dummy):
    for report in (immediate, dummy):
        for name in ("enqueue_batch", "workflow", "chain"):
            call = report["calls"][name]
            assert call["raised"] == NEEDS, call
            assert "needs a django-jobs backend" in call["message"]
            assert report["backend"] in call["message"]
            assert "docs/testing.md" in call["message"]


def test_after_is_refused_not_ignored(immediate, dummy):
    for report in (immediate, dummy):
        after = report["calls"]["after="]
        if report["backend"].startswith("django_jobs."):
            assert after["raised"] == NEEDS and "after= needs" in after["message"]
        else:
            # Django's own task class, which @django.tasks.task makes there, takes no
            # options at all: Django's refusal, at the using() call.
            assert after["raised"] == "builtins.TypeError"
            assert "'after'" in after["message"]


def test_one_warning_at_most_and_only_where_options_are_ignored_silently(immediate, dummy):
    for report in (immediate, dummy):
        categories = [w["category"] for w in report["warnings"]]
        if report["backend"].startswith("django_jobs."):
            # Chosen for tests on purpose: the backend's docs say it ignores them.
            assert categories == []
        else:
            assert categories == ["IgnoredJobOptions"]
            (warning,) = report["warnings"]
            assert report["backend"] in warning["message"]
            assert "docs/testing.md" in warning["message"]


def test_django_task_takes_our_options_only_with_our_test_backends(immediate, dummy):
    """Django 6.1 hands @django.tasks.task's options to the backend's task_class; Django 6.0's
    decorator takes no option beyond its own (django_jobs.task is for 6.0)."""
    import django

    for report in (immediate, dummy):
        declared = report["keyed_by_django"]
        if django.VERSION < (6, 1):
            assert declared.startswith("TypeError") and "max_attempts" in declared
        elif report["backend"].startswith("django_jobs."):
            expected = "SUCCESSFUL" if "Immediate" in report["backend"] else "READY"
            assert declared["statuses"] == [expected]
        else:
            assert declared.startswith("TypeError") and "max_attempts" in declared


def test_a_run_of_another_backend_is_followed_through_nesting_and_ours_is_not():
    from django.tasks.backends.immediate import ImmediateBackend

    from django_jobs.backend import JobsBackend
    from django_jobs.core.progress import set_progress
    from django_jobs.tasks.other_backends import note_finish, note_start, other_backend_running

    assert not other_backend_running()
    note_start(JobsBackend)  # our worker's own signal: not another backend's run
    assert not other_backend_running()
    with pytest.raises(RuntimeError, match="outside a running job"):
        set_progress(1, 2)
    note_start(ImmediateBackend)
    note_start(ImmediateBackend)  # a task that enqueues another runs it in its own body
    note_finish(ImmediateBackend)
    assert other_backend_running()
    set_progress(1, 2, "kept nowhere")
    with pytest.raises(ValueError):
        set_progress(-1)  # a bad value is refused all the same
    note_finish(ImmediateBackend)
    note_finish(JobsBackend)
    assert not other_backend_running()


class ThirdPartyTask(Task):
    """A task class of some other backend's own."""


class ThirdPartyBackend(BaseTaskBackend):
    """Neither ours nor one of Django's test backends: it records what it is given."""

    task_class = ThirdPartyTask

    def __init__(self, alias, params):
        super().__init__(alias, params)
        self.enqueued: list = []

    def enqueue(self, task, args, kwargs):
        self.enqueued.append((task, args, kwargs))
        raise AssertionError("nothing here enqueues through a third-party backend")


def echo(value: str) -> str:
    return value


@pytest.fixture
def third_party(settings):
    from django.tasks import task_backends

    settings.TASKS = {
        **settings.TASKS,
        "third": {"BACKEND": "tests.test_other_backends.ThirdPartyBackend"},
    }
    task_backends._settings = None
    yield "third"
    task_backends._settings = None


def test_another_backends_own_task_class_is_kept_unless_our_options_need_ours(third_party):
    from django_jobs import bulk_enqueue, task
    from django_jobs.exceptions import IgnoredJobOptions, NeedsJobsBackend
    from django_jobs.tasks import other_backends
    from django_jobs.tasks.job_task import JobTask

    plain = task(echo, backend=third_party)
    assert type(plain) is ThirdPartyTask
    other_backends.warned = False
    with pytest.warns(IgnoredJobOptions, match="ThirdPartyBackend"):
        keyed = task(echo, backend=third_party, max_attempts=2)
    assert isinstance(keyed, JobTask) and keyed.max_attempts == 2
    # Not one of Django's test backends: no one-by-one stand-in for a bulk enqueue that
    # promises all or nothing.
    with pytest.raises(NeedsJobsBackend, match=r"bulk_enqueue\(\) needs a django-jobs backend"):
        bulk_enqueue([(plain, ["a"], {}), (plain, ["b"], {})])


def test_the_signal_receivers_take_any_sender_and_never_raise():
    """They run in every backend's worker: django-tasks-db's db_worker sends task_started
    with its backend instance (not the class Django sends), and a receiver that raised
    there failed every job of that worker (bench/throughput.py's peer drain: 1,000 of
    1,000 failed)."""
    from django.tasks import task_backends
    from django.tasks.backends.immediate import ImmediateBackend

    from django_jobs.tasks.other_backends import note_finish, note_start, other_backend_running

    ours = task_backends["default"]
    for sender in (ours, type(ours)):  # ours, as an instance or a class: never counted
        note_start(sender)
        assert not other_backend_running()
        note_finish(sender)
    for sender in (ImmediateBackend("other", {}), ImmediateBackend, None, 42):
        note_start(sender)
        assert other_backend_running(), sender
        note_finish(sender)
        assert not other_backend_running(), sender
