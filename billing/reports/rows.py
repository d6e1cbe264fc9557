"""Report rows: one per app × ``--by`` levels (``grouping``) over a ``Scope``, plus one totals row per currency.

Every money column includes the scope's adjustments (a month: late events of closed months and re-rate
corrections of closed months booked in it; days: re-rate corrections of the attempts that ran on them); the
``adjustments`` column says how much of ``billed_amount`` they are. Each row adds up:

- ``billed_amount = provider_cost + markup_amount + fee_amount``
- ``platform_fee = billed_amount × platform_fee_pct``, ``payment_fee = billed_amount × payment_fee_pct``, the
  percentages of the app's book in force on the first day of the month the money is booked in (``--from/--to``:
  the month the attempt ran in)
- ``margin_amount = billed_amount − provider_cost − absorbed_cost − platform_fee − payment_fee``
- ``payout_share = markup_amount + fee_amount − platform_fee − payment_fee``; ``payout_amount`` is the share of each
  app's month floored at 0, summed: shown on rows that are whole apps (``--by app``) and on the totals
- ``absorbed_cost`` = ``absorbed_failed + absorbed_stream_cut + absorbed_cancelled + absorbed_hedge`` (``causes``)
- ``hedged_requests``: requests raced by a hedge (one losing attempt each); ``hedge_wins``: those the hedge answered;
  ``hedge_cost``: what the losing attempts cost (billed or absorbed)

``provider_cost`` is the cost of billed attempts, ``absorbed_cost`` the cost of attempts nobody is billed for.
Figures that do not add (quantiles, sessions, savings of unpriced attempts) are computed for each row, and for the
totals, from the attempts themselves (``attempts``, ``savings``). Money stays exact (``Decimal``) in rows; only
frozen statements and payouts round (see ``periods``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, and_, case, func, literal, select, type_coerce

from kvroute.billing.catalog import Catalog
from kvroute.billing.events import STATUSES
from kvroute.billing.models import Money, UsageAdjustmentRow, UsageEventRow, UsageEventTagRow
from kvroute.billing.money import ZERO, fix
from kvroute.billing.reports import attempts, causes, savings
from kvroute.billing.reports.grouping import NONE, Grouping, column_sql
from kvroute.billing.reports.lines import Lines
from kvroute.billing.reports.scope import Scope

E, A, T = UsageEventRow, UsageAdjustmentRow, UsageEventTagRow
TOKENS = ("input_tokens_uncached", "cache_read_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens",
          "output_tokens", "reasoning_tokens")
#: Failed attempts (final or not) counted per status: ``failed_<status>``.
FAILURES = tuple(s for s in STATUSES if s != "success")
FAILED = tuple(f"failed_{s}" for s in FAILURES)
COUNTS = ("requests_total", "requests_success", "requests_failed", "requests_with_fallback", "attempts_absorbed",
          "late_requests", "unpriced_events", "rerated_events", "self_hosted_requests", "hosted_requests",
          "hedged_requests", "hedge_wins", *FAILED)
ABSORBED = tuple(causes.COLUMNS[c] for c in causes.CAUSES)
#: The spend split: all cost (billed + absorbed) of self-hosted backends vs hosted (overflow) ones, by the route kind
#: each event was rated with (the price file's for a backend it declares, see ``Catalog.resolve``).
SPLIT = ("self_hosted_cost", "hosted_cost")
EVENT_MONEY = ("provider_cost", "absorbed_cost", *ABSORBED, "hedge_cost", *SPLIT, "markup_amount", "fee_amount",
               "billed_amount", "adjustments")
FEES = ("platform_fee", "payment_fee")
#: Every column that adds up across rows (the totals of these are sums).
ADDITIVE = (*COUNTS, *TOKENS, *EVENT_MONEY, *FEES)


def period_start(period: str) -> datetime:
    return datetime(int(period[:4]), int(period[5:7]), 1, tzinfo=UTC)


def _msum(expr: Any) -> Any:
    return type_coerce(func.coalesce(func.sum(type_coerce(expr, Money())), 0), Money())


def _count(cond: Any) -> Any:
    return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)


def _self_hosted(event: Any = E) -> Any:
    """True where the event was rated as self-hosted: its own ``route_kind``, which the ledger took from the price
    file's backend entry when there was one (``Catalog.resolve``), so the split and the row's rule agree."""
    return event.route_kind == "self_hosted"


def _event_partials(conn: Connection, lines: Lines) -> dict[tuple, dict[str, Any]]:
    zero = type_coerce(0, Money())
    on_time = E.period == E.booked_period
    month_scope = lines.scope.is_month

    def own(expr: Any) -> Any:  # a month: money of events booked in their own period (late ones come as adjustments)
        return _msum(case((on_time, expr), else_=zero)) if month_scope else _msum(expr)

    final = E.is_final_attempt.is_(True)
    cause = causes.cause_of(E)
    lost = causes.hedge_lost(E)
    query = lines.events(
        _count(final).label("requests_total"),
        _count(and_(final, E.status == "success")).label("requests_success"),
        _count(and_(final, E.status != "success")).label("requests_failed"),
        _count(and_(final, E.fallback_depth > 0)).label("requests_with_fallback"),
        _count(and_(E.is_final_attempt.is_(False), E.absorbed_cost > zero)).label("attempts_absorbed"),
        _count(and_(final, E.period != E.booked_period)).label("late_requests"),
        _count(E.cost_source == "unknown").label("unpriced_events"),
        _count(E.rerate_run_id.is_not(None)).label("rerated_events"),
        _count(and_(final, _self_hosted())).label("self_hosted_requests"),
        _count(and_(final, ~_self_hosted())).label("hosted_requests"),
        _count(lost).label("hedged_requests"),  # one losing attempt per hedged request
        _count(and_(lost, causes.lost_by_primary(E))).label("hedge_wins"),
        *[_count(E.status == s).label(f"failed_{s}") for s in FAILURES],
        *[func.coalesce(func.sum(getattr(E, c if c != "input_tokens_uncached" else "input_uncached_tokens")), 0)
          .label(c) for c in TOKENS],
        own(E.provider_cost - E.absorbed_cost).label("provider_cost"),
        own(E.absorbed_cost).label("absorbed_cost"),
        *[own(case((E.absorbed_cost == zero, zero), (cause == c, E.absorbed_cost), else_=zero))  # cause: absorbed only
          .label(causes.COLUMNS[c]) for c in causes.CAUSES],
        own(case((lost, E.provider_cost), else_=zero)).label("hedge_cost"),  # the losers' cost, billed or not
        own(E.markup_amount + E.surcharge_amount).label("markup_amount"),
        own(E.fee_amount).label("fee_amount"),
        own(E.billed_amount).label("billed_amount"),
        own(case((_self_hosted(), E.provider_cost), else_=zero)).label("self_hosted_cost"),
        own(case((_self_hosted(), zero), else_=E.provider_cost)).label("hosted_cost"),
    ).group_by(*lines.key_columns())
    n = lines.width()
    out = {}
    for r in conn.execute(query):
        row = {**dict(r._mapping), "adjustments": ZERO}
        for c in (*COUNTS, *TOKENS):  # PostgreSQL sums bigints as numeric
            row[c] = int(row[c])
        out[tuple(r[:n])] = row
    return out


def _add_adjustments(conn: Connection, lines: Lines, partials: dict[tuple, dict[str, Any]]) -> None:
    """Book the scope's adjustments into the partials of their events' row columns (placeholders without one)."""
    scope = lines.scope
    if scope.is_month:
        where = [A.period == scope.period]
        month: Any = A.period
    else:  # days: a closed month's re-rate correction counts on its attempt's day (late events count as themselves)
        where = [A.kind == "rerate", *scope.occurred(E.occurred_at)]
        month = E.period
    if lines.app is not None:
        where.append(A.app_id == lines.app)
    placeholder = {"served_model": "(adjustment)", "end_user": NONE, "api_key_hash": NONE, "session_id": NONE,
                   "tag": NONE, "day": NONE}
    dims = [func.coalesce(column_sql(c), literal(placeholder.get(c, "-"))).label(c) for c in lines.columns]
    query = select(A.app_id, *dims, A.currency, month.label("month"),
                   type_coerce(A.delta_billed_amount, Money()).label("billed"),
                   type_coerce(A.delta_provider_cost, Money()).label("cost"),
                   type_coerce(A.delta_absorbed_cost, Money()).label("absorbed"),
                   type_coerce(A.delta_markup_amount, Money()).label("markup"), A.kind,
                   _self_hosted().label("self_hosted"), causes.cause_of(E).label("cause")).select_from(A).outerjoin(
        E, E.event_id == A.event_id)
    if lines.grouping.by_tag:
        query = query.outerjoin(T, T.event_id == E.event_id)
    for r in conn.execute(query.where(*where)):
        key = tuple(r[:lines.width()])
        row = partials.get(key)
        if row is None:
            row = partials[key] = _empty(lines, key)
        row["adjustments"] += r.billed
        row["rerated_events"] += r.kind == "rerate"  # a closed month's event re-rated: its correction lands here
        row["billed_amount"] += r.billed
        row["provider_cost"] += r.cost
        row["absorbed_cost"] += r.absorbed
        row[causes.COLUMNS[r.cause]] += r.absorbed
        row["markup_amount"] += r.markup
        row["fee_amount"] += r.billed - r.cost - r.markup  # what the delta bills beyond cost and markup
        row["self_hosted_cost" if r.self_hosted else "hosted_cost"] += r.cost + r.absorbed


def _empty(lines: Lines, key: tuple) -> dict[str, Any]:
    row: dict[str, Any] = dict(zip(("app_id", *lines.columns, "currency", "month"), key, strict=True))
    row.update({c: 0 for c in (*COUNTS, *TOKENS)})
    row.update({m: ZERO for m in EVENT_MONEY})
    return row


def _rules(conn: Connection, lines: Lines) -> dict[tuple, set[tuple[int, int]]]:
    rules: dict[tuple, set[tuple[int, int]]] = defaultdict(set)
    query = lines.events(E.price_rule_id, E.price_book_version).where(E.price_rule_id.is_not(None)).distinct()
    for r in conn.execute(query):
        rules[tuple(r[:lines.width()])].add((r.price_rule_id, r.price_book_version))
    return rules


def _with_fees(partials: dict[tuple, dict[str, Any]], catalog: Catalog) -> None:
    """Platform and payment fee of each partial: its billed amount × the app's percentages of its month, exact
    (never rounded here, so rows of any grouping add up to the same totals; frozen statements round)."""
    for row in partials.values():
        platform_pct, payment_pct = catalog.platform_fee_pct(row["app_id"], period_start(row["month"]))
        row["platform_fee"] = row["billed_amount"] * platform_pct
        row["payment_fee"] = row["billed_amount"] * payment_pct


def build_rows(conn: Connection, catalog: Catalog, scope: Scope, grouping: Grouping, app: str | None = None,
               total: bool = False) -> list[dict[str, Any]]:
    """The rows of a report (``total``: one row per currency, ``app_id`` ``TOTAL``), every column computed."""
    lines = Lines(scope, Grouping() if total else grouping, app)
    partials = _event_partials(conn, lines)
    _add_adjustments(conn, lines, partials)
    _with_fees(partials, catalog)
    rules = _rules(conn, lines)
    cols = lines.columns

    def row_key(partial: tuple) -> tuple:  # (app, *columns, currency), or (currency,) for the totals
        return (partial[-2],) if total else partial[:-1]

    rows: dict[tuple, dict[str, Any]] = {}
    shares: dict[tuple, dict[tuple, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for key, part in partials.items():
        rk = row_key(key)
        row = rows.get(rk)
        if row is None:
            label = {"app_id": "TOTAL"} if total else dict(zip(("app_id", *cols), key, strict=False))
            row = rows[rk] = {"period": scope.label, **label, "currency": part["currency"],
                              **{c: 0 for c in (*COUNTS, *TOKENS)}, **{m: ZERO for m in (*EVENT_MONEY, *FEES)},
                              "rules": set()}
        for c in ADDITIVE:
            row[c] += part[c]
        row["rules"] |= rules.get(key, set())
        shares[rk][(part["app_id"], part["month"])] += (part["markup_amount"] + part["fee_amount"]
                                                        - part["platform_fee"] - part["payment_fee"])
    savings.add(conn, catalog, lines, rows, row_key)
    attempts.add(conn, lines, rows, row_key)
    whole = total or grouping.whole_apps
    out = []
    for rk in sorted(rows):
        row = rows[rk]
        _finish(row, catalog)
        row["payout_amount"] = sum((max(ZERO, s) for s in shares[rk].values()), ZERO) if whole else None
        out.append(row)
    return out


def _finish(row: dict[str, Any], catalog: Catalog) -> None:
    """Derived columns: cache hit ratio, error rate, cost per request, pricing rule text, margin, payout share."""
    prompt = (row["input_tokens_uncached"] + row["cache_read_tokens"] + row["cache_write_5m_tokens"]
              + row["cache_write_1h_tokens"])
    row["cache_hit_ratio"] = round(row["cache_read_tokens"] / prompt, 4) if prompt else 0.0
    requests = row["requests_total"]
    row["error_rate"] = round(row["requests_failed"] / requests, 4) if requests else None
    spend = row["spend"] = row["provider_cost"] + row["absorbed_cost"]
    row["cost_per_request"] = fix(spend / requests) if requests else None
    described = []
    rules = sorted(row.pop("rules", ()))
    row["price_book_versions"] = sorted({v for _, v in rules})
    for rule_id, version in rules:
        found = catalog.rules_by_id.get(rule_id)
        if found:
            described.append(f"{found[1].describe()} (v{version})")
    row["pricing_rule"] = "; ".join(described) if described else "at cost"
    if row["unpriced_events"]:
        row["pricing_rule"] += f"; UNPRICED: {row['unpriced_events']} event(s) at cost 0"
    if row["rerated_events"]:
        row["pricing_rule"] += f"; RE-RATED: {row['rerated_events']} event(s) (kvroute billing rerate)"
    billed = row["billed_amount"]
    fees = row["platform_fee"] + row["payment_fee"]
    row["margin_amount"] = billed - row["provider_cost"] - row["absorbed_cost"] - fees
    row["margin_pct"] = (row["margin_amount"] / billed * 100).quantize(Decimal("0.01")) if billed else None
    row["payout_share"] = row["markup_amount"] + row["fee_amount"] - fees


def totals(rows: Iterable[dict[str, Any]], label_column: str = "app_id") -> list[dict[str, Any]]:
    """One row per currency summing the additive columns of ``rows`` that partition the ledger (not ``--by tag``,
    where a request counts in each of its tags' rows), ratios recomputed; payouts floored per app and month as in
    the rows (``payout_amount`` of whole-app rows, else each app's ``payout_share`` summed, then floored)."""
    by_currency: dict[str, dict[str, Any]] = {}
    per_app: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for row in rows:
        t = by_currency.setdefault(row["currency"], {"period": row["period"], label_column: "TOTAL",
                                                     "currency": row["currency"]})
        for k in ADDITIVE:
            if k in row:
                t[k] = t.get(k, 0 if k in (*COUNTS, *TOKENS) else ZERO) + (row[k] if row[k] is not None else 0)
        if row.get("payout_amount") is not None:
            per_app[(row["currency"], row[label_column])] += row["payout_amount"]
        elif "payout_share" in row:
            per_app[(row["currency"], row[label_column])] += row["payout_share"]
    for currency, t in by_currency.items():
        prompt = sum(t.get(k, 0) for k in TOKENS[:4])
        t["cache_hit_ratio"] = round(t.get("cache_read_tokens", 0) / prompt, 4) if prompt else 0.0
        billed = t.get("billed_amount", ZERO)
        if "platform_fee" in t:
            fees = t["platform_fee"] + t["payment_fee"]
            t["margin_amount"] = billed - t["provider_cost"] - t["absorbed_cost"] - fees
            t["margin_pct"] = (t["margin_amount"] / billed * 100).quantize(Decimal("0.01")) if billed else None
            t["payout_share"] = t["markup_amount"] + t["fee_amount"] - fees
            t["payout_amount"] = sum((max(ZERO, v) for (c, _), v in per_app.items() if c == currency), ZERO)
    return list(by_currency.values())
