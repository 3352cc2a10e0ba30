"""No import circle inside ``django_jobs/``, counting the imports made inside functions too.

An import moved into a function to dodge a circle still ties the two modules together: each
needs the other, and the next edit to either can turn the dodge into an ``ImportError`` at
start-up. ``db/base.py`` and ``db/job_rows.py`` imported each other that way; the shared
``column`` moved to ``db/columns.py``. The imports are read from the source (``ast``): module
level, inside functions, and the packages an import runs first (importing
``django_jobs.db.indexes`` runs ``django_jobs/db/__init__.py``). Imports under
``TYPE_CHECKING`` never run and are left out, as are imports by a computed name
(``django_jobs/__init__.py``'s lazy public names, ``moved.py``'s finder), which ``ast`` cannot
read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import django_jobs

PACKAGE = Path(django_jobs.__file__).parent

# The imports that close a circle on purpose, each with why. ``models.py`` imports
# ``db/indexes.py`` and ``db/lookups.py`` (index classes its migrations name by that path),
# which runs the package ``db/__init__.py``, which imports ``db/base.py``; the seam reads the
# models only when called (``base.py`` and ``job_rows.py`` import them after the app registry
# is ready). Only that package edge is left out: every other circle fails here.
ALLOWED = {
    ("django_jobs.models", "django_jobs.db"),
}


def module_names() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports when it runs, module level or in a
    function, with the packages each import runs first."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for child in node.body for inner in ast.walk(child))
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if not name or name == module:
            continue
        found.add(name)
        # The packages the import runs first, but those ``module`` is inside (already run).
        parts = name.split(".")
        for end in range(1, len(parts)):
            parent = ".".join(parts[:end])
            if parent in known and not f"{module}.".startswith(f"{parent}."):
                found.add(parent)
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {module: imported(module, path, known) for module, path in known.items()}


def test_no_import_circle_inside_the_package():
    graph = import_graph()
    for source, target in ALLOWED:
        assert target in graph[source], f"{source} no longer imports {target}: drop it from ALLOWED"
        graph[source].discard(target)
    found = circles(graph)
    described = [
        "; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle)
        for circle in found
    ]
    assert not found, "import circles (move the shared part to a module of its own):\n" + (
        "\n".join(described)
    )


def test_the_circle_this_test_was_written_for_is_found():
    """``job_rows.py`` importing ``base.py`` again (as it did for ``column``) is found."""
    graph = import_graph()
    for source, target in ALLOWED:
        graph[source].discard(target)
    graph["django_jobs.db.job_rows"].add("django_jobs.db.base")
    assert any(
        {"django_jobs.db.base", "django_jobs.db.job_rows"} <= set(circle)
        for circle in circles(graph)
    )
