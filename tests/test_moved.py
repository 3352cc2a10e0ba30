"""The module paths from before the package was laid out by layer still import, as the very
modules they became (django_jobs/moved.py), with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

import pytest

from django_jobs.moved import MOVED


def forget(name: str) -> None:
    """Drop an old path from the import cache, so that the next import finds it again."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_and_warns(old):
    new = importlib.import_module(MOVED[old])
    forget(old)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is new


def test_a_module_under_the_old_runner_package_is_the_runtimes():
    from django_jobs.runtime import worker

    forget("django_jobs.runner.worker")
    forget("django_jobs.runner")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("django_jobs.runner.worker")
    assert module is worker
    assert [str(warning.message) for warning in caught] == [
        "django_jobs.runner moved to django_jobs.runtime; import it from there.",
        "django_jobs.runner.worker moved to django_jobs.runtime.worker; import it from there.",
    ]


def test_a_name_documented_under_an_old_path_imports_from_it():
    from django_jobs.core.recurring import run_now
    from django_jobs.tasks.backoff import Exponential

    forget("django_jobs.recurring")
    forget("django_jobs.backoff")
    with pytest.warns(DeprecationWarning):
        from django_jobs.backoff import Exponential as old_exponential
        from django_jobs.recurring import run_now as old_run_now
    assert (old_run_now, old_exponential) == (run_now, Exponential)


def test_the_split_claims_module_is_gone_not_aliased():
    """core/claims.py was split by transition: no one module can stand for it."""
    forget("django_jobs.claims")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("django_jobs.claims")


def test_every_entry_names_a_module_that_exists():
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new
