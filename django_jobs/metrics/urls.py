"""``path("jobs/metrics", include("django_jobs.metrics.urls"))`` mounts the endpoint.

Importing this module (Django does at startup and in ``manage.py check``) fails with
``ImproperlyConfigured`` when ``prometheus_client`` is missing or ``DJANGO_JOBS_METRICS``
is wrong, rather than at the first scrape.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.urls import path

try:
    from django_jobs.metrics import views
except ImportError as exc:
    if not (exc.name or "").startswith("prometheus_client"):
        raise
    raise ImproperlyConfigured(
        "django_jobs.metrics needs prometheus_client: pip install 'django-db-jobs[prometheus]'"
    ) from exc

from django_jobs.metrics.conf import MetricsSettings

MetricsSettings.load()

app_name = "django_jobs_metrics"
urlpatterns = [path("", views.metrics, name="metrics")]
