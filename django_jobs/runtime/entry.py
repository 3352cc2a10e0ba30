"""Entry point of a spawned child: imports nothing of Django's models before setup().

``multiprocessing`` spawn unpickles the target by importing its module in a
fresh interpreter, before any code of ours runs; a module importing models at
its top would fail there with AppRegistryNotReady.
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
    import django

    django.setup()
    from django_jobs.runtime.child import run_child

    run_child(kind, overrides, supervisor_id, verbosity, wake)
