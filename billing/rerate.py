"""Re-rating: price a month's events again under the price books and rate cards loaded now.

After a price fix (a new book version) or a late ``load-prices`` (events booked before it sit at cost 0, UNPRICED),
``plan_rerate`` rates every event of the month as ``Ledger.insert_events`` would today and lists what changes per
app × backend (a dry run writes nothing). ``apply_rerate`` writes it in one transaction with a ``rerate_run`` row
(who, when, the diff):

- an *open* month's events are re-priced in place and carry the run's id (``rerate_run_id``; reports count them
  in ``rerated_events`` and say ``RE-RATED`` in the pricing rule);
- a *closed* (frozen) month is never edited: each changed event gets a ``rerate`` adjustment of the difference,
  booked into the next open period like a late event, so it lands on the next open statement.

Rating is a function of the event and the catalog, so a second run with the same catalog changes nothing.
Currencies are never converted: a book whose currency differs from the one an event was billed in is refused.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, text, update

from kvroute.billing.catalog import Catalog
from kvroute.billing.events import UsageEvent, period_of
from kvroute.billing.ledger import ADJUSTMENT, EVENT, Ledger, event_row, is_closed, next_period
from kvroute.billing.models import BillingPeriodRow, RerateRunRow, UsageAdjustmentRow
from kvroute.billing.money import ZERO
from kvroute.billing.usage import TokenBuckets
from kvroute.policies.errors import InputError

#: The columns a re-rate may change on an open month's event: its money, and the provider and route kind it is rated
#: under (the price file's once it declares the backend, so a late ``load-prices`` renames an open month's rows too).
RATED = ("provider", "route_kind", "provider_cost_computed", "provider_cost", "absorbed_cost", "cost_source",
         "cost_rate_id", "price_book_id", "price_book_version", "price_rule_id", "markup_amount", "surcharge_amount",
         "fee_amount", "billed_amount", "currency")
_READ = ("event_id", "request_id", "attempt_no", "is_final_attempt", "app_id", "occurred_at", "period",
         "booked_period", "served_model", "backend_id", "status", "input_uncached_tokens",
         "cache_read_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens", "output_tokens", "reasoning_tokens",
         "provider_cost_reported", "litellm_cost", *RATED)


@dataclass(frozen=True)
class Money5:
    """What an event bills, split as the reports split it: cost of billed attempts, absorbed cost, markup (with
    surcharges), per-request fees, billed (= cost + markup + fees)."""

    cost: Decimal = ZERO
    absorbed: Decimal = ZERO
    markup: Decimal = ZERO
    fee: Decimal = ZERO
    billed: Decimal = ZERO

    @classmethod
    def of(cls, row: Any) -> Money5:
        return cls(row["provider_cost"] - row["absorbed_cost"], row["absorbed_cost"],
                   row["markup_amount"] + row["surcharge_amount"], row["fee_amount"], row["billed_amount"])

    def __add__(self, o: Money5) -> Money5:
        return Money5(self.cost + o.cost, self.absorbed + o.absorbed, self.markup + o.markup, self.fee + o.fee,
                      self.billed + o.billed)

    def __sub__(self, o: Money5) -> Money5:
        return Money5(self.cost - o.cost, self.absorbed - o.absorbed, self.markup - o.markup, self.fee - o.fee,
                      self.billed - o.billed)


@dataclass
class RerateLine:
    """The change of one app × backend × currency: events that change, money before and after, where it lands
    (``in place`` for an open month, else the open period its adjustments are booked into)."""

    app_id: str
    backend_id: str
    currency: str
    lands: str
    events: int = 0
    unpriced_before: int = 0
    unpriced_after: int = 0
    old: Money5 = field(default_factory=Money5)
    new: Money5 = field(default_factory=Money5)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"app_id": self.app_id, "backend_id": self.backend_id, "currency": self.currency,
                               "lands": self.lands, "events": self.events,
                               "unpriced_before": self.unpriced_before, "unpriced_after": self.unpriced_after}
        for side, m in (("old", self.old), ("new", self.new)):
            for k in ("cost", "absorbed", "markup", "fee", "billed"):
                out[f"{side}_{k}"] = f"{getattr(m, k).normalize():f}"
        return out


@dataclass
class ReratePlan:
    """What a re-rate of ``period`` (one app, or all) would change; ``events_checked`` counts every event read."""

    period: str
    app_id: str | None
    events_checked: int = 0
    lines: list[RerateLine] = field(default_factory=list)
    in_place: list[dict[str, Any]] = field(default_factory=list)  # new rated values of open-month events
    adjustments: list[dict[str, Any]] = field(default_factory=list)  # rerate adjustments of closed-month events

    @property
    def events_changed(self) -> int:
        return sum(line.events for line in self.lines)


@dataclass(frozen=True)
class RerateResult:
    run_id: int | None  # None: nothing changed, nothing written
    plan: ReratePlan
    created_by: str
    created_at: datetime


def _event_of(row: Any) -> UsageEvent:
    """The usage event a stored row was rated from (the fields rating reads)."""
    reported = row["provider_cost_reported"]
    return UsageEvent(request_id=row["request_id"], app_id=row["app_id"], occurred_at=row["occurred_at"],
                      served_model=row["served_model"], provider=row["provider"], backend_id=row["backend_id"],
                      route_kind=row["route_kind"], attempt=row["attempt_no"], is_final=row["is_final_attempt"],
                      status=row["status"], currency=row["currency"], provider_cost=reported,
                      litellm_cost=row["litellm_cost"],
                      tokens=TokenBuckets(row["input_uncached_tokens"], row["cache_read_tokens"],
                                          row["cache_write_5m_tokens"], row["cache_write_1h_tokens"],
                                          row["output_tokens"], row["reasoning_tokens"]))


def _closed(conn: Connection) -> set[tuple[str, str]]:
    bp = BillingPeriodRow
    return {(a, p) for a, p in conn.execute(select(bp.app_id, bp.period).where(bp.status == "closed"))}


def _landing(closed: set[tuple[str, str]], app_id: str, period: str, now: datetime) -> str:
    """The open period a closed period's correction is booked into (as for late events)."""
    booked = max(period_of(now), next_period(period))
    while is_closed(closed, app_id, booked):
        booked = next_period(booked)
    return booked


def plan_rerate(conn: Connection, catalog: Catalog, period: str, app_id: str | None = None,
                now: datetime | None = None) -> ReratePlan:
    """Rate every event of ``period`` (by when it occurred) again with ``catalog``; nothing is written."""
    now = now or datetime.now(UTC)
    plan = ReratePlan(period, app_id)
    closed = _closed(conn)
    where = [EVENT.c.period == period] + ([EVENT.c.app_id == app_id] if app_id is not None else [])
    rows = [r._mapping for r in conn.execute(select(*[EVENT.c[c] for c in _READ]).where(*where)
                                             .order_by(EVENT.c.event_id))]
    plan.events_checked = len(rows)
    closed_ids = [r["event_id"] for r in rows if is_closed(closed, r["app_id"], period)]
    earlier = _earlier_corrections(conn, closed_ids)
    lines: dict[tuple[str, str, str], RerateLine] = {}
    for row in rows:
        try:
            new = event_row(_event_of(row), catalog, now, period)
        except InputError as exc:
            raise InputError(exc.where, f"event {row['event_id']} (app {row['app_id']!r}, backend "
                                        f"{row['backend_id']!r}): {exc.message}") from None
        if new["currency"] != row["currency"]:
            raise InputError("currency", f"app {row['app_id']!r} is now billed in {new['currency']} but event "
                                         f"{row['event_id']} was billed in {row['currency']}; re-rating never "
                                         "converts (give the new book the old currency)")
        frozen = is_closed(closed, row["app_id"], period)
        old_money = Money5.of(row) + earlier.get(row["event_id"], Money5())
        new_money = Money5.of(new)
        if frozen:
            if new_money == old_money:
                continue
            lands = _landing(closed, row["app_id"], period, now)
            plan.adjustments.append(_adjustment(row, new_money - old_money, lands, now))
        else:
            if all(new[c] == row[c] for c in RATED):
                continue
            lands = "in place"
            plan.in_place.append({"b_event_id": row["event_id"], **{c: new[c] for c in RATED}})
        key = (row["app_id"], row["backend_id"], row["currency"])
        line = lines.get(key)
        if line is None:
            line = lines[key] = RerateLine(row["app_id"], row["backend_id"], row["currency"], lands)
        elif line.lands != lands:
            line.lands = "mixed"
        line.events += 1
        line.unpriced_before += row["cost_source"] == "unknown"
        line.unpriced_after += new["cost_source"] == "unknown"
        line.old += old_money
        line.new += new_money
    plan.lines = [lines[k] for k in sorted(lines)]
    return plan


def _earlier_corrections(conn: Connection, event_ids: list[str]) -> dict[str, Money5]:
    """Σ of earlier ``rerate`` adjustments per event (what a frozen event bills now is its row plus these)."""
    out: dict[str, Money5] = defaultdict(Money5)
    A = UsageAdjustmentRow
    for k in range(0, len(event_ids), 10000):
        for r in conn.execute(select(A.event_id, A.delta_provider_cost, A.delta_absorbed_cost, A.delta_markup_amount,
                                     A.delta_billed_amount).where(A.kind == "rerate",
                                                                  A.event_id.in_(event_ids[k:k + 10000]))):
            fee = r.delta_billed_amount - r.delta_provider_cost - r.delta_markup_amount
            out[r.event_id] += Money5(r.delta_provider_cost, r.delta_absorbed_cost, r.delta_markup_amount, fee,
                                      r.delta_billed_amount)
    return out


def _adjustment(row: Any, delta: Money5, lands: str, now: datetime) -> dict[str, Any]:
    return {"event_id": row["event_id"], "app_id": row["app_id"], "period": lands, "original_period": row["period"],
            "kind": "rerate", "delta_provider_cost": delta.cost, "delta_absorbed_cost": delta.absorbed,
            "delta_billed_amount": delta.billed, "delta_markup_amount": delta.markup, "delta_tokens": None,
            "currency": row["currency"], "created_at": now}


def apply_rerate(ledger: Ledger, period: str, app_id: str | None = None, *, created_by: str,
                 now: datetime | None = None) -> RerateResult:
    """Plan and write the re-rate in one transaction (the plan is made again under the lock, so it is exactly
    what is written); nothing changes → nothing is written and ``run_id`` is None."""
    now = now or datetime.now(UTC)
    catalog = ledger.catalog(refresh=True)
    with ledger.engine.begin() as conn:
        if ledger.engine.dialect.name == "postgresql":  # no insert or period close in between (see periods.py)
            conn.execute(text("LOCK TABLE billing_period IN SHARE ROW EXCLUSIVE MODE"))
        plan = plan_rerate(conn, catalog, period, app_id, now)
        if not plan.lines:
            return RerateResult(None, plan, created_by, now)
        run_id = conn.execute(insert(RerateRunRow).values(
            period=period, app_id=app_id, created_by=created_by, created_at=now, events_rerated=len(plan.in_place),
            adjustments_booked=len(plan.adjustments), summary=[line.as_json() for line in plan.lines])
            .returning(RerateRunRow.rerate_run_id)).scalar_one()
        if plan.in_place:
            conn.execute(update(EVENT).where(EVENT.c.event_id == bindparam("b_event_id"))
                         .values({c: bindparam(c) for c in (*RATED, "rerate_run_id")}),
                         [{**r, "rerate_run_id": run_id} for r in plan.in_place])
        if plan.adjustments:
            conn.execute(insert(ADJUSTMENT), [
                {**a, "adjustment_id": hashlib.sha256(f"rerate|{run_id}|{a['event_id']}".encode()).hexdigest()[:32],
                 "reason": f"re-rated (run {run_id}) after {period} was closed", "created_by": created_by,
                 "rerate_run_id": run_id} for a in plan.adjustments])
    return RerateResult(run_id, plan, created_by, now)


def render_plan(plan: ReratePlan) -> Iterable[str]:
    """The diff as text lines: per app × backend the events that change and cost / markup / fees / billed, old → new."""
    head = (f"{'app':<14} {'backend':<18} {'events':>6}  {'cost old → new':<27} {'markup old → new':<27} "
            f"{'billed old → new':<27} {'Δ billed':>12}  lands")
    yield head
    totals: dict[str, list[Money5]] = {}
    for line in plan.lines:
        o, n = line.old, line.new
        unpriced = f"  (UNPRICED {line.unpriced_before} → {line.unpriced_after})" \
            if line.unpriced_before or line.unpriced_after else ""
        cost, delta = _pair(o.cost + o.absorbed, n.cost + n.absorbed), _signed(n.billed - o.billed)
        yield (f"{line.app_id:<14} {line.backend_id:<18} {line.events:>6}  {cost} {_pair(o.markup, n.markup)} "
               f"{_pair(o.billed, n.billed)} {delta:>12}  {line.lands} {line.currency}{unpriced}")
        t = totals.setdefault(line.currency, [Money5(), Money5()])
        t[0] += o
        t[1] += n
    for currency, (o, n) in sorted(totals.items()):
        yield (f"{'TOTAL':<14} {'':<18} {'':>6}  {_pair(o.cost + o.absorbed, n.cost + n.absorbed)} "
               f"{_pair(o.markup, n.markup)} {_pair(o.billed, n.billed)} {_signed(n.billed - o.billed):>12}  "
               f"{currency}")


def _amount(d: Decimal) -> str:
    return f"{d.quantize(Decimal('1e-6')).normalize():f}" if d else "0"


def _pair(old: Decimal, new: Decimal) -> str:
    return f"{_amount(old)} → {_amount(new)}".ljust(27)


def _signed(d: Decimal) -> str:
    return ("+" if d > 0 else "") + _amount(d)
