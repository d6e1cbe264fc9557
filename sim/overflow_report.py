"""Render the overflow strategies' figures: a terminal table, JSON and CSV (one row per strategy)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any

from kvroute.sim.strategies import Check, Figures

COLUMNS = ("strategy", "requests", "ttft_p90_in_s", "ttft_p90_out_s", "meet_in", "meet_out", "meet_all",
           "cost_per_1k", "cost_per_1k_in", "cost_per_1k_out", "hosted_share", "hosted_share_in", "failed",
           "currency")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def to_json(figs: Sequence[Figures], checks: Sequence[Check], meta: dict[str, Any]) -> str:
    return json.dumps(_clean({**meta, "strategies": {f.strategy: f.as_dict() for f in figs},
                              "targets": [{"name": c.name, "passed": c.passed, "detail": c.detail}
                                          for c in checks]}), indent=2)


def to_csv(figs: Sequence[Figures]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for f in figs:
        w.writerow(f.as_dict())
    return out.getvalue()


def print_table(figs: Sequence[Figures], checks: Sequence[Check], title: str, target_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for head in ("strategy", "TTFT p90 spike", "TTFT p90 outside", f"<= {target_s:g} s spike",
                 f"<= {target_s:g} s outside", "cost / 1k", "cost / 1k spike", "cost / 1k outside", "hosted",
                 "failed"):
        t.add_column(head, justify="left" if head == "strategy" else "right", no_wrap=head == "strategy")
    for f in figs:
        t.add_row(f.strategy, f"{f.ttft_p90_in_s:.2f} s", f"{f.ttft_p90_out_s:.2f} s", f"{f.meet_in:.2%}",
                  f"{f.meet_out:.2%}", f"{f.cost_per_1k:.4f}", f"{f.cost_per_1k_in:.4f}", f"{f.cost_per_1k_out:.4f}",
                  f"{f.hosted_share:.1%}", str(f.failed))
    console = Console(width=max(Console().width, 150))
    console.print(t)
    for c in checks:
        console.print(f"{'PASS' if c.passed else 'MISS'}  hybrid {c.name}: {c.detail}")
