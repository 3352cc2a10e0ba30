"""Check what users install: build the sdist and wheel, inspect them, and run the admin from
the wheel installed (not editable) in a fresh venv. ``tox -e package`` runs it.

Why: the test suite installs the checkout editable, so templates, CSS or migrations missing
from the distributions went unnoticed while every admin page of a real install answered 500.

Steps, each failing with a message saying what is wrong:

1. copy the checkout's files (tracked and new, not ignored) to a temporary directory and
   build there, so the shared checkout gets no ``build/`` or ``*.egg-info``;
2. ``python -m build`` (sdist, then the wheel from the sdist, as a release would) and
   ``twine check --strict``;
3. every file of ``django_jobs/`` in the checkout (templates, static, migrations,
   ``py.typed``) must be in the wheel and in the sdist, and the LICENSE in both;
4. a fresh venv gets the wheel; ``.ci/wheel_site/drive.py`` runs there from a temporary
   directory (so only the wheel's ``django_jobs`` can be imported) and fetches every admin
   page as a superuser on SQLite.

uv (a dependency of the tox env) builds and installs when it is importable: a few seconds
instead of pip's twenty or so; pip otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Copied when git cannot list the files: everything but these.
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", ".tox", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", "artifacts",
    "*.sqlite3", "*.sqlite3-*", ".pytest_cache", ".ruff_cache",
)  # fmt: skip


def run(*command: str | Path, **kwargs) -> None:
    """Run a step; its failure ends the check with the step's own output above."""
    print("$", " ".join(str(c) for c in command), flush=True)
    if subprocess.run([str(c) for c in command], **kwargs).returncode:
        sys.exit(f"package check failed at: {' '.join(str(c) for c in command)}")


def uv_binary() -> str | None:
    try:
        import uv
    except ImportError:
        return None
    return uv.find_uv_bin()


def project_files() -> list[str]:
    """The checkout's files as a clone would have them, plus new files not yet committed."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(name for name in listed.split("\0") if name and (ROOT / name).is_file())


def copy_checkout(target: Path) -> list[str]:
    files = project_files()
    if not files:
        shutil.copytree(ROOT, target, ignore=IGNORED)
        return sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    return files


def check_contents(dist: Path, files: list[str], name: str, version: str) -> Path:
    """Every package file in both archives; the wheel holds django_jobs and nothing else."""
    stem = f"{name.replace('-', '_')}-{version}"
    wheel = dist / f"{stem}-py3-none-any.whl"
    sdist = dist / f"{stem}.tar.gz"
    for archive in (wheel, sdist):
        if not archive.is_file():
            built = sorted(p.name for p in dist.iterdir())
            sys.exit(f"{archive.name} was not built; built: {built}")
    package = [f for f in files if f.startswith("django_jobs/")]
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    with tarfile.open(sdist) as tf:
        in_sdist = {n.removeprefix(f"{stem}/") for n in tf.getnames()}
    problems = []
    for label, names, wanted in (
        ("wheel", in_wheel, [*package, f"{stem}.dist-info/licenses/LICENSE"]),
        ("sdist", in_sdist, [*package, "LICENSE", "pyproject.toml", "README.md"]),
    ):
        missing = [f for f in wanted if f not in names]
        if missing:
            problems.append(f"{label} lacks {len(missing)} file(s): {', '.join(missing)}")
    strays = sorted(n for n in in_wheel if not n.startswith(("django_jobs/", f"{stem}.dist-info/")))
    if strays:
        problems.append(f"wheel holds files outside django_jobs: {', '.join(strays)}")
    for required in ("templates/", "static/", "migrations/0001_initial.py", "py.typed"):
        if not any(f.startswith(f"django_jobs/{required}") for f in package):
            problems.append(f"the checkout has no django_jobs/{required}: wrong directory?")
    if problems:
        sys.exit("\n".join(problems))
    kinds = {
        kind: sum(f.startswith(f"django_jobs/{kind}/") for f in package)
        for kind in ("templates", "static", "migrations")
    }
    print(f"wheel and sdist hold all {len(package)} package files ({kinds}) and the LICENSE")
    return wheel


def main() -> None:
    started = time.monotonic()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    uv = uv_binary()
    with tempfile.TemporaryDirectory(prefix="jobs-package-") as tmp:
        tmp = Path(tmp)
        src, dist, venv, site = tmp / "src", tmp / "dist", tmp / "venv", tmp / "site"
        files = copy_checkout(src)

        installer = ("--installer", "uv") if uv else ()
        run(sys.executable, "-m", "build", "--quiet", *installer, "--outdir", dist, src)
        run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
        wheel = check_contents(dist, files, name, version)

        if uv:
            run(uv, "venv", "--quiet", "--python", sys.executable, venv)
            run(uv, "pip", "install", "--quiet", "--python", venv / "bin" / "python", wheel)
        else:
            run(sys.executable, "-m", "venv", venv)
            run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel)

        shutil.copytree(ROOT / ".ci" / "wheel_site", site / "wheel_site", ignore=IGNORED)
        clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DJANGO"))}
        clean_env |= {"CHECKOUT_DIR": str(ROOT), "WHEEL_SITE_DIR": str(site)}
        run(venv / "bin" / "python", "-m", "wheel_site.drive", cwd=site, env=clean_env)
    print(f"package check passed in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
