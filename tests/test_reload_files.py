"""What ``run_jobs --reload`` watches and what it calls a change, on real directories."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

from django_jobs.runtime.reloader import (
    describe,
    forget_bytecode,
    process_parents,
    process_tree,
    syntax_errors,
)
from django_jobs.runtime.watched_files import (
    ImportedCode,
    Watcher,
    changed_files,
    project_files,
    project_roots,
    snapshot,
)


def make_project(root: Path) -> None:
    """A project as found on disk: code, and beside it what is not the project's code."""
    for relative in [
        "manage.py",
        "shop/tasks.py",
        "shop/sub/models.py",
        ".venv/lib/python3.12/site-packages/lib.py",
        "env/lib/python3.12/site-packages/lib.py",
        "frontend/node_modules/pkg/build.py",
        "shop/__pycache__/tasks.py",
        ".git/hooks/hook.py",
        "shop/notes.txt",
        "build/lib/shop/tasks.py",
        "dist/setup_helper.py",
        "django_shop.egg-info/hooks.py",
        ".mypy_cache/3.12/stub.py",
        ".nox/lint/tool.py",
        "__pypackages__/3.12/lib/lib.py",
        "collected/admin/jsi18n.py",
        "uploads/user/report.py",
        "shop/build/__init__.py",
        "shop/build/steps.py",
    ]:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n")
    (root / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")  # a virtualenv, any name


def test_project_files_are_the_project_code_without_virtualenvs_caches_or_build_output(
    tmp_path, settings
):
    """``build``/``dist`` are skipped unless a package of that name (an app may be);
    ``STATIC_ROOT`` and ``MEDIA_ROOT`` are skipped, whatever their name."""
    make_project(tmp_path)
    settings.STATIC_ROOT = str(tmp_path / "collected")
    settings.MEDIA_ROOT = tmp_path / "uploads"
    found = {path.relative_to(tmp_path).as_posix() for path in project_files([tmp_path])}
    assert found == {
        "manage.py",
        "shop/tasks.py",
        "shop/sub/models.py",
        "shop/build/__init__.py",
        "shop/build/steps.py",
    }


def test_project_roots_are_base_dir_and_sys_path_outside_the_interpreter(
    tmp_path, settings, monkeypatch, caplog
):
    project, pythonpath = tmp_path / "project", tmp_path / "extra"
    make_project(project)
    pythonpath.mkdir()
    settings.BASE_DIR = project / "shop"  # inside a sys.path root: walked with it
    site_packages = next(Path(p) for p in sys.path if p.endswith("site-packages"))
    monkeypatch.setattr(
        sys,
        "path",
        [str(project), str(site_packages), str(project / "env"), str(pythonpath), str(Path.home())],
    )
    with caplog.at_level(logging.WARNING, "django_jobs.reloader"):
        roots = project_roots()
    assert roots[:2] == [project, pythonpath]
    for outside in (site_packages, project / "env", project / "shop", Path.home()):
        assert not any(root == outside.resolve() for root in roots), (outside, roots)
    assert f"--reload does not watch {Path.home().resolve()} as a whole" in caplog.text


def test_a_loaded_package_that_sys_path_does_not_name_is_a_root(tmp_path, monkeypatch):
    """As an editable install through an import hook is: its other modules are watched."""
    package = tmp_path / "hooked_pkg_for_reload"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(package.name)
    try:
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
        assert package in project_roots()
    finally:
        sys.modules.pop(package.name)


def test_an_edit_or_a_deletion_is_a_change_a_new_file_is_not(tmp_path):
    edited, deleted, kept = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    for path in (edited, deleted, kept):
        path.write_text("x = 1\n")
    watcher = Watcher([tmp_path])
    assert watcher.poll() == set()

    edited.write_text("x = 2\n")
    deleted.unlink()
    (tmp_path / "new.py").write_text("x = 1\n")
    assert watcher.poll() == {edited, deleted}
    assert watcher.poll() == set()


def test_a_same_size_rewrite_by_rename_is_a_change(tmp_path):
    """An editor that saves by renaming a new file over the old: same size, maybe the same
    timestamp tick, but another inode."""
    path = tmp_path / "a.py"
    path.write_text("x = 1\n")
    before = snapshot([path])
    replacement = tmp_path / "a.py.tmp"
    replacement.write_text("x = 2\n")
    replacement.replace(path)
    assert changed_files(before, snapshot([path])) == {path}


def test_syntax_errors_name_the_file_and_line(tmp_path):
    good, bad, gone = tmp_path / "good.py", tmp_path / "bad.py", tmp_path / "gone.py"
    good.write_text("x = 1\n")
    bad.write_text("x = 1\nif x\n    pass\n")
    assert syntax_errors([good, bad, gone, tmp_path / "lib.so"]) == {
        bad: f"{bad}, line 2: SyntaxError: expected ':'"
    }


def test_describe_names_a_few_files():
    paths = {Path(f"/p/{name}.py") for name in "abcde"}
    assert describe(paths) == "/p/a.py, /p/b.py, /p/c.py and 2 more"


def test_imported_code_is_what_run_jobs_loads_at_start_and_their_packages(tmp_path, monkeypatch):
    """Whose syntax errors hold a reload back: the modules loaded at start, and the other
    modules of their packages (an app's tasks.py), test modules aside. Not a script beside
    them, nor a package nothing loaded."""
    suffix = uuid.uuid4().hex[:8]
    app, other, top = f"shop_{suffix}", f"unloaded_{suffix}", f"loaded_{suffix}"
    files = [
        f"{app}/__init__.py",
        f"{app}/tasks.py",
        f"{app}/sub/deep.py",
        f"{app}/tests.py",
        f"{app}/test_views.py",
        f"{app}/conftest.py",
        f"{app}/tests/factories.py",
        f"{other}/__init__.py",
        f"{other}/tasks.py",
        f"{top}.py",
        f"test_{top}.py",
        "scratch.py",
    ]
    for relative in files:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = [app, top, f"test_{top}"]
    for name in loaded:
        importlib.import_module(name)
    try:
        imported = ImportedCode()
    finally:
        for name in loaded:
            sys.modules.pop(name)
    held = {path for path in files if tmp_path / path in imported}
    assert held == {
        f"{app}/__init__.py",
        f"{app}/tasks.py",
        f"{app}/sub/deep.py",
        f"{top}.py",
        f"test_{top}.py",  # a test module, but loaded at start: run_jobs imports it
    }


def test_the_process_tree_is_read_from_proc_or_from_ps_where_there_is_none(tmp_path):
    """``ps`` stands in for ``/proc`` on macOS and the BSDs; both give this very tree."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from_proc = process_parents()
        from_ps = process_parents(tmp_path / "no-proc")
        for parents in (from_proc, from_ps):
            assert parents[os.getpid()] == os.getppid()
            assert parents[child.pid] == os.getpid()
        assert child.pid in process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()


def import_answer(directory: Path, name: str) -> str:
    """``ANSWER`` of module ``name``, as a fresh interpreter (the restarted run_jobs) sees it."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {name}; print({name}.ANSWER)"],
        cwd=directory,
        # Bytecode written and read, as under tox (a developer's shell may turn it off).
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
            "PYTHONPATH": str(directory),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_same_size_save_within_the_second_of_the_import_runs_the_new_code(tmp_path):
    """Python trusts a .pyc whose recorded source size and mtime (whole seconds) match: a
    one-character fix saved within the second of the last import would otherwise be
    restarted into the old code (CI saw a reload test run v1 after its edit to v2)."""
    name = f"same_size_{uuid.uuid4().hex[:8]}"
    source = tmp_path / f"{name}.py"
    source.write_text('ANSWER = "v1"\n')
    stamp = source.stat().st_mtime_ns
    assert import_answer(tmp_path, name) == "v1"  # writes __pycache__/<name>.pyc
    source.write_text('ANSWER = "v2"\n')
    os.utime(source, ns=(stamp, stamp))  # the same second, as a quick save is
    assert import_answer(tmp_path, name) == "v1", "the cached bytecode is trusted"
    forget_bytecode({source, tmp_path / "notes.txt"})
    assert import_answer(tmp_path, name) == "v2"
