"""No module but the callback's own reads a private attribute of the callback.

The callback's delegates see it through ``CallbackHost`` (public members only). The check is built from the
source with ``ast`` (nothing is imported): a ``_name`` attribute (not a dunder) read or written on a name that
stands for the callback: ``cb``, ``callback``, or a parameter annotated ``CallbackHost`` / ``KvrouteCallback``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("policies", "plugin", "billing", "sim")
CALLBACK_MODULE = ROOT / "plugin" / "adapter" / "litellm_hooks.py"
CALLBACK_NAMES = frozenset({"cb", "callback"})
CALLBACK_TYPES = frozenset({"CallbackHost", "KvrouteCallback"})


def _annotated_callback(arg: ast.arg) -> bool:
    note = arg.annotation
    if note is None:
        return False
    text = note.value if isinstance(note, ast.Constant) and isinstance(note.value, str) else ast.unparse(note)
    return any(name in text for name in CALLBACK_TYPES)


def private_reads(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """``(line, "name._attr")`` for each private attribute of the callback that ``source`` touches."""
    tree = ast.parse(source, filename=filename)
    names = set(CALLBACK_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            names.update(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if _annotated_callback(a))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            attr = node.attr
            if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                found.append((node.lineno, f"{node.value.id}.{attr}"))
    return sorted(found)


def test_the_check_sees_a_private_read():
    source = (
        "def f(cb, host: 'CallbackHost', other):\n"
        "    cb._settings = 1\n"
        "    host._shared.close()\n"
        "    other._private\n"
        "    cb.settings, cb.__class__\n"
    )
    assert private_reads(source) == [(2, "cb._settings"), (3, "host._shared")]


def test_no_module_reads_the_callbacks_private_attributes():
    offences = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == CALLBACK_MODULE:
                continue
            rel = path.relative_to(ROOT)
            offences += [f"{rel}:{line}: {what}"
                         for line, what in private_reads(path.read_text(encoding="utf-8"), str(path))]
    assert not offences, "private attributes of the callback read outside it:\n" + "\n".join(offences)
