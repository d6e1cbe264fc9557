"""Prompt lint: finds volatile fields early in prompts, estimates tokens lost, never leaks prompt text."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.sim.lint import lint_log

POLICY = "Follow the refund policy carefully and answer politely. " * 60
SECRET = "ZebraCanyonPassword"


def _write(tmp_path: Path, rows: list[dict]) -> Path:
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _req(system: str, user: str, app: str = "support", tools: list | None = None) -> dict:
    body: dict = {"model": "m", "metadata": {"app": app},
                  "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    if tools is not None:
        body["tools"] = tools
    return body


def test_timestamp_at_the_start_of_the_system_prompt(tmp_path: Path) -> None:
    rows = [_req(f"Current time: 2026-11-{10 + i:02d}T10:{i:02d}:00Z. {POLICY} {SECRET}", f"q{i}") for i in range(6)]
    rep = lint_log(_write(tmp_path, rows))
    top = rep.findings[0]
    assert top.kind == "timestamp" and top.where == "messages[0] (system)"
    assert top.distinct_values == 6 and top.position_tokens < 10
    assert top.tokens_lost > 5 * len(POLICY) / 4 * 0.9
    assert "last user message" in top.fix
    text = json.dumps(rep.as_dict())
    assert SECRET not in text and "refund" not in text and top.excerpt is None


def test_stable_values_and_late_fields_cost_nothing(tmp_path: Path) -> None:
    same = [_req(f"Today is 2026-11-29. {POLICY}", f"q{i}") for i in range(4)]
    rep = lint_log(_write(tmp_path, same))
    assert rep.findings == [] and rep.tokens_lost == 0
    late = [_req(POLICY, f"request id req_{i:08d}a question") for i in range(4)]
    rep = lint_log(_write(tmp_path, late))
    assert all(f.tokens_lost < 20 for f in rep.findings)


def test_ids_emails_seeds_names_and_per_app(tmp_path: Path) -> None:
    rows = []
    for i in range(4):
        rows.append(_req(f"trace 3f2b1c4d-aaaa-bbbb-cccc-{i:012d} {POLICY}", "hi", app="a"))
        rows.append(_req(f"Customer email user{i}@example.com. {POLICY}", "hi", app="b"))
        rows.append(_req(f"seed={1000 + i} {POLICY}", "hi", app="c"))
        rows.append(_req(f"Hello {['Alice', 'Bob', 'Carol', 'Dave'][i]}, {POLICY}", "hi", app="d"))
    rep = lint_log(_write(tmp_path, rows))
    kinds = {(f.app, f.kind) for f in rep.findings}
    assert {("a", "uuid"), ("b", "email"), ("c", "random_seed"), ("d", "user_name")} <= kinds
    assert {a.app for a in rep.apps} == {"a", "b", "c", "d"}
    assert all(a.tokens_lost > 0 for a in rep.apps)


def test_reordered_tools(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": n, "description": POLICY[:400]}} for n in "abc"]
    rows = [_req("sys", "q", tools=tools), _req("sys", "q", tools=list(reversed(tools))), _req("sys", "q", tools=tools)]
    rep = lint_log(_write(tmp_path, rows))
    f = next(f for f in rep.findings if f.kind == "tools_order")
    assert f.distinct_values == 2 and f.tokens_lost > 0 and "stable order" in f.fix


def test_excerpts_are_opt_in_and_masked(tmp_path: Path) -> None:
    rows = [_req(f"Now: 2026-11-{10 + i:02d}T10:00:00Z. {POLICY}", "q") for i in range(3)]
    rep = lint_log(_write(tmp_path, rows), excerpts=True)
    ex = rep.findings[0].excerpt
    assert ex is not None and "<TIMESTAMP>" in ex and "2026-11" not in ex and len(ex) < 80
