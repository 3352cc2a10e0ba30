"""Drive the jobs admin of an installed wheel: every page must answer 200 for a superuser.

Run by .ci/package_check.py as ``python -m wheel_site.drive`` in a fresh venv, from a
temporary directory. The checkout is nowhere on ``sys.path``, so a template, static file or
migration left out of the wheel fails here, as it would in a user's project.

The pages are found from the admin's own URL patterns: a page added to ``django_jobs/admin``
without being fetched here fails the check until it is listed below (as a page, or as an
action that takes POST only).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import sysconfig
from datetime import timedelta
from pathlib import Path

# Views that change something: POST only, so not pages to fetch.
ACTIONS = {
    "django_jobs_job_retry",
    "django_jobs_job_discard",
    "django_jobs_job_cancel",
    "django_jobs_dashboard_pause",
    "django_jobs_dashboard_resume",
    "django_jobs_blockedkey_reconcile",
    "django_jobs_recurringtask_run_now",
    "django_jobs_recurringtask_enable",
    "django_jobs_recurringtask_disable",
    "django_jobs_workflow_cancel",
    "django_jobs_workflow_retry",
}


def assert_installed_copy() -> None:
    """The django_jobs imported must be the wheel's, in this venv's site-packages."""
    import django_jobs

    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    module = Path(django_jobs.__file__).resolve()
    if not module.is_relative_to(site_packages):
        sys.exit(f"django_jobs imported from {module}, not from {site_packages}")
    checkout = os.environ.get("CHECKOUT_DIR")
    if checkout and module.is_relative_to(Path(checkout).resolve()):
        sys.exit(f"django_jobs imported from the checkout: {module}")
    print(f"django_jobs from {module.parent}")


def make_jobs() -> None:
    """Jobs in every state the pages show: succeeded, failed, ready, blocked, scheduled,
    running on a dead process (stuck), a finished batch with its callback, a pending one,
    a recurring task that has run, and a workflow with a job that waits for another."""
    from django.core.management import call_command
    from django.utils import timezone

    from django_jobs import enqueue_batch, workflow
    from django_jobs.core import recurring
    from django_jobs.models import ClaimedExecution, Job, JobStatus, Process
    from wheel_site import tasks

    tasks.ping.enqueue(1)
    tasks.fail.enqueue("boom")
    enqueue_batch(
        [(tasks.ping, [i], {}) for i in range(3)],
        on_finish=tasks.batch_done,
        description="finished batch",
    )
    recurring.run_now("default", "hourly-ping")
    call_command("run_jobs", "--once", verbosity=0)

    tasks.sync_account.enqueue(account_id=1)
    tasks.sync_account.enqueue(account_id=1)  # same key, limit 1: blocked
    tasks.ping.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(2)
    enqueue_batch([(tasks.ping, [5], {})], description="pending batch")
    with workflow("wheel workflow") as wf:
        first = wf.add(tasks.ping, 6)
        wf.add(tasks.ping, 7, after=[first])

    now = timezone.now()
    Process.objects.create(
        kind=Process.Kind.SUPERVISOR,
        name="wheel-check-live",
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )
    dead = Process.objects.create(
        kind=Process.Kind.WORKER,
        name="wheel-check-dead",
        hostname="gone",
        pid=1,
        last_heartbeat_at=now - timedelta(days=1),
    )
    running = Job.objects.create(
        task_path="wheel_site.tasks.ping",
        args=[3],
        kwargs={},
        status=JobStatus.RUNNING,
        attempts=1,
        worker_ids=[dead.name],
        started_at=now - timedelta(days=1),
    )
    ClaimedExecution.objects.create(job=running, process=dead)

    statuses = set(Job.objects.values_list("status", flat=True))
    wanted = {"succeeded", "failed", "ready", "blocked", "scheduled", "running", "awaiting"}
    if not wanted <= statuses:
        sys.exit(f"the jobs made do not cover {sorted(wanted - statuses)}: {sorted(statuses)}")


def pages() -> list[tuple[str, int]]:
    """(URL, expected status) of every page, with an id for each row's page."""
    from django.urls import reverse

    from django_jobs.models import Batch, Job, JobStatus, Process, Workflow

    def admin_url(name: str, *args: object) -> str:
        return reverse(f"admin:django_jobs_{name}", args=args)

    urls = [
        reverse("admin:index"),
        reverse("admin:app_list", args=["django_jobs"]),
        *(
            admin_url(f"{model}_changelist")
            for model in (
                "dashboard",
                "job",
                "blockedkey",
                "ratelimitedkey",
                "stuckjob",
                "recurringtask",
            )
        ),
        *(admin_url(f"{model}_changelist") for model in ("batch", "process", "workflow")),
        admin_url("job_changelist") + "?status__exact=failed",
        admin_url("job_changelist") + "?q=boom",
        admin_url("job_changelist") + f"?batch={Batch.objects.order_by('pk').first().pk}",
        admin_url("batch_changelist") + "?finished=no",
    ]
    for pk, status in Job.objects.values_list("pk", "status"):
        urls.append(admin_url("job_change", pk))
        if status == JobStatus.BLOCKED:
            urls.append(admin_url("job_run_now", pk))  # the confirmation page
    rows = (("job", Job), ("batch", Batch), ("process", Process), ("workflow", Workflow))
    for model, row in rows[1:]:
        pks = row.objects.values_list("pk", flat=True)
        urls += [admin_url(f"{model}_change", pk) for pk in pks]
    for model, pk in (
        ("job", Job.objects.first().pk),
        ("batch", Batch.objects.first().pk),
        ("process", Process.objects.first().pk),
        ("workflow", Workflow.objects.first().pk),
    ):
        urls.append(admin_url(f"{model}_history", pk))
    checked = [(url, 200) for url in urls]
    models = ("job", "batch", "process", "workflow")
    checked += [(admin_url(f"{model}_add"), 403) for model in models]
    checked += [(admin_url(f"{model}_delete", row.objects.first().pk), 403) for model, row in rows]
    return checked


def url_names() -> set[str]:
    """The names of every URL pattern the app's model admins serve."""
    from django.contrib import admin

    names = set()
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label == "django_jobs":
            names.update(p.name for p in model_admin.get_urls() if p.name)
    return names


def main() -> None:
    assert_installed_copy()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wheel_site.settings")
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import resolve

    setup_test_environment()  # ALLOWED_HOSTS for "testserver", template context capture
    call_command("migrate", verbosity=0)
    call_command("check", fail_level="WARNING")
    make_jobs()

    client = Client()
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", "pw"))
    failures, fetched, static = [], set(), set()
    for url, expected in pages():
        fetched.add(resolve(url.split("?")[0]).url_name)
        try:
            response = client.get(url)
        except Exception as exc:  # a missing template raises here: report it with the others
            failures.append(f"{url}: {type(exc).__name__}: {exc}")
            continue
        if response.status_code != expected:
            failures.append(f"{url}: {response.status_code}, expected {expected}")
        elif expected == 200:
            static.update(re.findall(r'(?:href|src)="(/static/django_jobs/[^"]+)"', response.text))
    if not static:
        failures.append("no page links the app's static files")
    for url in sorted(static):
        response = client.get(url)
        if response.status_code != 200:
            failures.append(f"{url}: {response.status_code}, expected 200")
        response.close()

    unchecked = url_names() - ACTIONS - fetched
    if unchecked:
        failures.append(
            f"admin URLs not checked (list them in .ci/wheel_site/drive.py): {sorted(unchecked)}"
        )
    if failures:
        sys.exit("admin pages of the installed wheel failed:\n  " + "\n  ".join(failures))
    print(f"{len(fetched)} admin views, {len(static)} static files: all answered as expected")


if __name__ == "__main__":
    main()
