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
(``.venv``, ``.git``, ``.tox``, ``.nox``, the tools' ``.*_cache``), any directory
holding a ``pyvenv.cfg`` (a virtualenv of any name), ``__pycache__``,
``node_modules``, installed libraries (``site-packages``, ``__pypackages__``),
packaging's output (``*.egg-info``, and ``build``/``dist`` unless they are a
package: an app may be named so) and the settings' ``STATIC_ROOT`` and
``MEDIA_ROOT`` (collected and uploaded files, which can be many). Each is
walked again at every poll, for nothing.

Changes are found by polling each file's modification time, size and inode, as
Django's ``StatReloader`` does, rather than with inotify: see docs/running.md,
"Reloading in development", for why.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path

from django.conf import settings
from django.utils.autoreload import iter_all_python_module_files

from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.reloader")

# Never the project's code, whatever holds them (a root inside one is not walked either).
SKIPPED_DIRECTORIES = frozenset(
    {"__pycache__", "node_modules", "site-packages", "dist-packages", "__pypackages__"}
)
# Packaging's output: skipped when walking, unless a package of that name (``__init__.py``).
BUILD_DIRECTORIES = frozenset({"build", "dist"})
# What pytest and unittest collect: a syntax error there holds no job back.
TEST_MODULES = ("test_*.py", "*_test.py", "*_tests.py", "tests.py", "conftest.py")

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
    collected = collected_directories()
    for root in roots:
        for directory, subdirectories, files in os.walk(root):
            here = Path(directory)
            subdirectories[:] = [
                name
                for name in subdirectories
                if not is_skipped(here / name, interpreter, collected)
            ]
            for name in files:
                if name.endswith(".py"):
                    yield here / name


def is_skipped(directory: Path, interpreter: list[Path], collected: list[Path]) -> bool:
    """A directory below a root that holds no code of the project (module docstring)."""
    name = directory.name
    return (
        name.startswith(".")
        or name in SKIPPED_DIRECTORIES
        or name.endswith(".egg-info")
        or (name in BUILD_DIRECTORIES and not (directory / "__init__.py").is_file())
        or directory in collected
        or is_virtualenv(directory)
        or is_within(directory, interpreter)
    )


def collected_directories() -> list[Path]:
    """``STATIC_ROOT`` and ``MEDIA_ROOT``: files Django serves or stores, never imports."""
    directories = []
    for name in ("STATIC_ROOT", "MEDIA_ROOT"):
        value = getattr(settings, name, None)
        if value:
            try:
                directories.append(Path(value).resolve())
            except (OSError, RuntimeError):
                continue
    return directories


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


class ImportedCode:
    """The code ``run_jobs`` imports, whose syntax errors hold a reload back: the modules
    this process loaded at start (settings, apps, models, URLconf: the same as the
    reloaded command's), and every other module of the packages they belong to, for a
    worker imports an app's ``tasks.py`` when a job of it runs. Test modules (by pytest's
    and unittest's names, or under a ``tests`` directory of the package) are not: nothing
    run_jobs runs imports them.

    Not every file a worker could import: a namespace package makes any ``*.py`` under
    a ``sys.path`` directory importable, scripts and tests included.
    """

    def __init__(self) -> None:
        self.files = set(iter_all_python_module_files())
        directories = loaded_packages()
        # The outermost package of each tree: its subpackages are inside it.
        self.packages = sorted(
            directory
            for directory in directories
            if not any(parent in directories for parent in directory.parents)
        )

    def __contains__(self, path: Path) -> bool:
        if path in self.files:
            return True
        if any(fnmatchcase(path.name, pattern) for pattern in TEST_MODULES):
            return False
        for package in self.packages:
            if is_within(path.parent, [package]):
                return "tests" not in path.parent.relative_to(package).parts
        return False


def loaded_packages() -> set[Path]:
    """The directories of every package loaded here (a namespace package's several)."""
    directories: set[Path] = set()
    for module in list(sys.modules.values()):
        try:
            entries = [str(entry) for entry in getattr(module, "__path__", None) or []]
        except Exception:  # a lazy or proxy module: it is no package of the project
            continue
        for entry in entries:
            try:
                directories.add(Path(entry).resolve())
            except (OSError, RuntimeError, ValueError):
                continue
    return directories
