"""No import cycles between kvroute's own modules.

Every import statement counts: module level, under ``if TYPE_CHECKING``, and inside functions. The graph is
built from the source with ``ast`` (nothing is imported), relative imports resolved against the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("policies", "plugin", "billing", "sim")


def module_files() -> dict[str, Path]:
    """Dotted module name (``kvroute.policies.base``; a package by its ``__init__``) → its file."""
    modules: dict[str, Path] = {}
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = ["kvroute", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_relative(module: str, path: Path, level: int, target: str | None) -> str:
    package = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, target] if target else base)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The kvroute modules ``module`` imports anywhere in its file (``from pkg import sub`` names ``pkg.sub``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = (
                _resolve_relative(module, path, node.level, node.module) if node.level else (node.module or "")
            )
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    return {name for name in found if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    """Module → the kvroute modules it imports."""
    files = module_files()
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components)


def shortest_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest import loop through the component's first module, for the failure message."""
    start = component[0]
    members = set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    return component


def test_the_detector_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert shortest_loop(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_the_graph_counts_type_only_and_in_function_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "def f():\n    from kvroute.policies import c\n"
        "import kvroute.policies.d\n"
    )
    known = {"kvroute.policies.b", "kvroute.policies.c", "kvroute.policies.d", "kvroute.policies.mod"}
    found = imports_of("kvroute.policies.mod", path, known)
    assert found == {"kvroute.policies.b", "kvroute.policies.c", "kvroute.policies.d"}


def test_no_import_cycles():
    graph = import_graph()
    loops = [" -> ".join(shortest_loop(graph, component)) for component in find_cycles(graph)]
    assert not loops, "import cycles:\n" + "\n".join(loops)
