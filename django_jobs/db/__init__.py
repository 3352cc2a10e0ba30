"""What each database does differently, behind one seam: ``features(db)`` says which path a
database can take, ``ops(db)`` runs a database operation. This is the only place that reads a
connection's vendor; the core asks the seam (docs/contributing.md, "Adding a database
operation")."""

from __future__ import annotations

from functools import cache
from importlib import import_module
from types import ModuleType

from django.db import connections

from django_jobs.db import base

# Django's vendor names -> our module for it; any other backend gets the portable one.
VENDOR_MODULES = {
    "postgresql": "django_jobs.db.postgresql",
    "mysql": "django_jobs.db.mysql",
    "sqlite": "django_jobs.db.sqlite",
}


def features(db: str) -> base.Features:
    """What the database of alias ``db`` can do."""
    return _features(connections[db].vendor)


def ops(db: str) -> base.Operations:
    """The operations of the database of alias ``db``."""
    return _ops(connections[db].vendor)


def vendor_module(vendor: str) -> ModuleType | None:
    name = VENDOR_MODULES.get(vendor)
    return None if name is None else import_module(name)


@cache
def _features(vendor: str) -> base.Features:
    module = vendor_module(vendor)
    return base.Features() if module is None else module.Features()


@cache
def _ops(vendor: str) -> base.Operations:
    module = vendor_module(vendor)
    return base.Operations() if module is None else module.Operations()
