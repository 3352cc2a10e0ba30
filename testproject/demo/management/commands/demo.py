"""``manage.py demo``: migrate, enqueue example jobs, then run the worker until Ctrl-C."""

from datetime import timedelta

from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.utils import timezone

from django_jobs import bulk_enqueue, enqueue_batch
from testproject.demo import tasks


class Command(BaseCommand):
    help = "Set up the demo database, enqueue example jobs and run them (Ctrl-C stops)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Exit when the queues are empty.")

    def handle(self, *args, **options):
        call_command("migrate", verbosity=0)
        results = [
            tasks.add.enqueue(2, 3),
            tasks.flaky_report.enqueue(report_id=7),
            tasks.fetch_status.enqueue("https://example.com"),
            tasks.add.using(run_after=timezone.now() + timedelta(seconds=2)).enqueue(40, 2),
        ]
        results += bulk_enqueue(
            [(tasks.send_welcome_email, [user_id], {}) for user_id in range(1, 6)]
        )
        results += [tasks.sync_account.enqueue(account_id=1) for _ in range(3)]
        # Unique: the second call returns the first call's job.
        results += [tasks.rebuild_index.enqueue(account_id=1)]
        duplicate = tasks.rebuild_index.enqueue(account_id=1)
        batch = enqueue_batch(
            [(tasks.import_row, [row], {}) for row in range(4)],
            on_finish=tasks.import_done,
            description="demo import",
        )
        results += batch.results
        self.stdout.write(
            f"rebuild_index enqueued twice: one job (#{duplicate.id}); "
            f"batch #{batch.id} with {len(batch.results)} rows and an on_finish callback"
        )
        self.stdout.write(
            self.style.SUCCESS(
                f"Enqueued {len(results)} demo jobs; starting run_jobs (Ctrl-C stops)."
            )
        )
        call_command("run_jobs", single_process=True, once=options["once"], verbosity=1)
        self.stdout.write("Results:")
        callback_id = batch.refresh().callback_jobs.get("on_finish")
        if callback_id:
            results.append(tasks.import_done.get_result(str(callback_id)))
        for result in results:
            result.refresh()
            value = result.return_value if result.status == "SUCCESSFUL" else ""
            self.stdout.write(
                f"  #{result.id} {result.task.name}: {result.status} "
                f"attempts={result.attempts} {value}"
            )
        self.stdout.write(
            "See them in the admin: testproject/manage.py createsuperuser, then "
            "testproject/manage.py runserver and open http://127.0.0.1:8000/admin/django_jobs/"
        )
