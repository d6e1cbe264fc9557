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


def _text(value: Any) -> str:
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
        w.writerow([_text(row.get(c)) for c in columns])
        if tick:
            tick()
    return buf.getvalue()


def to_json(rows: Sequence[dict[str, Any]], columns: Sequence[str], totals: Sequence[dict[str, Any]]) -> str:
    def plain(row: dict[str, Any]) -> dict[str, Any]:
        return {c: (_text(row.get(c)) if isinstance(row.get(c), Decimal) else row.get(c)) for c in columns}
    return json.dumps({"rows": [plain(r) for r in rows], "totals": [plain(t) for t in totals]}, indent=2)


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
    """A rich table on the terminal; money shown to 4 decimals (exact values via csv/json/parquet)."""
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title, show_lines=False)
    text_columns = {"app_id", "served_model", "provider", "backend_id", "route_kind", "pricing_rule", "status",
                    "period", "currency"}
    for c in columns:
        header = c.replace("_amount", "").replace("_tokens", "").replace("_", " ")
        table.add_column(header, justify="left" if c in text_columns else "right", overflow="fold")
    for row in rows:
        style = "bold" if row.get("app_id") == "TOTAL" else None
        table.add_row(*[_cell(row.get(c), c) for c in columns], style=style)
    if width is None and file is None and not sys.stdout.isatty():
        width = 4096  # piped: the table's natural width, one row per line, nothing cut
    Console(file=file or sys.stdout, width=width).print(table)


def _cell(value: Any, column: str = "") -> str:
    if isinstance(value, Decimal) and column.endswith("_pct"):
        return f"{value:.2f} %"
    if isinstance(value, Decimal):
        return f"{value:,.4f}"
    if isinstance(value, float):
        return f"{value:.2%}" if value <= 1 else f"{value:.2f}"
    return "" if value is None else str(value)
