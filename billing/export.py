"""Write report rows as a rich table, CSV, JSON or Parquet (polars); money as exact decimal strings."""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Callable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

FORMATS = ("table", "csv", "json", "parquet")
MONEY_HINTS = ("cost", "amount", "fee", "adjustments", "billed")


def text(value: Any) -> str:
    """A value as csv / json write it: exact decimals without trailing zeros, None as empty."""
    if value is None:
        return ""
    if isinstance(value, Decimal):
        return format(value.normalize(), "f") if value == value.to_integral() else format(value, "f").rstrip("0")
    return str(value)


def to_csv(rows: Sequence[dict[str, Any]], columns: Sequence[str], tick: Callable[[], None] | None = None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([text(row.get(c)) for c in columns])
        if tick:
            tick()
    return buf.getvalue()


def to_json(rows: Sequence[dict[str, Any]], columns: Sequence[str], totals: Sequence[dict[str, Any]],
            meta: dict[str, Any] | None = None) -> str:
    """``{**meta, "rows": [...], "totals": [...]}``, money as exact decimal strings."""
    def plain(row: dict[str, Any]) -> dict[str, Any]:
        return {c: (text(row.get(c)) if isinstance(row.get(c), Decimal) else row.get(c)) for c in columns}
    return json.dumps({**(meta or {}), "rows": [plain(r) for r in rows], "totals": [plain(t) for t in totals]},
                      indent=2)


def write_parquet(rows: Sequence[dict[str, Any]], columns: Sequence[str], path: Path) -> None:
    """Parquet via polars; money columns as Decimal(38, 10)."""
    import polars as pl
    schema: dict[str, Any] = {}
    for c in columns:
        sample = next((r.get(c) for r in rows if r.get(c) is not None), None)
        if isinstance(sample, Decimal) or (any(h in c for h in MONEY_HINTS) and not c.startswith("requests")):
            schema[c] = pl.Decimal(38, 10)
        elif isinstance(sample, bool):
            schema[c] = pl.Boolean
        elif isinstance(sample, int):
            schema[c] = pl.Int64
        elif isinstance(sample, float):
            schema[c] = pl.Float64
        else:
            schema[c] = pl.Utf8
    data = {c: [r.get(c) for r in rows] for c in columns}
    for c, t in schema.items():
        if t == pl.Utf8:
            data[c] = [None if v is None else str(v) for v in data[c]]
        if isinstance(t, pl.Decimal):
            data[c] = [None if v is None else Decimal(v) for v in data[c]]
    pl.DataFrame(data, schema=schema).write_parquet(path)


def render_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str, file: Any = None,
                 width: int | None = None) -> None:
    """A rich table on the terminal; money to three significant digits below 1 and to the cent above (exact
    values via csv/json/parquet); an unpriced figure reads ``unpriced``."""
    from rich.console import Console
    from rich.table import Table

    from kvroute.billing.reports.grouping import TEXT_COLUMNS
    table = Table(title=title, show_lines=False)
    for c in columns:
        header = HEADERS.get(c) or c.replace("_amount", "").replace("_tokens", "").replace("_", " ")
        table.add_column(header, justify="left" if c in TEXT_COLUMNS else "right", overflow="fold")
    for row in rows:
        style = "bold" if row.get("app_id") == "TOTAL" else None
        table.add_row(*[cell_text(row.get(c), c) for c in columns], style=style)
    if width is None and file is None and not sys.stdout.isatty():
        width = 4096  # piped: the table's natural width, one row per line, nothing cut
    Console(file=file or sys.stdout, width=width).print(table)


#: Short table headers (csv / json keep the column names).
HEADERS = {"requests_total": "requests", "error_rate": "errors", "cache_hit_ratio": "cached", "provider_cost": "cost",
           "absorbed_cost": "absorbed", "cache_savings": "cache saved", "ttft_p50_ms": "ttft p50 ms",
           "ttft_p90_ms": "ttft p90 ms", "currency": "cur", "margin_pct": "margin %", "served_model": "model",
           "backend_id": "backend", "payout_share": "payout share", "app_id": "app"}
#: Figures shown as ``unpriced`` when a row has none (no rate card priced them): never read as 0.
UNPRICED_COLUMNS = ("cache_savings", "cache_write_premium", "cache_savings_net")


def money_text(value: Decimal) -> str:
    """An amount a person can read: to the cent from 1 up, else three significant digits (``0.000331``)."""
    if value == 0:
        return "0"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    return f"{value:.{min(10, 2 - value.adjusted())}f}"


def cell_text(value: Any, column: str = "") -> str:
    """A figure as the table (and the report page) shows it."""
    if value is None:
        return "unpriced" if column in UNPRICED_COLUMNS else ""
    if isinstance(value, Decimal) and column.endswith("_pct"):
        return f"{value:.2f} %"
    if isinstance(value, Decimal):
        return money_text(value)
    if isinstance(value, float):
        return f"{value:.2%}" if column.endswith(("_ratio", "_rate")) else f"{value:,.1f}"
    return str(value)
