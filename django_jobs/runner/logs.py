"""Visible output for ``run_jobs`` when the project has not configured our loggers."""

from __future__ import annotations

import logging
import sys

LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def configure_logging(verbosity: int) -> None:
    """Attach a stream handler to ``django_jobs`` unless the project's LOGGING already did."""
    logger = logging.getLogger("django_jobs")
    if logger.handlers or logging.getLogger().handlers:
        return
    logger.setLevel(LEVELS.get(verbosity, logging.INFO))
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.propagate = False
