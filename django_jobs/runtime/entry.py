"""Entry point of a child: imports nothing of Django's models before setup().

A child forked by the warm parent (``runtime/warm.py``) has Django set up
already. One the supervisor starts as a fresh interpreter instead (``multiprocessing``
spawn, when the warm parent is gone) unpickles the target by importing its
module before any code of ours runs; a module importing models at its top
would fail there with AppRegistryNotReady.
"""

from __future__ import annotations

from typing import Any


def child_main(
    kind: str,
    overrides: dict[str, Any],
    supervisor_id: int,
    verbosity: int,
    wake: Any = None,
) -> None:
    """``wake``: a worker's read end of the supervisor's ready-check pipe, or None."""
    from django.apps import apps

    if not apps.ready:  # a fresh interpreter, not a fork of the warm parent
        import django

        django.setup()
    from django_jobs.runtime.child import run_child

    run_child(kind, overrides, supervisor_id, verbosity, wake)
