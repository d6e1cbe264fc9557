"""The three report kinds over a scope: ``usage`` (requests, tokens, spend, savings, latency), ``margin`` (usage plus
what was billed, fees, margin and payout) and ``payouts`` (per app: frozen when the month is closed, else
provisional)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from kvroute.billing.catalog import Catalog
from kvroute.billing.models import PayoutRow, StatementRow
from kvroute.billing.money import ZERO
from kvroute.billing.reports.columns import KINDS, PAYOUT_COLUMNS
from kvroute.billing.reports.grouping import Grouping
from kvroute.billing.reports.rows import build_rows
from kvroute.billing.reports.scope import Scope
from kvroute.policies.errors import InputError


@dataclass(frozen=True)
class Report:
    """A report's rows and its totals (one per currency), both with every column of ``columns``."""

    kind: str
    scope: Scope
    grouping: Grouping
    app: str | None
    columns: tuple[str, ...]
    rows: list[dict[str, Any]]
    totals: list[dict[str, Any]]

    @property
    def title(self) -> str:
        by = f" · by {self.grouping.label}" if self.kind != "payouts" else ""
        return f"kvroute {self.kind} report {self.scope.label}" + (f" · app {self.app}" if self.app else "") + by


def as_scope(period: str | Scope) -> Scope:
    return period if isinstance(period, Scope) else Scope.month(period)


def check_by(by: str) -> str:
    Grouping.parse(by)
    return by


def build_report(conn: Connection, catalog: Catalog, kind: str, period: str | Scope, app: str | None = None,
                 by: str | Grouping = "backend") -> Report:
    """The ``kind`` report over ``period`` (a month, or a ``Scope``): rows per app × ``by`` and its totals."""
    scope = as_scope(period)
    if kind == "payouts":
        rows = payout_report(conn, catalog, scope, app)
        totals = _payout_totals(rows)
        return Report(kind, scope, Grouping(), app, PAYOUT_COLUMNS, rows, totals)
    grouping = Grouping.parse(by)
    columns = KINDS[kind](grouping)
    rows = build_rows(conn, catalog, scope, grouping, app)
    totals = build_rows(conn, catalog, scope, grouping, app, total=True)
    return Report(kind, scope, grouping, app, columns, [_only(r, columns) for r in rows],
                  [_only(t, columns) for t in totals])


def _only(row: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    return {c: row.get(c) for c in columns}


def usage_report(conn: Connection, catalog: Catalog, period: str | Scope, app: str | None = None,
                 by: str | Grouping = "backend") -> list[dict[str, Any]]:
    return build_report(conn, catalog, "usage", period, app, by).rows


def margin_report(conn: Connection, catalog: Catalog, period: str | Scope, app: str | None = None,
                  by: str | Grouping = "backend") -> list[dict[str, Any]]:
    return build_report(conn, catalog, "margin", period, app, by).rows


_PAYOUT_MONEY = ("billed_amount", "provider_cost", "absorbed_cost", "markup_amount", "fee_amount", "platform_fee",
                 "payment_fee", "adjustments")


def payout_report(conn: Connection, catalog: Catalog, period: str | Scope, app: str | None = None,
                  by: str = "app") -> list[dict[str, Any]]:
    """Per app: the frozen payout when the month is closed (rounded; status ``pending`` until paid), else a
    provisional one computed now (exact): markup + fees − platform fee − payment fee, floored at 0."""
    if by != "app":
        raise InputError("--by", "payouts are per app; --by applies to usage and margin")
    scope = as_scope(period)
    if not scope.is_month:
        raise InputError("--from", "payouts are per month: give --period YYYY-MM")
    period = scope.period
    only = [PayoutRow.app_id == app] if app else []
    stored = {(p.app_id, p.currency): p for p in conn.execute(select(PayoutRow.__table__).where(
        PayoutRow.period == period, *only))}
    statements = {(s.app_id, s.currency): s for s in conn.execute(select(StatementRow.__table__).where(
        StatementRow.period == period, *([StatementRow.app_id == app] if app else [])))}
    per_app = {(r["app_id"], r["currency"]): r for r in build_rows(conn, catalog, scope, Grouping(), app)}
    out = []
    for key in sorted(set(per_app) | set(stored)):
        row = dict(per_app.get(key, {"period": period, "app_id": key[0], "currency": key[1], "requests_total": 0}))
        if key in stored:
            p = stored[key]
            s = statements.get(key)
            row.update({"billed_amount": p.gross_billed, "provider_cost": p.provider_cost,
                        "absorbed_cost": p.absorbed_cost, "markup_amount": p.markup_earned,
                        "fee_amount": p.fee_amount if p.fee_amount is not None else ZERO,
                        "platform_fee": p.platform_fee, "payment_fee": p.payment_fee,
                        "adjustments": s.adjustments_total if s is not None else row.get("adjustments", ZERO),
                        "payout_amount": p.payout_amount, "status": p.status})
        else:
            row["status"] = "provisional"
        out.append(_only(row, PAYOUT_COLUMNS))
    return out


def _payout_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_currency: dict[str, dict[str, Any]] = {}
    for row in rows:
        t = by_currency.setdefault(row["currency"], {"period": row["period"], "app_id": "TOTAL",
                                                     "currency": row["currency"], "requests_total": 0,
                                                     "payout_amount": ZERO, **{m: ZERO for m in _PAYOUT_MONEY}})
        t["requests_total"] += row["requests_total"]
        for m in (*_PAYOUT_MONEY, "payout_amount"):
            t[m] += row[m]
    return list(by_currency.values())
