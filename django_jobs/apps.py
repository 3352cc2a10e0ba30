from django.apps import AppConfig


class DjangoJobsConfig(AppConfig):
    name = "django_jobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks here, not from ``JobsBackend.check()``: the backend
        then needs no import of the checks, which import it (registering twice is a no-op)."""
        from django.core import checks

        from django_jobs.checks import jobs_checks

        checks.register(jobs_checks)
