"""The report page (``kvroute report html``) and the HTML statement: one self-contained file each (inline CSS and
SVG, no script, no network resource), rendered from jinja templates beside this module.

The page shows, per app, the figures of ``kvroute report margin --by app`` over its days and, per day, those of
``--by app,day``, each figure printed as the table prints it with its exact value in ``data-value``; the fleet's
hit rate is the totals' ``cache_hit_ratio``.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from kvroute.billing.catalog import Catalog
from kvroute.billing.export import cell_text, text
from kvroute.billing.reports import charts
from kvroute.billing.reports.kinds import build_report
from kvroute.billing.reports.scope import Scope
from kvroute.billing.reports.statement import Statement

#: The figures of each app and day on the page, in order, with their labels.
FIGURES = {"requests_total": "Requests", "spend": "Spend", "billed_amount": "Billed", "margin_amount": "Margin",
           "cache_savings": "Cache savings", "cache_hit_ratio": "Cached share", "ttft_p50_ms": "TTFT p50 (ms)",
           "ttft_p90_ms": "TTFT p90 (ms)", "error_rate": "Error rate"}


def _env() -> Any:
    import jinja2
    return jinja2.Environment(loader=jinja2.PackageLoader("kvroute.billing.reports", "."),
                              autoescape=jinja2.select_autoescape(["jinja"], default=True),
                              trim_blocks=True, lstrip_blocks=True)


def figure(row: dict[str, Any], column: str) -> dict[str, str]:
    """A figure as shown (``text``) and exact (``value``: the JSON report's string)."""
    value = row.get(column)
    return {"column": column, "text": cell_text(value, column) or "–", "value": text(value)}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def page_data(conn: Connection, catalog: Catalog, scope: Scope, app: str | None = None) -> dict[str, Any]:
    """Everything the page shows: per app its figures, its days' figures and charts; the fleet's hit rate."""
    per_app = build_report(conn, catalog, "margin", scope, app, "app")
    per_day = build_report(conn, catalog, "margin", scope, app, "app,day")
    days = [str(scope.start + timedelta(days=i)) for i in range(scope.day_count or 0)]
    by_app: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in per_day.rows:
        by_app[(row["app_id"], row["currency"])][row["day"]] = row
    apps = []
    for row in per_app.rows:
        daily = by_app[(row["app_id"], row["currency"])]

        def series(column: str, scale: float = 1.0, rows: dict[str, dict[str, Any]] = daily) -> list[float | None]:
            return [None if d not in rows or rows[d].get(column) is None else _float(rows[d][column]) * scale
                    for d in days]

        money = "{:.3g}".format
        apps.append({
            "app": row["app_id"], "currency": row["currency"],
            "figures": [figure(row, c) for c in FIGURES],
            "days": [{"day": d, "figures": [figure(daily[d], c) for c in FIGURES]} for d in days if d in daily],
            "money_chart": charts.bars(days, {"spend": series("spend"), "billed": series("billed_amount"),
                                              "margin": series("margin_amount"),
                                              "cache savings": series("cache_savings")}, money,
                                       f"{row['app_id']}: daily spend, billed, margin and cache savings"),
            "cache_chart": charts.lines(days, {"cached share %": series("cache_hit_ratio", 100.0),
                                               "error rate %": series("error_rate", 100.0)},
                                        "{:.0f} %".format, f"{row['app_id']}: cached share and error rate"),
            "ttft_chart": charts.lines(days, {"TTFT p50": series("ttft_p50_ms"), "TTFT p90": series("ttft_p90_ms")},
                                       "{:,.0f} ms".format, f"{row['app_id']}: TTFT p50 and p90"),
        })
    fleet = [{"currency": t["currency"], "hit_rate": figure(t, "cache_hit_ratio"), "figures":
              [figure(t, c) for c in FIGURES]} for t in per_app.totals]
    return {"scope": scope.label, "apps": apps, "fleet": fleet, "labels": FIGURES, "app_filter": app}


def render_page(data: dict[str, Any]) -> str:
    return _env().get_template("page.jinja").render(**data)


def render_statement(statement: Statement) -> str:
    return _env().get_template("statement.jinja").render(s=statement.as_dict())
