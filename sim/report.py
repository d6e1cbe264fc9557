"""Render a ``Comparison``: terminal table (rich), JSON (``to_json``: each policy's ``PolicyMetrics.public``), CSV,
one self-contained HTML page."""

from __future__ import annotations

import csv
import html
import io
import json
import math
from typing import Any

from kvroute.sim.runner import Comparison

CSV_FIELDS = ("policy", "requests", "completed", "dropped", "hit_rate", "first_pass_hit_rate", "ttft_p50_s",
              "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "output_tok_s", "queue_depth_mean", "queue_depth_max",
              "hotspot", "cost_per_task", "currency", "makespan_s", "preemptions", "evictions", "wall_s",
              "wasted_prefill_tokens", "wasted_prefill_share", "floor_p50_s", "floor_p90_s", "gap_to_floor_p90")


def to_json(comp: Comparison) -> dict[str, Any]:
    """Exactly ``{"workload", "replicas", "policies": {name: {hit_rate, ttft_*_s, output_tok_s, hotspot,
    cost_per_task, wasted_prefill_tokens, wasted_prefill_share, floor_p50_s, floor_p90_s, gap_to_floor_p90}}}``."""
    return {
        "workload": comp.workload.name,
        "replicas": comp.fleet.replicas,
        "policies": {m.policy: m.public() for m in comp.metrics},
    }


def dumps_json(comp: Comparison) -> str:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return x

    return json.dumps(clean(to_json(comp)), indent=2)


def to_csv(comp: Comparison) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), lineterminator="\n")
    w.writeheader()
    for m in comp.metrics:
        w.writerow({f: (str(getattr(m, f)) if getattr(m, f) is not None else "") for f in CSV_FIELDS})
    return buf.getvalue()


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def table_rows(comp: Comparison) -> list[list[str]]:
    rows = []
    for m in comp.metrics:
        rows.append([m.policy, f"{m.hit_rate:.1%}", _fmt_s(m.ttft_p50_s), _fmt_s(m.ttft_p90_s), _fmt_s(m.ttft_p99_s),
                     _fmt_s(m.ttft_mean_s), f"{m.output_tok_s:,.0f}", f"{m.queue_depth_mean:.1f}",
                     f"{m.hotspot:.2f}", f"{m.cost_per_task} {m.currency}", _fmt_tokens(m.wasted_prefill_tokens,
                     m.wasted_prefill_share), _fmt_s(m.floor_p90_s), _fmt_x(m.gap_to_floor_p90)])
    return rows


def _fmt_tokens(tokens: int, share: float) -> str:
    return "0" if tokens == 0 else f"{tokens / 1e6:,.2f} M ({share:.1%})"


def _fmt_x(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "-"


HEADERS = ["policy", "hit rate", "TTFT p50", "TTFT p90", "TTFT p99", "TTFT mean", "output tok/s", "queue/replica",
           "hotspot", "cost/task", "wasted prefill", "floor p90", "p90 / floor"]


def print_table(comp: Comparison, console: Any = None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 4096)  # piped: nothing cut
    f = comp.fleet
    t = Table(title=f"{comp.workload.name}: {f.replicas} × {f.preset.name}, KV {f.capacity_tokens:,} tokens/replica, "
                    f"{len(comp.workload.requests):,} requests")
    for h in HEADERS:
        t.add_column(h, justify="left" if h == "policy" else "right", overflow="fold")
    for row in table_rows(comp):
        t.add_row(*row)
    console.print(t)
    if comp.verdict is not None:
        console.print(f"[bold]Verdict:[/bold] {comp.verdict.summary}")
    console.print("[dim]wasted prefill: prompt tokens computed on a replica while another's cache held them at "
                  "arrival; floor: per request, the prefill of what no replica held at arrival, alone, no wait "
                  "(no router beats it); p90 / floor = TTFT p90 over the floor's p90[/dim]")
    for note in comp.workload.notes:
        console.print(f"[dim]note: {note}[/dim]")


def to_html(comp: Comparison, images: dict[str, bytes] | None = None) -> str:
    """One self-contained page: tables, verdict, notes and PNG plots inlined as data URIs."""
    import base64

    e = html.escape
    f = comp.fleet
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>kvroute simulate: ",
             e(comp.workload.name), "</title><style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}.v{padding:1em;background:#f3f7ff}</style></head><body>",
             f"<h1>kvroute simulate — {e(comp.workload.name)}</h1>",
             f"<p>{f.replicas} replicas × {e(f.preset.name)} ({e(f.preset.description)}), KV "
             f"{f.capacity_tokens:,} tokens per replica, block {comp.workload.block_tokens} tokens, "
             f"{len(comp.workload.requests):,} requests.</p>"]
    if comp.verdict is not None:
        parts.append(f"<p class='v'><b>Verdict:</b> {e(comp.verdict.summary)}</p>")
    parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in HEADERS) + "</tr>")
    for row in table_rows(comp):
        parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
    parts.append("</table>")
    staged = [m for m in comp.metrics if m.stage_ttft_p90]
    if staged:
        labels = [s for s, _ in staged[0].stage_ttft_p90]
        parts.append("<h2>TTFT p90 per load stage (QPS)</h2><table><tr><th>policy</th>"
                     + "".join(f"<th>{e(lbl)}</th>" for lbl in labels) + "</tr>")
        for m in staged:
            parts.append(f"<tr><td>{e(m.policy)}</td>" + "".join(f"<td>{_fmt_s(v)}</td>" for _, v in m.stage_ttft_p90)
                         + "</tr>")
        parts.append("</table>")
    for name, png in (images or {}).items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<h2>{e(name)}</h2><img alt='{e(name)}' src='data:image/png;base64,{data}'>")
    parts.append("<h2>Assumptions</h2><ul>")
    for note in [*comp.workload.notes, *comp.notes, *f.preset.sources]:
        parts.append(f"<li>{e(note)}</li>")
    parts.append("</ul></body></html>")
    return "".join(parts)
