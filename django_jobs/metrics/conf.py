"""The ``DJANGO_JOBS_METRICS`` settings dict: who may scrape, and how many keys to list.

A dict of its own rather than keys of ``DJANGO_JOBS``: the endpoint runs in web
processes and is configured with them, and the workers never read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from django_jobs.conf import did_you_mean

SETTINGS_NAME = "DJANGO_JOBS_METRICS"


@dataclass(frozen=True)
class MetricsSettings:
    """What the metrics endpoint reads; see docs/metrics.md."""

    # Tokens a scraper may send as ``Authorization: Bearer <token>``; empty: none accepted.
    bearer_tokens: tuple[str, ...] = ()
    # Whether a logged-in, active staff user with ``view_job`` (or ``change_job``) may look.
    allow_staff: bool = True
    # Concurrency keys listed one by one (those with the most blocked jobs).
    top_keys: int = 20
    # Groups of each fair queue listed one by one (those with the most ready jobs).
    top_fair_keys: int = 10

    @classmethod
    def load(cls) -> MetricsSettings:
        """The settings, validated: a mistake here would open or break the endpoint."""
        raw = getattr(settings, SETTINGS_NAME, None) or {}
        if not isinstance(raw, Mapping):
            raise ImproperlyConfigured(f"{SETTINGS_NAME} must be a dict, not {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        for name in raw:
            if name not in known:
                hint = did_you_mean(name, known)
                raise ImproperlyConfigured(
                    f"{SETTINGS_NAME} has an unknown key {name!r}. {hint}".strip()
                )
        values: dict[str, Any] = dict(raw)
        tokens = values.get("bearer_tokens", ())
        if not isinstance(tokens, list | tuple) or not all(
            isinstance(t, str) and t for t in tokens
        ):
            # An empty token would let "Authorization: Bearer " in.
            raise ImproperlyConfigured(
                f'{SETTINGS_NAME}["bearer_tokens"] must be a list of non-empty strings'
            )
        values["bearer_tokens"] = tuple(tokens)
        if not isinstance(values.get("allow_staff", True), bool):
            raise ImproperlyConfigured(f'{SETTINGS_NAME}["allow_staff"] must be True or False')
        for name in ("top_keys", "top_fair_keys"):
            top = values.get(name, getattr(cls, name))
            if not isinstance(top, int) or isinstance(top, bool) or top < 0:
                raise ImproperlyConfigured(f'{SETTINGS_NAME}["{name}"] must be an integer >= 0')
        return cls(**values)
