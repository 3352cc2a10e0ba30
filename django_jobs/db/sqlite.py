"""SQLite: no row locks (a write transaction holds the whole database), so the portable
operations serve it as they are."""

from __future__ import annotations

from django_jobs.db import base


class Features(base.Features):
    pass


class Operations(base.Operations):
    pass
