from django.apps import AppConfig


class DjangoJobsConfig(AppConfig):
    name = "django_jobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # What the state machine runs after a commit in modules above it (a workflow's
        # follow-ups: core/dependencies.py FollowUps).
        from django_jobs.core.workflows import install_follow_ups

        install_follow_ups()
        # Our tasks under Django's own backends (test settings): know when one runs.
        from django_jobs.tasks.other_backends import connect

        connect()
