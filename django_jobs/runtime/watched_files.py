"""What ``run_jobs --reload`` watches: the project's Python files, polled for changes.

The reloader cannot go by its own ``sys.modules`` as runserver's does: the task
modules are imported by the workers, lazily, when a job of theirs is claimed
(``tasks/loading.py``), so the process that watches has never imported them. It
watches instead every ``*.py`` file under the project's directories (the
settings' ``BASE_DIR``, each ``sys.path`` entry and each loaded top-level
package outside the interpreter's own prefix and site-packages), plus the file
of each module it has loaded itself (settings, models, URLconf, and the
installed libraries, as runserver does).

Walking the project skips what is not the project's code: hidden directories
(``.venv``, ``.git``, ``.tox``), any directory holding a ``pyvenv.cfg`` (a
virtualenv of any name), ``__pycache__``, ``node_modules`` and site-packages.

Changes are found by polling each file's modification time, size and inode, as
Django's ``StatReloader`` does, rather than with inotify: see docs/running.md,
"Reloading in development", for why.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from django.conf import settings
from django.utils.autoreload import iter_all_python_module_files

from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.reloader")

SKIPPED_DIRECTORIES = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})

# What tells a file changed: its modification time (ns), size and inode (an editor
# that saves by renaming a new file over the old one changes the inode).
Stamp = tuple[int, int, int]


def interpreter_directories() -> list[Path]:
    """The interpreter's own trees: the virtualenv, the base installation."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return [Path(prefix).resolve() for prefix in prefixes if prefix]


def is_within(path: Path, directories: Iterable[Path]) -> bool:
    return any(path == directory or directory in path.parents for directory in directories)


def project_roots() -> list[Path]:
    """The directories whose ``*.py`` files are the project's code (see the module docstring).

    The filesystem root and the home directory are never walked whole: ``python -m
    django`` run from either puts it on ``sys.path``, and walking it would mean
    polling every file the user has.
    """
    candidates: list[Path] = []
    base_dir = getattr(settings, "BASE_DIR", None)
    if base_dir:
        candidates.append(Path(base_dir))
    candidates += [Path(entry or os.curdir) for entry in sys.path]
    candidates += loaded_package_directories()
    interpreter = interpreter_directories()
    too_wide = {Path("/"), Path.home().resolve()}
    roots: list[Path] = []
    for candidate in candidates:
        try:
            path = candidate.resolve()
        except (OSError, RuntimeError):
            continue
        if not path.is_dir() or is_within(path, interpreter):
            continue
        if SKIPPED_DIRECTORIES.intersection(path.parts) or is_virtualenv(path):
            continue
        if path in too_wide:
            logger.warning("--reload does not watch %s as a whole: it is too wide", path)
            continue
        if path not in roots:
            roots.append(path)
    # A root inside another is walked with it.
    return [root for root in roots if not is_within(root.parent, roots)]


def loaded_package_directories() -> list[Path]:
    """The directory of each top-level package loaded here: where ``sys.path`` does not name
    it (an editable install through an import hook), its other modules are the project's too."""
    directories = []
    for name, module in list(sys.modules.items()):
        if "." not in name:
            directories += [Path(entry) for entry in getattr(module, "__path__", None) or []]
    return directories


def is_virtualenv(directory: Path) -> bool:
    return (directory / "pyvenv.cfg").is_file()


def project_files(roots: Iterable[Path]) -> Iterator[Path]:
    """Every ``*.py`` file under ``roots``, pruning what is not the project's code."""
    interpreter = interpreter_directories()
    for root in roots:
        for directory, subdirectories, files in os.walk(root):
            here = Path(directory)
            subdirectories[:] = [
                name
                for name in subdirectories
                if not name.startswith(".")
                and name not in SKIPPED_DIRECTORIES
                and not is_virtualenv(here / name)
                and not is_within(here / name, interpreter)
            ]
            for name in files:
                if name.endswith(".py"):
                    yield here / name


def watched_files(roots: Iterable[Path]) -> set[Path]:
    """The project's Python files and the files of the modules this process has loaded."""
    return set(project_files(roots)) | set(iter_all_python_module_files())


def snapshot(paths: Iterable[Path]) -> dict[Path, Stamp]:
    """Each existing file's stamp; a file that cannot be read is left out (as if deleted)."""
    stamps: dict[Path, Stamp] = {}
    for path in paths:
        try:
            status = path.stat()
        except OSError:
            continue
        stamps[path] = (status.st_mtime_ns, status.st_size, status.st_ino)
    return stamps


def changed_files(before: dict[Path, Stamp], after: dict[Path, Stamp]) -> set[Path]:
    """Files edited or deleted between two snapshots.

    A new file is not a change: no process has imported it yet, so a worker that
    needs it imports it as it is. Once it is in a snapshot, its edits count.
    """
    return {path for path, stamp in before.items() if after.get(path) != stamp}


class Watcher:
    """Polls the watched files; ``poll()`` returns what changed since the previous poll."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self.stamps = self.scan()

    def scan(self) -> dict[Path, Stamp]:
        return snapshot(watched_files(self.roots))

    def poll(self) -> set[Path]:
        stamps = self.scan()
        changed = changed_files(self.stamps, stamps)
        self.stamps = stamps
        return changed
