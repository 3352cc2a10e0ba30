#!/usr/bin/env python3
"""The test project's manage.py; runnable from anywhere in a checkout.

Run directly (``testproject/manage.py runserver``, as the demo suggests), ``python3`` may be
older than 3.12 or lack Django; then this re-runs itself, once, with the checkout's ``.venv``
(the one the README's commands make).
"""

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def main() -> None:
    try:
        if sys.version_info < (3, 12):  # noqa: UP036 (python3 may well be older)
            raise ImportError(f"Django 6 needs Python >= 3.12, not {sys.version.split()[0]}")
        import django  # noqa: F401
    except ImportError:
        venv_python = CHECKOUT / ".venv" / "bin" / "python"
        if venv_python.exists() and not os.environ.get("JOBS_MANAGE_REEXEC"):
            os.environ["JOBS_MANAGE_REEXEC"] = "1"
            os.execv(venv_python, [str(venv_python), __file__, *sys.argv[1:]])
        raise
    sys.path.insert(0, str(CHECKOUT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
