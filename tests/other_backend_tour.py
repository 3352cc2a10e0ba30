"""The demo's tasks under one of Django's own test backends, in a process of its own.

Run by tests/test_other_backends.py as ``python tests/other_backend_tour.py``, with
``JOBS_TASKS_BACKEND`` naming the backend (testproject/settings.py): a project's test
settings choose the backend before its task modules are imported, so only a fresh process
imports them as such a project would. Prints one JSON document: each call's status (or the
error it raised, by class and message) and every warning seen from ``django.setup()`` on.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import django

    django.setup()
    from django.tasks import task as django_task
    from django.tasks import task_backends

    import django_jobs
    from testproject.demo import tasks


# django.tasks.task with our options: Django 6.1 hands them to the backend's task_class,
# ours under the jobs-* backends; Django's own class takes none of them.
try:

    @django_task(max_attempts=2, concurrency_key="{text}")
    def shout(text: str) -> str:
        return text.upper()

    DECLARED_BY_DJANGO: str | None = None
except TypeError as exc:
    DECLARED_BY_DJANGO = f"TypeError: {exc}"


def outcome(call: Any) -> dict[str, Any]:
    """What one call did: the result's status, value and errors, or what it raised."""
    try:
        value = call()
    except Exception as exc:
        return {"raised": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}
    results = value if isinstance(value, list) else [value]
    return {
        "statuses": [str(result.status) for result in results],
        "values": [
            result.return_value if result.status == "SUCCESSFUL" else None for result in results
        ],
        "errors": [[e.exception_class_path for e in result.errors] for result in results],
    }


def tour() -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        if DECLARED_BY_DJANGO is None:
            keyed_by_django: dict[str, Any] | str = outcome(lambda: shout.enqueue("hi"))
        else:
            keyed_by_django = DECLARED_BY_DJANGO
        calls = {
            "add": lambda: tasks.add.enqueue(2, 3),
            "fetch_status (async)": lambda: tasks.fetch_status.enqueue("https://example.com"),
            "bulk_enqueue": lambda: django_jobs.bulk_enqueue(
                [(tasks.send_welcome_email, [user_id], {}) for user_id in (1, 2)]
            ),
            "flaky_report (max_attempts=3)": lambda: tasks.flaky_report.enqueue(report_id=7),
            "parse_upload": lambda: tasks.parse_upload.enqueue("upload.xlsx"),
            "sync_account (concurrency_key)": lambda: [
                tasks.sync_account.enqueue(account_id=1) for _ in range(2)
            ],
            "rebuild_index (unique_key)": lambda: [
                tasks.rebuild_index.enqueue(account_id=1) for _ in range(2)
            ],
            "using(max_attempts=5)": lambda: tasks.flaky_report.using(max_attempts=5).enqueue(
                report_id=8
            ),
            "export_orders (set_progress)": lambda: tasks.export_orders.enqueue("2026-10"),
            "pick_cheapest (dependency_results)": lambda: tasks.pick_cheapest.enqueue(),
            "enqueue_batch": lambda: django_jobs.enqueue_batch(
                [(tasks.import_row, [row], {}) for row in (1, 2)], on_finish=tasks.import_done
            ),
            "workflow": lambda: run_workflow(),
            "chain": lambda: django_jobs.chain(
                (tasks.fetch_quote, ["north"], {}), tasks.pick_cheapest
            ),
            "after=": lambda: tasks.pick_cheapest.using(
                after=[tasks.fetch_quote.enqueue("north")]
            ).enqueue(),
        }
        report = {name: outcome(call) for name, call in calls.items()}
    backend = task_backends["default"]
    return {
        "backend": f"{type(backend).__module__}.{type(backend).__qualname__}",
        "calls": report,
        "keyed_by_django": keyed_by_django,
        "stored": len(getattr(backend, "results", [])),
        "warnings": [
            {"category": w.category.__name__, "message": str(w.message)} for w in [*seen, *later]
        ],
    }


def run_workflow() -> Any:
    with django_jobs.workflow("price check") as wf:
        quotes = [wf.add(tasks.fetch_quote, shop) for shop in tasks.QUOTES]
        wf.add(tasks.pick_cheapest, after=quotes)
    return wf.result


if __name__ == "__main__":
    print(json.dumps(tour()))
