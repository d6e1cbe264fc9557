"""Monthly report rows (research §8.4): one row per app × served model × provider × backend, plus totals.

Money stays exact (``Decimal``) in rows; only statements round (see ``periods``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, and_, case, func, select, type_coerce

from kvroute.billing.catalog import Catalog
from kvroute.billing.models import Money, PayoutRow, UsageAdjustmentRow, UsageEventRow
from kvroute.billing.money import ZERO, fix

E = UsageEventRow
GROUP = ("app_id", "served_model", "provider", "backend_id", "route_kind", "currency")
TOKENS = ("input_tokens_uncached", "cache_read_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens",
          "output_tokens", "reasoning_tokens")
COUNTS = ("requests_total", "requests_success", "requests_failed", "requests_with_fallback", "attempts_absorbed")
MONEY = ("provider_cost", "absorbed_cost", "markup_amount", "fee_amount", "billed_amount", "platform_fee",
         "payment_fee", "margin_amount", "payout_amount", "adjustments")
USAGE_COLUMNS = ("period", *GROUP[:5], *COUNTS, *TOKENS, "cache_hit_ratio", "provider_cost", "absorbed_cost",
                 "currency")
MARGIN_COLUMNS = ("period", *GROUP[:5], *COUNTS, *TOKENS, "cache_hit_ratio", "provider_cost", "absorbed_cost",
                  "pricing_rule", "markup_amount", "billed_amount", "fee_amount", "platform_fee", "payment_fee",
                  "margin_amount", "margin_pct", "payout_amount", "adjustments", "currency")
#: The compact columns a terminal table shows (every column is in csv / json / parquet).
TABLE_COLUMNS = {
    "usage": ("app_id", "served_model", "provider", "backend_id", "requests_total", "requests_failed",
              "input_tokens_uncached", "cache_read_tokens", "output_tokens", "cache_hit_ratio", "provider_cost",
              "currency"),
    "margin": ("app_id", "served_model", "provider", "backend_id", "requests_total", "cache_hit_ratio",
               "provider_cost", "absorbed_cost", "markup_amount", "billed_amount", "margin_amount", "margin_pct",
               "payout_amount", "adjustments", "currency"),
    "payouts": ("app_id", "requests_total", "billed_amount", "provider_cost", "absorbed_cost", "markup_amount",
                "platform_fee", "adjustments", "payout_amount", "status", "currency"),
}
PAYOUT_COLUMNS = ("period", "app_id", "requests_total", "billed_amount", "provider_cost", "absorbed_cost",
                  "markup_amount", "platform_fee", "payment_fee", "adjustments", "payout_amount", "status",
                  "currency")


def _msum(expr: Any) -> Any:
    return type_coerce(func.coalesce(func.sum(type_coerce(expr, Money())), 0), Money())


def _count(cond: Any) -> Any:
    return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)


def period_start(period: str) -> datetime:
    return datetime(int(period[:4]), int(period[5:7]), 1, tzinfo=UTC)


def group_rows(conn: Connection, period: str, app: str | None = None) -> list[dict[str, Any]]:
    """Aggregate the events booked in ``period`` (their own period) per group, with adjustments merged in."""
    where = [E.booked_period == period, E.period == period]
    if app is not None:
        where.append(E.app_id == app)
    cols = [getattr(E, g) for g in GROUP]
    zero = type_coerce(0, Money())
    query = select(
        *cols,
        _count(E.is_final_attempt.is_(True)).label("requests_total"),
        _count(and_(E.is_final_attempt.is_(True), E.status == "success")).label("requests_success"),
        _count(and_(E.is_final_attempt.is_(True), E.status != "success")).label("requests_failed"),
        _count(and_(E.is_final_attempt.is_(True), E.fallback_depth > 0)).label("requests_with_fallback"),
        _count(and_(E.is_final_attempt.is_(False), E.absorbed_cost > zero)).label("attempts_absorbed"),
        *[func.coalesce(func.sum(getattr(E, c if c != "input_tokens_uncached" else "input_uncached_tokens")), 0)
          .label(c) for c in TOKENS],
        _msum(E.provider_cost - E.absorbed_cost).label("provider_cost"),
        _msum(E.absorbed_cost).label("absorbed_cost"),
        _msum(E.markup_amount + E.surcharge_amount + E.fee_amount).label("markup_amount"),
        _msum(E.fee_amount).label("fee_amount"),
        _msum(E.billed_amount).label("billed_amount"),
    ).where(*where).group_by(*cols)
    rows = {tuple(r[:len(GROUP)]): dict(r._mapping) for r in conn.execute(query)}
    rules: dict[tuple, set[tuple[int, int]]] = defaultdict(set)
    for r in conn.execute(select(*cols, E.price_rule_id, E.price_book_version).where(
            *where, E.price_rule_id.is_not(None)).distinct()):
        rules[tuple(r[:len(GROUP)])].add((r.price_rule_id, r.price_book_version))
    A = UsageAdjustmentRow
    adj_where = [A.period == period] + ([A.app_id == app] if app is not None else [])
    adj = select(A.app_id, E.served_model, E.provider, E.backend_id, E.route_kind, A.currency,
                 type_coerce(A.delta_billed_amount, Money()).label("billed"),
                 type_coerce(A.delta_provider_cost, Money()).label("cost"),
                 type_coerce(A.delta_absorbed_cost, Money()).label("absorbed"),
                 type_coerce(A.delta_markup_amount, Money()).label("markup")).select_from(A).outerjoin(
        E, E.event_id == A.event_id).where(*adj_where)
    for r in conn.execute(adj):
        key = (r.app_id, r.served_model or "(adjustment)", r.provider or "-", r.backend_id or "-",
               r.route_kind or "-", r.currency)
        row = rows.setdefault(key, _empty_row(key))
        row["adjustments"] = row.get("adjustments", ZERO) + r.billed
        row["adjustment_cost"] = row.get("adjustment_cost", ZERO) + r.cost + r.absorbed
        row["adjustment_markup"] = row.get("adjustment_markup", ZERO) + r.markup
    out = []
    for key in sorted(rows):
        row = rows[key]
        row["period"] = period
        row["rules"] = sorted(rules.get(key, ()))
        for name in ("adjustments", "adjustment_cost", "adjustment_markup"):
            row.setdefault(name, ZERO)
        out.append(row)
    return out


def _empty_row(key: tuple) -> dict[str, Any]:
    row: dict[str, Any] = dict(zip(GROUP, key, strict=True))
    row.update({c: 0 for c in (*COUNTS, *TOKENS)})
    row.update({m: ZERO for m in ("provider_cost", "absorbed_cost", "markup_amount", "fee_amount", "billed_amount")})
    return row


def finish_rows(rows: Iterable[dict[str, Any]], catalog: Catalog) -> list[dict[str, Any]]:
    """Add derived columns: cache hit ratio, pricing rule text, fees, margin, margin %, payout."""
    out = []
    for row in rows:
        prompt = (row["input_tokens_uncached"] + row["cache_read_tokens"] + row["cache_write_5m_tokens"]
                  + row["cache_write_1h_tokens"])
        row["cache_hit_ratio"] = round(row["cache_read_tokens"] / prompt, 4) if prompt else 0.0
        described = []
        row["price_book_versions"] = sorted({v for _, v in row.get("rules", [])})
        for rule_id, version in row.pop("rules", []):
            found = catalog.rules_by_id.get(rule_id)
            if found:
                described.append(f"{found[1].describe()} (v{version})")
        row["pricing_rule"] = "; ".join(described) if described else "at cost"
        platform_pct, payment_pct = catalog.platform_fee_pct(row["app_id"], period_start(row["period"]))
        billed = row["billed_amount"] + row["adjustments"]
        row["platform_fee"] = fix(billed * platform_pct)
        row["payment_fee"] = fix(billed * payment_pct)
        cost = row["provider_cost"] + row["absorbed_cost"] + row["adjustment_cost"]
        row["margin_amount"] = billed - cost - row["platform_fee"] - row["payment_fee"]
        row["margin_pct"] = (row["margin_amount"] / billed * 100).quantize(Decimal("0.01")) if billed else None
        earned = row["markup_amount"] + row["adjustment_markup"]
        row["payout_amount"] = earned - row["platform_fee"] - row["payment_fee"]  # floored per app in payouts
        out.append(row)
    return out


def totals(rows: list[dict[str, Any]], label_column: str = "app_id") -> list[dict[str, Any]]:
    """One totals row per currency (sums of counts, tokens and money; ratios recomputed)."""
    by_currency: dict[str, dict[str, Any]] = {}
    for row in rows:
        t = by_currency.setdefault(row["currency"], {"period": row["period"], label_column: "TOTAL",
                                                     "currency": row["currency"]})
        for k, v in row.items():
            if k in (*COUNTS, *TOKENS) or k in MONEY:
                t[k] = t.get(k, 0 if k in (*COUNTS, *TOKENS) else ZERO) + (v if v is not None else 0)
    for t in by_currency.values():
        prompt = sum(t.get(k, 0) for k in TOKENS[:4])
        t["cache_hit_ratio"] = round(t.get("cache_read_tokens", 0) / prompt, 4) if prompt else 0.0
        billed = t.get("billed_amount", ZERO) + t.get("adjustments", ZERO)
        if "margin_amount" in t:
            t["margin_pct"] = (t["margin_amount"] / billed * 100).quantize(Decimal("0.01")) if billed else None
    return list(by_currency.values())


def usage_report(conn: Connection, catalog: Catalog, period: str, app: str | None = None) -> list[dict[str, Any]]:
    rows = finish_rows(group_rows(conn, period, app), catalog)
    return [{c: r.get(c) for c in USAGE_COLUMNS} for r in rows]


def margin_report(conn: Connection, catalog: Catalog, period: str, app: str | None = None) -> list[dict[str, Any]]:
    rows = finish_rows(group_rows(conn, period, app), catalog)
    return [{c: r.get(c) for c in MARGIN_COLUMNS} for r in rows]


def payout_report(conn: Connection, catalog: Catalog, period: str, app: str | None = None) -> list[dict[str, Any]]:
    """Per app: the stored payout when the period is closed, else a provisional one computed now."""
    stored = {(p.app_id, p.currency): p for p in conn.execute(select(PayoutRow.__table__).where(
        PayoutRow.period == period, *([PayoutRow.app_id == app] if app else [])))}
    per_app: dict[tuple[str, str], dict[str, Any]] = {}
    for r in finish_rows(group_rows(conn, period, app), catalog):
        key = (r["app_id"], r["currency"])
        acc = per_app.setdefault(key, {"period": period, "app_id": key[0], "currency": key[1], "requests_total": 0,
                                       **{m: ZERO for m in ("billed_amount", "provider_cost", "absorbed_cost",
                                                            "markup_amount", "platform_fee", "payment_fee",
                                                            "adjustments", "payout_amount")}})
        acc["requests_total"] += r["requests_total"]
        for m in ("billed_amount", "provider_cost", "absorbed_cost", "platform_fee", "payment_fee", "adjustments"):
            acc[m] += r[m]
        acc["markup_amount"] += r["markup_amount"] + r["adjustment_markup"]
    out = []
    for key in sorted(set(per_app) | set(stored)):
        if key in stored:
            p = stored[key]
            row = per_app.get(key, {"period": period, "app_id": key[0], "currency": key[1], "requests_total": 0,
                                    "adjustments": ZERO})
            row.update({"billed_amount": p.gross_billed, "provider_cost": p.provider_cost,
                        "absorbed_cost": p.absorbed_cost, "markup_amount": p.markup_earned,
                        "platform_fee": p.platform_fee, "payment_fee": p.payment_fee,
                        "payout_amount": p.payout_amount, "status": p.status})
        else:
            row = per_app[key]
            row["payout_amount"] = max(ZERO, row["markup_amount"] - row["platform_fee"] - row["payment_fee"])
            row["status"] = "provisional"
        out.append({c: row.get(c) for c in PAYOUT_COLUMNS})
    return out
