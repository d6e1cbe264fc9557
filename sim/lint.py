"""``kvroute lint``: find what breaks prefix reuse in a request log, where it sits, what it costs, how to fix it.

Each request is rendered in prompt order (tools, then messages); detectors find volatile fields
(timestamps, dates, UUIDs, request ids, emails, user names, random seeds) and tool lists sent in changing
order. A field counts only if its value changes between requests of the same app at the same place.
Reusable tokens lost = Σ over consecutive requests of an app of (common prefix with every volatile field
masked − actual common prefix), in estimated tokens (4 bytes each). No prompt text is printed or stored,
except a short excerpt with the volatile value masked, and only when the user asks for excerpts.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.sim.traces import iter_log

BYTES_PER_TOKEN = 4.0

DETECTORS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    ("timestamp", re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
                             r"|\b\d{1,2}:\d{2}:\d{2}\b|\b1[6-9]\d{8}(?:\d{3})?\b")),
    ("date", re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?"
                        r"\s+(?:\d{1,2}\s+)?(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?\s+\d{1,2}"
                        r"(?:,\s*\d{4})?|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?\s+\d{1,2},\s*\d{4}")),
    ("request_id", re.compile(r"\b(?:req|request|trace|span|msg|run|call|chatcmpl|sess|session|corr)[-_]"
                              r"(?=[A-Za-z0-9]*\d)[A-Za-z0-9]{6,}\b|\b[0-9a-f]{16,}\b", re.IGNORECASE)),
    ("email", re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")),
    ("user_name", re.compile(r"(?:(?<=my name is )|(?<=user: )|(?<=user name: )|(?<=username: )|(?<=customer: )"
                             r"|(?<=Name: )|(?<=name: )|(?<=Hello )|(?<=Hi )|(?<=Dear ))[A-Z][a-z]+(?: [A-Z][a-z]+)?")),
    ("random_seed", re.compile(r"\b(?:seed|nonce|random(?:_| )?(?:id|number|value)?)\s*[:=]\s*\d+", re.IGNORECASE)),
)

FIXES: dict[str, str] = {
    "timestamp": "Move the current time out of {where}: put it in the last user message (or drop it). Stable "
                 "content first, dynamic fields last.",
    "date": "Move today's date out of {where} into the last user message, or round it to a coarser, stable value.",
    "uuid": "Keep UUIDs out of {where}: send them as metadata/headers, or append them after the stable content.",
    "request_id": "Request/trace ids belong in metadata or headers, not in {where}; if the model needs one, put it "
                  "at the very end.",
    "email": "Put per-user details such as emails after the shared instructions (end of {where} or the user turn).",
    "user_name": "Put the user's name after the shared instructions (end of {where} or the user turn).",
    "random_seed": "Do not put random seeds or nonces in {where}; pass `seed` as a request parameter.",
    "tools_order": "Send tools in one stable order (e.g. sorted by name): a reordered list changes the prompt from "
                   "the first tool on.",
}


@dataclass(slots=True)
class _Span:
    kind: str
    start: int
    end: int
    where: str
    value_hash: int


@dataclass(slots=True)
class Finding:
    """One volatile field at one place in one app's prompts."""

    app: str
    kind: str
    where: str
    requests: int
    distinct_values: int
    position_tokens: int
    tokens_lost: float
    fix: str
    excerpt: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"app": self.app, "kind": self.kind, "where": self.where, "requests": self.requests,
             "distinct_values": self.distinct_values, "position_tokens": self.position_tokens,
             "tokens_lost": round(self.tokens_lost), "fix": self.fix}
        if self.excerpt is not None:
            d["excerpt"] = self.excerpt
        return d


@dataclass(slots=True)
class AppSummary:
    app: str
    requests: int = 0
    prompt_tokens: float = 0.0
    reused_tokens: float = 0.0
    reusable_tokens: float = 0.0

    @property
    def tokens_lost(self) -> float:
        return max(0.0, self.reusable_tokens - self.reused_tokens)


@dataclass(slots=True)
class LintReport:
    requests: int
    apps: list[AppSummary]
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_lost(self) -> float:
        return sum(a.tokens_lost for a in self.apps)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tokens_lost": round(self.tokens_lost),
            "apps": [{"app": a.app, "requests": a.requests, "prompt_tokens": round(a.prompt_tokens),
                      "reused_tokens": round(a.reused_tokens), "reusable_tokens": round(a.reusable_tokens),
                      "tokens_lost": round(a.tokens_lost)} for a in self.apps],
            "findings": [f.as_dict() for f in self.findings],
            "notes": list(self.notes),
        }


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(c.get("text", "") if isinstance(c, dict) else c) for c in content)
    return "" if content is None else json.dumps(content, sort_keys=True, default=str)


def _render(body: dict[str, Any]) -> tuple[str, list[tuple[int, str]], list[str]]:
    """Prompt-order text, the start offset + label of each part, and the tool names in order."""
    parts: list[str] = []
    marks: list[tuple[int, str]] = []
    pos = 0
    names: list[str] = []
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        names.append(str(fn.get("name", i)) if isinstance(fn, dict) else str(i))
        s = json.dumps(tool, sort_keys=True, default=str) + "\n"
        marks.append((pos, f"tools[{i}]"))
        parts.append(s)
        pos += len(s)
    msgs = body.get("messages") if isinstance(body.get("messages"), list) else []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            continue
        s = f"{m.get('role', '')}\n{_text(m.get('content'))}\n"
        marks.append((pos, f"messages[{i}] ({m.get('role', '?')})"))
        parts.append(s)
        pos += len(s)
    for key in ("prompt", "input"):
        if isinstance(body.get(key), str | list) and not msgs:
            s = _text(body[key])
            marks.append((pos, key))
            parts.append(s)
            pos += len(s)
    return "".join(parts), marks, names


def _where(marks: list[tuple[int, str]], offset: int) -> str:
    label = marks[0][1] if marks else "prompt"
    for start, lbl in marks:
        if start <= offset:
            label = lbl
        else:
            break
    return label


def _spans(text: str, marks: list[tuple[int, str]]) -> list[_Span]:
    taken: list[tuple[int, int]] = []
    out: list[_Span] = []
    for kind, rx in DETECTORS:
        for m in rx.finditer(text):
            s, e = m.start(), m.end()
            if any(s < b and a < e for a, b in taken):
                continue
            taken.append((s, e))
            out.append(_Span(kind, s, e, _where(marks, s), hash(m.group(0))))
    out.sort(key=lambda sp: sp.start)
    return out


def _mask(text: str, spans: Iterable[_Span]) -> str:
    pieces, last = [], 0
    for sp in spans:
        pieces.append(text[last:sp.start])
        pieces.append(f"<{sp.kind.upper()}>")
        last = sp.end
    pieces.append(text[last:])
    return "".join(pieces)


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _excerpt(text: str, sp: _Span, spans: list[_Span], width: int = 24) -> str:
    a, b = max(0, sp.start - width), min(len(text), sp.end + width)
    local = [s for s in spans if s.start >= a and s.end <= b]
    masked = _mask(text[a:b], [_Span(s.kind, s.start - a, s.end - a, s.where, 0) for s in local])
    masked = re.sub(r"\s+", " ", masked)
    return ("…" if a > 0 else "") + masked + ("…" if b < len(text) else "")


def lint_log(path: str | Path, *, excerpts: bool = False, limit: int | None = None) -> LintReport:
    """Analyse a JSONL request log (same formats as ``kvroute simulate --workload log:PATH``)."""
    apps: dict[str, AppSummary] = {}
    prev: dict[str, tuple[str, str]] = {}
    values: dict[tuple[str, str, str], set[int]] = {}
    positions: dict[tuple[str, str, str], list[int]] = {}
    counts: dict[tuple[str, str, str], int] = {}
    lost: dict[tuple[str, str, str], float] = {}
    sample: dict[tuple[str, str, str], str] = {}
    tool_orders: dict[str, set[tuple[str, ...]]] = {}
    n = 0
    for rec in iter_log(path):
        n += 1
        text, marks, names = _render(rec.body)
        spans = _spans(text, marks)
        app = apps.setdefault(rec.app, AppSummary(rec.app))
        app.requests += 1
        app.prompt_tokens += len(text) / BYTES_PER_TOKEN
        if names:
            tool_orders.setdefault(rec.app, set()).add(tuple(names))
        seen_here: set[tuple[str, str, str]] = set()
        for sp in spans:
            key = (rec.app, sp.kind, sp.where)
            values.setdefault(key, set()).add(sp.value_hash)
            positions.setdefault(key, []).append(int(sp.start / BYTES_PER_TOKEN))
            if key not in seen_here:
                counts[key] = counts.get(key, 0) + 1
                seen_here.add(key)
            if excerpts and key not in sample:
                sample[key] = _excerpt(text, sp, spans)
        tools_sorted = names != sorted(names)
        masked = _mask(text, spans)
        if names and tools_sorted:
            masked_tools, _, _ = _render({**rec.body, "tools": sorted(rec.body.get("tools") or [],
                                          key=lambda t: json.dumps(t, sort_keys=True, default=str))})
            masked = _mask(masked_tools, _spans(masked_tools, marks))
        before = prev.get(rec.app)
        if before is not None:
            actual = _lcp(before[0], text)
            ideal = _lcp(before[1], masked)
            app.reused_tokens += actual / BYTES_PER_TOKEN
            # the masked text is shorter or longer by placeholder widths: compare in original-text tokens
            gain = max(0, ideal - actual) / BYTES_PER_TOKEN
            app.reusable_tokens += actual / BYTES_PER_TOKEN + gain
            if gain > 0:
                culprit = next((sp for sp in spans if sp.end > actual), None)
                if culprit is not None and culprit.start <= actual + 1:
                    k = (rec.app, culprit.kind, culprit.where)
                elif names and tools_sorted:
                    k = (rec.app, "tools_order", "tools")
                else:
                    k = (rec.app, culprit.kind if culprit else "other", culprit.where if culprit else "prompt")
                lost[k] = lost.get(k, 0.0) + gain
        prev[rec.app] = (text, masked)
        if limit is not None and n >= limit:
            break
    findings: list[Finding] = []
    for key, vals in values.items():
        if len(vals) < 2:
            continue
        app_name, kind, where = key
        findings.append(Finding(app_name, kind, where, counts.get(key, 0), len(vals),
                                int(statistics.median(positions[key])), lost.get(key, 0.0),
                                FIXES.get(kind, "Move this field after the stable content.").format(where=where),
                                sample.get(key) if excerpts else None))
    for app_name, orders in tool_orders.items():
        if len(orders) > 1:
            findings.append(Finding(app_name, "tools_order", "tools", apps[app_name].requests, len(orders), 0,
                                    lost.get((app_name, "tools_order", "tools"), 0.0), FIXES["tools_order"]))
    findings.sort(key=lambda f: (-f.tokens_lost, f.position_tokens))
    notes = ["tokens are estimated at 4 bytes each; a field counts only when its value changes within an app"]
    return LintReport(n, sorted(apps.values(), key=lambda a: -a.tokens_lost), findings, notes)


def print_report(report: LintReport, console: Any = None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if sys.stdout.isatty() else 4096)  # piped: nothing cut
    t = Table(title=f"prompt lint: {report.requests} requests, ~{report.tokens_lost:,.0f} reusable tokens lost")
    for h in ("app", "kind", "where", "position (tok)", "requests", "values", "tokens lost", "fix"):
        t.add_column(h, overflow="fold")
    for f in report.findings:
        t.add_row(f.app, f.kind, f.where, str(f.position_tokens), str(f.requests), str(f.distinct_values),
                  f"{f.tokens_lost:,.0f}", f.fix)
    console.print(t)
    a = Table(title="per app")
    for h in ("app", "requests", "prompt tokens", "reused", "reusable", "lost"):
        a.add_column(h, justify="right", overflow="fold")
    for s in report.apps:
        a.add_row(s.app, str(s.requests), f"{s.prompt_tokens:,.0f}", f"{s.reused_tokens:,.0f}",
                  f"{s.reusable_tokens:,.0f}", f"{s.tokens_lost:,.0f}")
    console.print(a)
    if any(f.excerpt for f in report.findings):
        for f in report.findings:
            if f.excerpt:
                console.print(Text.assemble((f"{f.app} {f.kind} {f.where}:", "dim"), " ", f.excerpt))
