"""Monthly report rows: one row per app × group (backend, end user, or the app), plus totals.

Every money column includes the period's adjustments (late events of closed months and re-rate corrections of
closed months, booked here); the
``adjustments`` column says how much of ``billed_amount`` they are. Each row adds up:

- ``billed_amount = provider_cost + markup_amount + fee_amount``
- ``platform_fee = billed_amount × platform_fee_pct``, ``payment_fee = billed_amount × payment_fee_pct``
- ``margin_amount = billed_amount − provider_cost − absorbed_cost − platform_fee − payment_fee``
- ``payout_amount = markup_amount + fee_amount − platform_fee − payment_fee`` (floored at 0 per app in payouts)

``provider_cost`` is the cost of billed attempts, ``absorbed_cost`` the cost of attempts nobody is billed for.
Token and request counts include the late events booked into the period (``late_requests`` counts them);
``unpriced_events`` counts events rated without a reported cost or a rate card (cost 0); ``rerated_events`` those
re-priced by ``kvroute billing rerate`` (in place, or a closed month's correction booked here). Money stays exact
(``Decimal``) in rows; only frozen statements and payouts round (see ``periods``), with the same meaning.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, and_, case, func, literal, select, type_coerce

from kvroute.billing.catalog import Catalog
from kvroute.billing.models import Money, PayoutRow, StatementRow, UsageAdjustmentRow, UsageEventRow
from kvroute.billing.money import ZERO, fix
from kvroute.policies.errors import InputError

E = UsageEventRow
#: ``--by``: the columns a row is grouped on, between ``app_id`` and ``currency``.
GROUPINGS: dict[str, tuple[str, ...]] = {"backend": ("served_model", "provider", "backend_id", "route_kind"),
                                         "end_user": ("end_user",), "app": ()}
GROUP = ("app_id", *GROUPINGS["backend"], "currency")
TOKENS = ("input_tokens_uncached", "cache_read_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens",
          "output_tokens", "reasoning_tokens")
COUNTS = ("requests_total", "requests_success", "requests_failed", "requests_with_fallback", "attempts_absorbed",
          "late_requests", "unpriced_events", "rerated_events", "self_hosted_requests", "hosted_requests")
#: The spend split: all cost (billed + absorbed) of self-hosted backends vs hosted (overflow) ones, by the route kind
#: each event was rated with (the price file's for a backend it declares, see ``Catalog.resolve``).
SPLIT = ("self_hosted_cost", "hosted_cost")
MONEY = ("provider_cost", "absorbed_cost", *SPLIT, "markup_amount", "fee_amount", "billed_amount", "platform_fee",
         "payment_fee", "margin_amount", "payout_amount", "adjustments")
_EVENT_MONEY = ("provider_cost", "absorbed_cost", *SPLIT, "markup_amount", "fee_amount", "billed_amount",
                "adjustments")


def usage_columns(by: str = "backend") -> tuple[str, ...]:
    return ("period", "app_id", *GROUPINGS[by], *COUNTS, *TOKENS, "cache_hit_ratio", "provider_cost",
            "absorbed_cost", *SPLIT, "adjustments", "currency")


def margin_columns(by: str = "backend") -> tuple[str, ...]:
    return ("period", "app_id", *GROUPINGS[by], *COUNTS, *TOKENS, "cache_hit_ratio", "provider_cost",
            "absorbed_cost", *SPLIT, "pricing_rule", "markup_amount", "fee_amount", "billed_amount", "platform_fee",
            "payment_fee", "margin_amount", "margin_pct", "payout_amount", "adjustments", "currency")


USAGE_COLUMNS = usage_columns()
MARGIN_COLUMNS = margin_columns()
PAYOUT_COLUMNS = ("period", "app_id", "requests_total", "billed_amount", "provider_cost", "absorbed_cost",
                  "markup_amount", "fee_amount", "platform_fee", "payment_fee", "adjustments", "payout_amount",
                  "status", "currency")


def table_columns(kind: str, by: str = "backend") -> tuple[str, ...]:
    """The compact columns a terminal table shows (every column is in csv / json / parquet)."""
    dims = GROUPINGS[by] if by != "backend" else ("served_model", "provider", "backend_id")
    if kind == "usage":
        return ("app_id", *dims, "requests_total", "requests_failed", "late_requests", "input_tokens_uncached",
                "cache_read_tokens", "output_tokens", "cache_hit_ratio", "provider_cost", "adjustments",
                "unpriced_events", "currency")
    if kind == "margin":
        return ("app_id", *dims, "requests_total", "provider_cost", "absorbed_cost", *SPLIT, "markup_amount",
                "fee_amount", "billed_amount", "margin_amount", "margin_pct", "payout_amount", "adjustments",
                "unpriced_events", "rerated_events", "currency")
    return ("app_id", "requests_total", "billed_amount", "provider_cost", "absorbed_cost", "markup_amount",
            "fee_amount", "platform_fee", "payment_fee", "adjustments", "payout_amount", "status", "currency")


TABLE_COLUMNS = {kind: table_columns(kind) for kind in ("usage", "margin", "payouts")}


def check_by(by: str) -> str:
    if by not in GROUPINGS:
        raise InputError("--by", f"must be one of {', '.join(GROUPINGS)}, got {by!r}")
    return by


def _msum(expr: Any) -> Any:
    return type_coerce(func.coalesce(func.sum(type_coerce(expr, Money())), 0), Money())


def _count(cond: Any) -> Any:
    return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)


def period_start(period: str) -> datetime:
    return datetime(int(period[:4]), int(period[5:7]), 1, tzinfo=UTC)


def _self_hosted(event: Any = E) -> Any:
    """True where the event was rated as self-hosted: its own ``route_kind``, which the ledger took from the price
    file's backend entry when there was one (``Catalog.resolve``), so the split and the row's rule agree."""
    return event.route_kind == "self_hosted"


def _dimension(name: str) -> Any:
    if name == "end_user":
        return func.coalesce(E.end_user_id, "(none)").label("end_user")
    return getattr(E, name).label(name)


def group_rows(conn: Connection, period: str, app: str | None = None, by: str = "backend") -> list[dict[str, Any]]:
    """Aggregate the events booked in ``period`` per group; late events' money comes from their adjustments."""
    dims = GROUPINGS[check_by(by)]
    group = ("app_id", *dims, "currency")
    where = [E.booked_period == period]
    if app is not None:
        where.append(E.app_id == app)
    cols = [E.app_id.label("app_id"), *[_dimension(d) for d in dims], E.currency.label("currency")]
    zero = type_coerce(0, Money())
    on_time = E.period == E.booked_period

    def own(expr: Any) -> Any:  # money of events booked in their own period (late ones come as adjustments)
        return _msum(case((on_time, expr), else_=zero))

    query = select(
        *cols,
        _count(E.is_final_attempt.is_(True)).label("requests_total"),
        _count(and_(E.is_final_attempt.is_(True), E.status == "success")).label("requests_success"),
        _count(and_(E.is_final_attempt.is_(True), E.status != "success")).label("requests_failed"),
        _count(and_(E.is_final_attempt.is_(True), E.fallback_depth > 0)).label("requests_with_fallback"),
        _count(and_(E.is_final_attempt.is_(False), E.absorbed_cost > zero)).label("attempts_absorbed"),
        _count(and_(E.is_final_attempt.is_(True), E.period != E.booked_period)).label("late_requests"),
        _count(E.cost_source == "unknown").label("unpriced_events"),
        _count(E.rerate_run_id.is_not(None)).label("rerated_events"),
        _count(and_(E.is_final_attempt.is_(True), _self_hosted())).label("self_hosted_requests"),
        _count(and_(E.is_final_attempt.is_(True), ~_self_hosted())).label("hosted_requests"),
        *[func.coalesce(func.sum(getattr(E, c if c != "input_tokens_uncached" else "input_uncached_tokens")), 0)
          .label(c) for c in TOKENS],
        own(E.provider_cost - E.absorbed_cost).label("provider_cost"),
        own(E.absorbed_cost).label("absorbed_cost"),
        own(E.markup_amount + E.surcharge_amount).label("markup_amount"),
        own(E.fee_amount).label("fee_amount"),
        own(E.billed_amount).label("billed_amount"),
        own(case((_self_hosted(), E.provider_cost), else_=zero)).label("self_hosted_cost"),
        own(case((_self_hosted(), zero), else_=E.provider_cost)).label("hosted_cost"),
    ).select_from(E).where(*where).group_by(
        *cols[:len(group)])
    rows = {tuple(r[:len(group)]): {**dict(r._mapping), "adjustments": ZERO} for r in conn.execute(query)}
    rules: dict[tuple, set[tuple[int, int]]] = defaultdict(set)
    for r in conn.execute(select(*cols, E.price_rule_id, E.price_book_version).where(
            *where, E.price_rule_id.is_not(None)).distinct()):
        rules[tuple(r[:len(group)])].add((r.price_rule_id, r.price_book_version))
    A = UsageAdjustmentRow
    adj_where = [A.period == period] + ([A.app_id == app] if app is not None else [])
    placeholder = {"served_model": "(adjustment)", "end_user": "(none)"}
    adj_dims = [func.coalesce(E.end_user_id if d == "end_user" else getattr(E, d),
                              literal(placeholder.get(d, "-"))).label(d) for d in dims]
    adj = select(A.app_id, *adj_dims, A.currency,
                 type_coerce(A.delta_billed_amount, Money()).label("billed"),
                 type_coerce(A.delta_provider_cost, Money()).label("cost"),
                 type_coerce(A.delta_absorbed_cost, Money()).label("absorbed"),
                 type_coerce(A.delta_markup_amount, Money()).label("markup"), A.kind,
                 _self_hosted().label("self_hosted")).select_from(A).outerjoin(
        E, E.event_id == A.event_id).where(*adj_where)
    for r in conn.execute(adj):
        key = tuple(r[:len(group)])
        row = rows.get(key)
        if row is None:
            row = rows[key] = _empty_row(group, key)
        row["adjustments"] += r.billed
        row["rerated_events"] += r.kind == "rerate"  # a closed month's event re-rated: its correction lands here
        row["billed_amount"] += r.billed
        row["provider_cost"] += r.cost
        row["absorbed_cost"] += r.absorbed
        row["markup_amount"] += r.markup
        row["fee_amount"] += r.billed - r.cost - r.markup  # what the delta bills beyond cost and markup
        row["self_hosted_cost" if r.self_hosted else "hosted_cost"] += r.cost + r.absorbed
    out = []
    for key in sorted(rows):
        row = rows[key]
        row["period"] = period
        row["rules"] = sorted(rules.get(key, ()))
        out.append(row)
    return out


def _empty_row(group: tuple[str, ...], key: tuple) -> dict[str, Any]:
    row: dict[str, Any] = dict(zip(group, key, strict=True))
    row.update({c: 0 for c in (*COUNTS, *TOKENS)})
    row.update({m: ZERO for m in _EVENT_MONEY})
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
        if row["unpriced_events"]:
            row["pricing_rule"] += f"; UNPRICED: {row['unpriced_events']} event(s) at cost 0"
        if row["rerated_events"]:
            row["pricing_rule"] += f"; RE-RATED: {row['rerated_events']} event(s) (kvroute billing rerate)"
        platform_pct, payment_pct = catalog.platform_fee_pct(row["app_id"], period_start(row["period"]))
        billed = row["billed_amount"]
        row["platform_fee"] = fix(billed * platform_pct)
        row["payment_fee"] = fix(billed * payment_pct)
        fees = row["platform_fee"] + row["payment_fee"]
        row["margin_amount"] = billed - row["provider_cost"] - row["absorbed_cost"] - fees
        row["margin_pct"] = (row["margin_amount"] / billed * 100).quantize(Decimal("0.01")) if billed else None
        row["payout_amount"] = row["markup_amount"] + row["fee_amount"] - fees  # floored per app in payouts
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
        billed = t.get("billed_amount", ZERO)
        if "margin_amount" in t:
            t["margin_pct"] = (t["margin_amount"] / billed * 100).quantize(Decimal("0.01")) if billed else None
    return list(by_currency.values())


def usage_report(conn: Connection, catalog: Catalog, period: str, app: str | None = None,
                 by: str = "backend") -> list[dict[str, Any]]:
    rows = finish_rows(group_rows(conn, period, app, by), catalog)
    return [{c: r.get(c) for c in usage_columns(by)} for r in rows]


def margin_report(conn: Connection, catalog: Catalog, period: str, app: str | None = None,
                  by: str = "backend") -> list[dict[str, Any]]:
    rows = finish_rows(group_rows(conn, period, app, by), catalog)
    return [{c: r.get(c) for c in margin_columns(by)} for r in rows]


_PAYOUT_MONEY = ("billed_amount", "provider_cost", "absorbed_cost", "markup_amount", "fee_amount", "platform_fee",
                 "payment_fee", "adjustments")


def payout_report(conn: Connection, catalog: Catalog, period: str, app: str | None = None,
                  by: str = "app") -> list[dict[str, Any]]:
    """Per app: the frozen payout when the period is closed (rounded), else a provisional one computed now."""
    if by != "app":
        raise InputError("--by", "payouts are per app; --by end_user/backend applies to usage and margin")
    only = [PayoutRow.app_id == app] if app else []
    stored = {(p.app_id, p.currency): p for p in conn.execute(select(PayoutRow.__table__).where(
        PayoutRow.period == period, *only))}
    statements = {(s.app_id, s.currency): s for s in conn.execute(select(StatementRow.__table__).where(
        StatementRow.period == period, *([StatementRow.app_id == app] if app else [])))}
    per_app: dict[tuple[str, str], dict[str, Any]] = {}
    for r in finish_rows(group_rows(conn, period, app), catalog):
        key = (r["app_id"], r["currency"])
        acc = per_app.setdefault(key, {"period": period, "app_id": key[0], "currency": key[1], "requests_total": 0,
                                       **{m: ZERO for m in _PAYOUT_MONEY}})
        acc["requests_total"] += r["requests_total"]
        for m in _PAYOUT_MONEY:
            acc[m] += r[m]
    out = []
    for key in sorted(set(per_app) | set(stored)):
        if key in stored:
            p = stored[key]
            row = per_app.get(key, {"period": period, "app_id": key[0], "currency": key[1], "requests_total": 0})
            fee = p.fee_amount if p.fee_amount is not None else ZERO
            s = statements.get(key)
            row.update({"billed_amount": p.gross_billed, "provider_cost": p.provider_cost,
                        "absorbed_cost": p.absorbed_cost, "markup_amount": p.markup_earned, "fee_amount": fee,
                        "platform_fee": p.platform_fee, "payment_fee": p.payment_fee,
                        "adjustments": s.adjustments_total if s is not None else row.get("adjustments", ZERO),
                        "payout_amount": p.payout_amount, "status": p.status})
        else:
            row = per_app[key]
            row["payout_amount"] = max(ZERO, row["markup_amount"] + row["fee_amount"] - row["platform_fee"]
                                       - row["payment_fee"])
            row["status"] = "provisional"
        out.append({c: row.get(c) for c in PAYOUT_COLUMNS})
    return out
