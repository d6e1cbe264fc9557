"""A customer statement of one app's month: what its customer (or one end user) is billed, line by line.

One line per served model × token bucket (``input``, ``cache_read``, ``cache_write_5m``, ``cache_write_1h``,
``output``) plus one ``requests`` line per model (per-request fees, minimum/maximum charges), each with its quantity,
unit price and amount; then the adjustments booked in the month, itemised with the month they come from; then
the total. Nothing internal: no provider cost, markup, margin, fee to the platform or payout.

How an attempt's billed amount becomes lines: its cost and markup are split over its token buckets in proportion
to what each bucket costs on the rate card it was rated with (by token count where it had none), its surcharges
go to the bucket they price, and the rest (fees, a minimum or maximum charge) to ``requests``; so the lines of
each attempt add up to its billed amount exactly. A line's unit price is its exact amount per 1M tokens (per
request for ``requests``); amounts round half-even to the currency's minor unit with the residual carried line to
line, so the lines add up to the rounded total to the cent. A closed month's number, issue date and total are the
frozen statement's (``close-period``), and its lines must add up to that total.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, and_, select, type_coerce

from kvroute.billing.catalog import Catalog
from kvroute.billing.ledger import next_period
from kvroute.billing.models import Money, StatementRow, UsageAdjustmentRow, UsageEventRow
from kvroute.billing.money import MILLION, ZERO, fix
from kvroute.billing.periods import allocate
from kvroute.billing.pricing import SURCHARGE_BUCKETS, CostRate
from kvroute.billing.reports.scope import check_period
from kvroute.billing.usage import BUCKETS
from kvroute.policies.errors import InputError

E, A = UsageEventRow, UsageAdjustmentRow
#: Statement buckets: the ledger's token buckets (reasoning is part of output) and their labels.
TOKEN_BUCKETS = tuple(b for b in BUCKETS if b != "reasoning")
LABELS = {"input_uncached": "input", "cache_read": "cached input", "cache_write_5m": "cache write (5 min)",
          "cache_write_1h": "cache write (1 h)", "output": "output", "requests": "requests"}
_COLUMN = {"input_uncached": "input_uncached_tokens", "cache_read": "cache_read_tokens",
           "cache_write_5m": "cache_write_5m_tokens", "cache_write_1h": "cache_write_1h_tokens",
           "output": "output_tokens"}
_RATE = {"input_uncached": "input_per_mtok", "cache_read": "cache_read_per_mtok",
         "cache_write_5m": "cache_write_5m_per_mtok", "cache_write_1h": "cache_write_1h_per_mtok",
         "output": "output_per_mtok"}
ADJUSTMENT_WORDS = {"late_event": "usage of {month} that arrived after it closed",
                    "rerate": "price correction of {month}"}


@dataclass
class Line:
    """One line: ``quantity`` tokens (or requests) of ``bucket`` of ``model``, exact and rounded amounts."""

    model: str
    bucket: str
    quantity: int = 0
    exact: Decimal = ZERO
    amount: Decimal = ZERO

    @property
    def unit(self) -> str:
        return "request" if self.bucket == "requests" else "1M tokens"

    @property
    def unit_price(self) -> Decimal | None:
        """The exact amount per unit (per 1M tokens, or per request), to 1e-6."""
        if not self.quantity:
            return None
        per = Decimal(self.quantity) if self.bucket == "requests" else Decimal(self.quantity) / MILLION
        return (self.exact / per).quantize(Decimal("1e-6"))

    def as_dict(self) -> dict[str, Any]:
        return {"description": f"{self.model} · {LABELS[self.bucket]}", "model": self.model, "bucket": self.bucket,
                "quantity": self.quantity, "unit": self.unit, "unit_price": _text(self.unit_price),
                "amount": _text(self.amount)}


@dataclass
class Adjustment:
    kind: str
    from_period: str
    exact: Decimal = ZERO
    amount: Decimal = ZERO

    def as_dict(self) -> dict[str, Any]:
        words = ADJUSTMENT_WORDS.get(self.kind, "adjustment of {month}").format(month=self.from_period)
        return {"description": words[0].upper() + words[1:], "kind": self.kind, "from_period": self.from_period,
                "amount": _text(self.amount)}


@dataclass
class Statement:
    """A customer statement (see the module docstring); ``as_dict`` is its JSON form."""

    number: str
    status: str  # final (a closed month's frozen statement) | provisional
    app: str
    customer: str | None
    period: str
    currency: str
    issued: datetime
    lines: list[Line] = field(default_factory=list)
    adjustments: list[Adjustment] = field(default_factory=list)

    @property
    def subtotal(self) -> Decimal:
        return sum((line.amount for line in self.lines), ZERO)

    @property
    def adjustments_total(self) -> Decimal:
        return sum((a.amount for a in self.adjustments), ZERO)

    @property
    def total(self) -> Decimal:
        return self.subtotal + self.adjustments_total

    def as_dict(self) -> dict[str, Any]:
        end = next_period(self.period)
        return {"statement": self.number, "status": self.status, "app": self.app,
                "customer": self.customer if self.customer is not None else f"all customers of {self.app}",
                "period": self.period, "period_start": f"{self.period}-01", "period_end_exclusive": f"{end}-01",
                "issued": self.issued.date().isoformat(), "currency": self.currency,
                "lines": [line.as_dict() for line in self.lines],
                "adjustments": [a.as_dict() for a in self.adjustments], "subtotal": _text(self.subtotal),
                "adjustments_total": _text(self.adjustments_total), "total": _text(self.total)}


def _text(value: Decimal | None) -> str | None:
    return None if value is None else format(value, "f")


def split_billed(tokens: dict[str, int], cost: Decimal, markup: Decimal, surcharge: dict[str, Decimal],
                 billed: Decimal, card: CostRate | None) -> dict[str, Decimal]:
    """One billed attempt's amount per statement bucket (``requests`` included), adding up to ``billed``."""
    weights = {b: tokens[b] * getattr(card, _RATE[b]) for b in TOKEN_BUCKETS} if card is not None else {}
    if not any(weights.values()):
        weights = {b: Decimal(tokens[b]) for b in TOKEN_BUCKETS}
    total = sum(weights.values(), ZERO)
    out = dict.fromkeys((*TOKEN_BUCKETS, "requests"), ZERO)
    spread = cost + markup
    if total and spread:
        for b in TOKEN_BUCKETS:
            out[b] = fix(spread * weights[b] / total)
        out[max(TOKEN_BUCKETS, key=lambda b: weights[b])] += spread - sum(out[b] for b in TOKEN_BUCKETS)
    for b, amount in surcharge.items():
        out[b] += amount
    out["requests"] = billed - sum(out[b] for b in TOKEN_BUCKETS)
    return out


def _surcharges(rule: Any, tokens: dict[str, int]) -> dict[str, Decimal]:
    """The surcharge of each bucket under ``rule`` (the rating's total is ``fix`` of their sum: the residual is
    carried by the largest)."""
    if rule is None or not rule.surcharge_per_mtok:
        return {}
    out: dict[str, Decimal] = defaultdict(Decimal)
    for kind, rate in rule.surcharge_per_mtok.items():
        for b in SURCHARGE_BUCKETS[kind]:
            out[b] += tokens[b] * rate / MILLION
    return dict(out)


def build_statement(conn: Connection, catalog: Catalog, app: str, period: str, customer: str | None = None,
                    currency: str | None = None, now: datetime | None = None) -> Statement:
    """The statement of ``app``'s ``period`` (for one end user with ``customer``); ``InputError`` when there is
    nothing to state, or a closed month's events no longer add up to its frozen statement."""
    check_period(period)
    who = [E.end_user_id == customer] if customer is not None else []
    where = [E.app_id == app, E.booked_period == period, E.period == period, E.billed_amount != 0, *who]
    found = {c for (c,) in conn.execute(select(E.currency).where(E.app_id == app, E.booked_period == period, *who)
                                        .distinct())}
    found |= {c for (c,) in conn.execute(select(A.currency).where(A.app_id == app, A.period == period).distinct())}
    if currency is not None:
        found &= {currency}
    if not found:
        whom = f" for customer {customer!r}" if customer is not None else ""
        raise InputError("--app", f"app {app!r} has no usage booked in {period}{whom}")
    if len(found) > 1:
        raise InputError("--currency", f"app {app!r} is billed in {', '.join(sorted(found))} in {period}: name one")
    (cur,) = found
    lines: dict[tuple[str, str], Line] = {}
    money = [type_coerce(getattr(E, m), Money()).label(m) for m in ("provider_cost", "absorbed_cost",
                                                                     "markup_amount", "surcharge_amount",
                                                                     "billed_amount")]
    query = select(E.served_model, E.cost_rate_id, E.price_rule_id, *[getattr(E, c) for c in _COLUMN.values()],
                   *money).where(*where, E.currency == cur)
    for r in conn.execute(query):
        tokens = {b: getattr(r, c) for b, c in _COLUMN.items()}
        card = catalog.rates_by_id.get(r.cost_rate_id) if r.cost_rate_id is not None else None
        rule = catalog.rules_by_id.get(r.price_rule_id, (None, None))[1] if r.price_rule_id is not None else None
        surcharge = _surcharges(rule, tokens)
        if surcharge:  # the rating rounded the surcharges' sum: its residual goes to the largest
            biggest = max(surcharge, key=lambda b: surcharge[b])
            surcharge[biggest] += r.surcharge_amount - sum(surcharge.values(), ZERO)
        cost = r.provider_cost - r.absorbed_cost
        split = split_billed(tokens, cost, r.markup_amount, surcharge, r.billed_amount, card)
        for bucket, amount in split.items():
            quantity = 1 if bucket == "requests" else tokens[bucket]
            if not amount and not (bucket != "requests" and quantity):
                continue
            line = lines.setdefault((r.served_model, bucket), Line(r.served_model, bucket))
            line.quantity += quantity
            line.exact += amount
    adjustments: dict[tuple[str, str], Adjustment] = {}
    query = select(A.kind, A.original_period, type_coerce(A.delta_billed_amount, Money()).label("billed")).where(
        A.app_id == app, A.period == period, A.currency == cur)
    if customer is not None:
        query = query.join(E, and_(E.event_id == A.event_id, E.end_user_id == customer))
    for r in conn.execute(query):
        key = (r.kind, r.original_period or period)
        adjustments.setdefault(key, Adjustment(*key)).exact += r.billed
    ordered = [lines[k] for k in sorted(lines, key=lambda k: (k[0], _order(k[1])))]
    extra = [adjustments[k] for k in sorted(adjustments, key=lambda k: (k[1], k[0])) if adjustments[k].exact]
    for item, rounded in zip([*ordered, *extra], allocate([x.exact for x in (*ordered, *extra)], cur), strict=True):
        item.amount = rounded
    frozen = _frozen(conn, app, period, cur)
    exact = sum((x.exact for x in (*ordered, *extra)), ZERO)
    if frozen is not None and customer is None and exact != frozen.total_unrounded:
        raise InputError("--period", f"{period} is closed, but the ledger's billed amount for {app} ({exact}) is not "
                                     f"its frozen statement's ({frozen.total_unrounded})")
    number = _number(app, period, cur, frozen)
    if customer is not None:
        number += "-" + hashlib.sha256(customer.encode()).hexdigest()[:8]
    issued = frozen.finalized_at if frozen is not None and frozen.finalized_at else (now or datetime.now(UTC))
    statement = Statement(number, "final" if frozen is not None else "provisional", app, customer, period, cur,
                          issued, ordered, extra)
    if frozen is not None and customer is None and statement.total != frozen.total_billed:
        raise InputError("--period", f"{period}: the lines add up to {statement.total}, the frozen statement to "
                                     f"{frozen.total_billed}")
    return statement


def _order(bucket: str) -> int:
    return (*TOKEN_BUCKETS, "requests").index(bucket)


def _frozen(conn: Connection, app: str, period: str, currency: str) -> Any:
    return conn.execute(select(StatementRow.__table__).where(
        StatementRow.app_id == app, StatementRow.period == period, StatementRow.currency == currency)).first()


def _number(app: str, period: str, currency: str, frozen: Any) -> str:
    """``KVR-202610-00012`` (the frozen statement's id), or ``KVR-202611-<8 hex>-DRAFT`` for an open month."""
    month = period.replace("-", "")
    if frozen is not None:
        return f"KVR-{month}-{frozen.statement_id:05d}"
    return f"KVR-{month}-{hashlib.sha256(f'{app}|{currency}'.encode()).hexdigest()[:8]}-DRAFT"


def statement_rows(statement: Statement) -> list[dict[str, Any]]:
    """The statement as CSV rows: its lines, its adjustments, then the total (the header fields repeated)."""
    head = {"statement": statement.number, "period": statement.period, "app": statement.app,
            "customer": statement.as_dict()["customer"], "currency": statement.currency}
    rows = [{**head, **line.as_dict()} for line in statement.lines]
    rows += [{**head, "description": a.as_dict()["description"], "bucket": "adjustment", "amount": _text(a.amount)}
             for a in statement.adjustments]
    rows.append({**head, "description": "Total", "bucket": "total", "amount": _text(statement.total)})
    return rows


CSV_COLUMNS = ("statement", "period", "app", "customer", "description", "model", "bucket", "quantity", "unit",
               "unit_price", "amount", "currency")

