"""The public API's signatures are the real ones: ``help()`` and ``inspect.signature`` name
every option of ``@task``, and a type checker sees what ``@task`` makes of a function."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest
from django.tasks import Task

import django_jobs
from django_jobs.tasks.job_task import (
    JOB_OPTION_NAMES,
    JobOptions,
    JobTask,
    job_options,
)
from tests import tasks

ROOT = Path(__file__).resolve().parent.parent


def test_task_is_the_function_with_every_option_in_its_signature():
    from django_jobs.tasks import job_task

    assert django_jobs.task is job_task.task
    parameters = inspect.signature(django_jobs.task).parameters
    defaults = {f.name: f.default for f in fields(JobTask)}
    for name in ("priority", "queue_name", "backend", "takes_context", *JOB_OPTION_NAMES):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert {name: parameters[name].default for name in JOB_OPTION_NAMES} == {
        name: defaults[name] for name in JOB_OPTION_NAMES
    }
    assert "max_attempts" in str(inspect.signature(django_jobs.task))


def test_the_options_are_jobtask_s_fields_in_jobs_options_and_its_defaults():
    own = [f.name for f in fields(JobTask) if f.name not in {f.name for f in fields(Task)}]
    assert list(JOB_OPTION_NAMES) == own
    # JobOptions types @task(...) and using(...): a new field needs its line there too.
    assert set(get_type_hints(JobOptions)) == set(own)


def test_a_plain_task_gets_jobtask_s_defaults():
    # Every field given: Django 6.0's Task has no defaults for them, 6.1's does.
    plain = Task(
        priority=0,
        func=tasks.add.func,
        backend="default",
        queue_name="default",
        run_after=None,
    )
    options = job_options(plain)
    assert options == {f.name: f.default for f in fields(JobTask) if f.name in JOB_OPTION_NAMES}
    options["max_attempts"] = 9
    assert job_options(plain)["max_attempts"] == 1  # a copy each time


SNIPPET = """
    from django.tasks import TaskContext

    from django_jobs import Exponential, cancel, enqueue_batch, progress, task


    @task
    def add(a: int, b: int) -> int:
        return a + b


    @task(max_attempts=3, backoff=Exponential(base=2), concurrency_key="account:{account_id}")
    def sync(account_id: int) -> str:
        return str(account_id)


    @task(takes_context=True, queue_name="emails")
    def send(context: TaskContext, to: str) -> None:
        pass


    reveal_type(add)
    reveal_type(sync)
    reveal_type(send)
    reveal_type(sync.enqueue(account_id=1))
    reveal_type(sync.using(max_attempts=5, on_conflict="discard"))
    reveal_type(cancel(1))
    reveal_type(progress(1))
    reveal_type(enqueue_batch([(add, (1, 2), {})], on_finish=send))
    add.enqueue("x", 2)
    task(max_atempts=3)
    task(on_conflict="drop")
"""


def test_mypy_sees_the_types_of_task_and_the_public_functions(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (the dev extra installs it)")
    (tmp_path / "snippet.py").write_text(textwrap.dedent(SNIPPET))
    (tmp_path / "mypy.ini").write_text("[mypy]\nfollow_imports = silent\n")
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", ".cache"]
    run = subprocess.run(
        [*command, "--no-error-summary", "--show-error-codes", "snippet.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if ": " in line]
    revealed = [line.split('"')[1] for line in lines if line.startswith("note: Revealed type")]
    assert revealed == [
        "django_jobs.tasks.job_task.JobTask[[a: int, b: int], int]",
        "django_jobs.tasks.job_task.JobTask[[account_id: int], str]",
        "django_jobs.tasks.job_task.JobTask[[to: str], None]",
        "django.tasks.base.TaskResult[[account_id: int], str]",
        "django_jobs.tasks.job_task.JobTask[[account_id: int], str]",
        "str",
        "django_jobs.core.progress.Progress | None",
        "django_jobs.core.batches.BatchResult",
    ], run.stdout + run.stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 3, run.stdout
    assert 'incompatible type "str"; expected "int"' in errors[0]
    assert 'Unexpected keyword argument "max_atempts"' in errors[1]
    assert errors[2].startswith('error: No overload variant of "task"')
