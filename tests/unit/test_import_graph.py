"""The product packages' import graph: no circles (TYPE_CHECKING imports included), and common/ imports no other
project package (it is the bottom layer every process shares); nothing outside tests/ imports tests/."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "frontend", "scheduler", "worker", "capacity", "launcher", "batch_jobs")


def _module_name(path: Path) -> str:
    """The installed name of a product file: frontend/app.py is shuttle.frontend.app (pyproject.toml's package-dir)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "shuttle" else ("shuttle", *parts))


def _imports(path: Path, modules: set[str], roots: tuple[str, ...] = PACKAGES) -> set[str]:
    """Modules under `roots` that `path` imports anywhere (module level, functions, TYPE_CHECKING blocks)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and (name.split(".")[0] in roots or name.split(".")[:2][-1] in roots):
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for package in (*PACKAGES, "shuttle") for p in (REPO / package).rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    cycle = _find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_common_imports_no_other_project_package():
    upward = {f"{name} imports {target}" for name, targets in _graph().items() if name.startswith("shuttle.common")
              for target in targets if not target.startswith("shuttle.common")}
    assert not upward, sorted(upward)


def test_nothing_outside_tests_imports_tests():
    """The packages and scripts/ stand on their own: what tests and tools share lives in a package."""
    sources = [p for package in (*PACKAGES, "scripts") for p in (REPO / package).rglob("*.py")]
    offenders = sorted(str(p.relative_to(REPO)) for p in sources if _imports(p, {"tests"}, roots=("tests",)))
    assert not offenders, offenders


def test_every_import_of_a_product_package_says_shuttle():
    """Product code, tests and scripts import `shuttle.frontend`, never a bare `frontend`: from a source tree the bare
    name would still import (the repository root is on sys.path), as a second copy of every module under another
    name, and an installed shuttle has no such name at all."""
    sources = [p for package in (*PACKAGES, "shuttle", "scripts", "tests") for p in (REPO / package).rglob("*.py")]
    offenders = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert not offenders, offenders
