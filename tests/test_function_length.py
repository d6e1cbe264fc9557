"""No function of kvroute's own longer than ``MAX_LINES`` (the ledger's migrations aside).

A long function is where a new rule gets inlined instead of becoming a part of its own (a scorer, a listener, a
step); the check is built from the source with ``ast``, decorators and docstring included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("policies", "plugin", "billing", "sim")
EXEMPT = (ROOT / "billing" / "migrations",)  # a migration is one schema step, read top to bottom
MAX_LINES = 120


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function or method in ``source`` longer than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = (node.end_lineno or node.lineno) - first + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_the_check_finds_a_long_function_and_passes_a_short_one():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def long():\n{body}\n") == [("long", MAX_LINES + 1)]
    assert long_functions("class A:\n    def short(self):\n        return 1\n") == []


def test_no_function_is_longer_than_the_limit():
    offenders = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(path.is_relative_to(e) for e in EXEMPT):
                continue
            offenders += [f"{path.relative_to(ROOT)}: {name} ({n} lines)"
                          for name, n in long_functions(path.read_text(encoding="utf-8"))]
    assert not offenders, offenders
