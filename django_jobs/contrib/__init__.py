"""Integrations with other tools, each imported only by a project that uses it (each needs an
optional extra: ``django_jobs.contrib.sentry`` the ``sentry`` one)."""
