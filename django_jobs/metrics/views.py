"""The metrics endpoint: the collector's output, for a bearer token or an admin login only.

Not public by default: queue names, concurrency keys (which often hold account ids) and
host names are for the operators. Prometheus sends a token from
``DJANGO_JOBS_METRICS["bearer_tokens"]`` in its ``Authorization`` header; a person logged
in to the admin with ``view_job`` (or ``change_job``) may open the page in a browser.
"""

from __future__ import annotations

import hmac

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from django_jobs.metrics.collector import JobsCollector
from django_jobs.metrics.conf import MetricsSettings
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.metrics")

VIEW = "django_jobs.view_job"
CHANGE = "django_jobs.change_job"


def bearer_token(request: HttpRequest) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, None without one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def may_scrape(request: HttpRequest, conf: MetricsSettings) -> bool:
    """A listed bearer token, or (if allowed) an active staff user who may view jobs.

    A request that sends a bearer token is judged by it alone; tokens are compared in
    constant time, so a wrong guess says nothing about how close it came.
    """
    token = bearer_token(request)
    if token is not None:
        given = token.encode()
        # Every token compared (no early exit): the time does not tell which matched.
        matches = [hmac.compare_digest(given, known.encode()) for known in conf.bearer_tokens]
        return bool(token) and any(matches)
    user = getattr(request, "user", None)  # None without AuthenticationMiddleware
    return bool(
        conf.allow_staff
        and user is not None
        and user.is_active
        and user.is_staff
        and (user.has_perm(VIEW) or user.has_perm(CHANGE))
    )


def refused(request: HttpRequest) -> HttpResponse:
    """401 asking for a token, or 403 for a logged-in user without the permission."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and bearer_token(request) is None:
        return HttpResponse("Forbidden\n", status=403, content_type="text/plain")
    response = HttpResponse("Unauthorized\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="django-jobs metrics"'
    return response


@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """Every jobs metric in Prometheus' text format (OpenMetrics if the scraper asks)."""
    conf = MetricsSettings.load()
    if not may_scrape(request, conf):
        return refused(request)
    # A registry per request with only our collector: nothing process-local is exposed,
    # and auto_describe=False keeps register() from collecting (querying) a second time.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobsCollector(top_keys=conf.top_keys, top_fair_keys=conf.top_fair_keys))
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    try:
        body = encoder(registry)
    except DatabaseError:
        # The scrape fails (Prometheus sets up=0) with a reason in the log, not a 500 page.
        logger.exception("metrics: the jobs database could not be read")
        return HttpResponse(
            "the jobs database could not be read\n", status=503, content_type="text/plain"
        )
    return HttpResponse(body, content_type=content_type)
