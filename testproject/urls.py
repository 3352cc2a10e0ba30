from importlib.util import find_spec

from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls)]

# The jobs metrics (docs/metrics.md), where the "prometheus" extra is installed: the
# package check and the bench run this project without it.
if find_spec("prometheus_client") is not None:
    urlpatterns.append(path("jobs/metrics", include("django_jobs.metrics.urls")))
