"""``manage.py jobs`` with whatever text a job or a process can store, on the database
under test: the report holds no control character but its own line breaks, and each
value stays on one line of it, escaped (``django_jobs.text.printable``)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from django_jobs.models import JobStatus
from django_jobs.text import CONTROL, printable
from tests.factories import (
    BlockedExecutionFactory,
    ClaimedExecutionFactory,
    JobFactory,
    ProcessFactory,
)

pytestmark = pytest.mark.django_db

PROPERTY = settings(max_examples=40)


def stored_text(max_size: int) -> st.SearchStrategy[str]:
    """Text a column can hold: no NUL on PostgreSQL (its text refuses one), at least one
    character that is not blank (a report line of spaces only is not searched for)."""
    nul = "\x00" if connection.vendor == "postgresql" else None
    alphabet = st.characters(codec="utf-8", exclude_characters=nul)
    return st.text(alphabet, min_size=1, max_size=max_size).filter(lambda s: s.strip())


@PROPERTY
@given(
    key=stored_text(60),
    queue=stored_text(40),
    task_path=stored_text(60),
    message=stored_text(80),
    hostname=stored_text(40),
)
def test_any_stored_text_is_printed_escaped_on_one_line(
    db, key: str, queue: str, task_path: str, message: str, hostname: str
):
    with transaction.atomic():
        BlockedExecutionFactory(job__concurrency_key=key, concurrency_key=key)
        ClaimedExecutionFactory(
            job=JobFactory(
                status=JobStatus.RUNNING,
                queue_name=queue,
                task_path=task_path,
                progress_done=1,
                progress_message=message,
                progress_at=timezone.now(),
            ),
            queue_name=queue,
            process=ProcessFactory(hostname=hostname),
        )
        out = StringIO()
        call_command("jobs", stdout=out)
        transaction.set_rollback(True)
    lines = out.getvalue().splitlines()
    assert not [line for line in lines if CONTROL.search(line)]
    for value in (key, queue, task_path, message, hostname):
        assert [line for line in lines if printable(value) in line], value
