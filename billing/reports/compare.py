"""Before and after: the figures a routing change should move, over two ranges of days, side by side.

Each side is ``kvroute report usage --from A --to B --by app`` for one app (``--app``) or the totals of all; the
change is ``after − before`` and, where ``before`` is not 0, ``(after − before) / before`` in percent. One currency
per side (the totals of one currency; name the app where apps bill in several).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy import Connection

from kvroute.billing.catalog import Catalog
from kvroute.billing.money import fix
from kvroute.billing.reports.kinds import build_report
from kvroute.billing.reports.scope import Scope
from kvroute.policies.errors import InputError

#: The figures compared, in order.
FIGURES = ("requests_total", "cache_hit_ratio", "cache_savings", "cache_savings_net", "ttft_p50_ms", "ttft_p90_ms",
           "error_rate", "spend", "cost_per_request", "sessions", "cost_per_session_p50", "cost_per_session_p90")
COLUMNS = ("figure", "before", "after", "change", "change_pct")


def _side(conn: Connection, catalog: Catalog, scope: Scope, app: str | None) -> dict[str, Any] | None:
    report = build_report(conn, catalog, "usage", scope, app, "app")
    rows = report.rows if app is not None else report.totals
    if len(rows) > 1:
        raise InputError("--app", f"{scope.label} is billed in {', '.join(r['currency'] for r in rows)}: name an app")
    return rows[0] if rows else None


def _change(before: Any, after: Any) -> tuple[Any, Any]:
    if before is None or after is None:
        return None, None
    if isinstance(before, float) or isinstance(after, float):
        diff: Any = round(float(after) - float(before), 4)
    elif isinstance(before, Decimal) or isinstance(after, Decimal):
        diff = fix(Decimal(after) - Decimal(before))
    else:
        diff = after - before
    pct = None if not before else round(float(after - before) / float(before) * 100, 1)
    return diff, pct


def compare(conn: Connection, catalog: Catalog, before: Scope, after: Scope,
            app: str | None = None) -> dict[str, Any]:
    """``{"before", "after", "app", "currency", "no_usage": [sides without usage], "rows": [{figure, before,
    after, change, change_pct}]}``."""
    a, b = _side(conn, catalog, before, app), _side(conn, catalog, after, app)
    currencies = {r["currency"] for r in (a, b) if r is not None}
    if len(currencies) > 1:
        raise InputError("--app", f"the two ranges are billed in {' and '.join(sorted(currencies))}")
    rows = []
    for name in FIGURES:
        x = None if a is None else a.get(name)
        y = None if b is None else b.get(name)
        change, pct = _change(x, y)
        rows.append({"figure": name, "before": x, "after": y, "change": change, "change_pct": pct})
    return {"before": before.label, "after": after.label, "app": app or "all apps",
            "currency": next(iter(currencies), None), "no_usage": [side for side, r in (("before", a), ("after", b))
                                                                   if r is None], "rows": rows}
