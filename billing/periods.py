"""Billing periods: close with a grace window, freeze statements (rounded lines, residuals kept) and payouts.

``open`` → ``closing`` (the period ended, events still land until ``grace_until``) → ``closed`` (statements and
payouts frozen). Events for a closed period are booked as ``late_event`` adjustments in the open period by the
ledger, and a re-rate of a closed period as ``rerate`` adjustments (``kvroute.billing.rerate``); nothing frozen is
edited in place.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import insert, select, text, update

from kvroute.billing.ledger import ALL_APPS, Ledger, next_period
from kvroute.billing.models import (
    BillingPeriodRow,
    PayoutRow,
    StatementLineRow,
    StatementRow,
    UsageAdjustmentRow,
    UsageEventRow,
)
from kvroute.billing.money import ZERO, round_money
from kvroute.billing.reports import Grouping, Scope, build_rows, period_start
from kvroute.billing.reports.scope import check_period
from kvroute.policies.errors import InputError


@dataclass(frozen=True)
class CloseResult:
    period: str
    status: str  # closing | closed
    grace_until: datetime
    statements: int
    apps: tuple[str, ...]


def allocate(amounts: list[Decimal], currency: str) -> list[Decimal]:
    """Round line amounts half-even so their sum equals the rounded total (residual carried line to line)."""
    out, cumulative, rounded_so_far = [], ZERO, ZERO
    for amount in amounts:
        cumulative += amount
        target = round_money(cumulative, currency)
        out.append(target - rounded_so_far)
        rounded_so_far = target
    return out


def close_period(ledger: Ledger, period: str, *, grace_hours: float = 72.0, app: str | None = None,
                 force: bool = False, now: datetime | None = None) -> CloseResult:
    """Close ``period`` (all apps, or one): ``closing`` inside the grace window, else freeze and ``closed``."""
    check_period(period)
    now = now or datetime.now(UTC)
    end = period_start(next_period(period))
    grace_until = end + timedelta(hours=grace_hours)
    if now < end and not force:
        raise InputError("--period", f"{period} has not ended yet (ends {end.isoformat()})")
    scope = app or ALL_APPS
    if now < grace_until and not force:
        with ledger.engine.begin() as conn:
            _lock(ledger, conn)
            _upsert_status(conn, scope, period, "closing", grace_until, None, None)
        return CloseResult(period, "closing", grace_until, 0, ())
    catalog = ledger.catalog(refresh=True)
    with ledger.engine.begin() as conn:
        _lock(ledger, conn)
        closed = {a for (a,) in conn.execute(select(BillingPeriodRow.app_id).where(
            BillingPeriodRow.period == period, BillingPeriodRow.status == "closed"))}
        if ALL_APPS in closed or (app is not None and app in closed):
            return CloseResult(period, "closed", grace_until, 0, ())
        rows = [r for r in build_rows(conn, catalog, Scope.month(period), Grouping.parse("backend"), app)
                if r["app_id"] not in closed]
        by_app: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_app[(r["app_id"], r["currency"])].append(r)
        for (app_id, currency), lines in sorted(by_app.items()):
            _freeze(conn, catalog, period, app_id, currency, lines, now)
        apps = tuple(sorted({a for a, _ in by_app}))
        digest = hashlib.sha256(json.dumps(
            [[a, c, str(sum((r["billed_amount"] for r in ls), ZERO))]
             for (a, c), ls in sorted(by_app.items())]).encode()).hexdigest()
        for app_id in apps:
            _upsert_status(conn, app_id, period, "closed", grace_until, now, digest)
        if app is None:
            _upsert_status(conn, ALL_APPS, period, "closed", grace_until, now, digest)
    return CloseResult(period, "closed", grace_until, len(by_app), apps)


def _lock(ledger: Ledger, conn: Any) -> None:
    if ledger.engine.dialect.name == "postgresql":  # waits for inserts holding SHARE (see Ledger.insert_events)
        conn.execute(text("LOCK TABLE billing_period IN SHARE ROW EXCLUSIVE MODE"))


def _upsert_status(conn: Any, app_id: str, period: str, status: str, grace_until: datetime,
                   closed_at: datetime | None, digest: str | None) -> None:
    values = {"status": status, "grace_until": grace_until, "closed_at": closed_at, "totals_hash": digest}
    found = conn.execute(update(BillingPeriodRow).where(BillingPeriodRow.app_id == app_id,
                                                        BillingPeriodRow.period == period).values(**values))
    if found.rowcount == 0:
        conn.execute(insert(BillingPeriodRow).values(app_id=app_id, period=period, **values))


def _freeze(conn: Any, catalog: Any, period: str, app_id: str, currency: str, rows: list[dict[str, Any]],
            now: datetime) -> None:
    """Write the statement (rounded lines), its lines and the payout of one app and currency.

    Rounded like the report rows add up: cost, absorbed cost and fees round half-even on their own, the markup
    takes the rounding residual, so ``billed = cost + markup + fees`` and the payout formula hold to the cent.
    """
    adjustments = sum((r["adjustments"] for r in rows), ZERO)
    unrounded = [r["billed_amount"] - r["adjustments"] for r in rows]  # each line: its own events
    labels = [f"{r['served_model']}|{r['provider']}|{r['backend_id']}" for r in rows]
    quantities = [r["requests_total"] for r in rows]
    if adjustments:
        unrounded.append(adjustments)
        labels.append("adjustments")
        quantities.append(0)
    rounded = allocate(unrounded, currency)
    subtotal = round_money(sum(unrounded[:len(rows)], ZERO), currency)
    total = sum(rounded, ZERO)

    def rounded_sum(column: str) -> Decimal:
        return round_money(sum((r[column] for r in rows), ZERO), currency)

    cost, absorbed, fees = rounded_sum("provider_cost"), rounded_sum("absorbed_cost"), rounded_sum("fee_amount")
    markup = total - cost - fees
    platform_pct, payment_pct = catalog.platform_fee_pct(app_id, period_start(period))
    platform_fee = round_money(total * platform_pct, currency)
    payment_fee = round_money(total * payment_pct, currency)
    versions = sorted({v for r in rows for v in r.get("price_book_versions", [])})
    statement_id = conn.execute(insert(StatementRow).values(
        app_id=app_id, period=period, currency=currency, price_book_version_set=versions,
        subtotal_billed=subtotal, adjustments_total=total - subtotal, total_billed=total,
        total_unrounded=sum(unrounded, ZERO), provider_cost_total=cost, absorbed_cost_total=absorbed,
        platform_fee=platform_fee, payment_fee=payment_fee,
        margin_total=total - cost - absorbed - platform_fee - payment_fee,
        created_at=now, finalized_at=now).returning(StatementRow.statement_id)).scalar_one()
    conn.execute(insert(StatementLineRow), [
        {"statement_id": statement_id, "group_key": label, "currency": currency, "quantity": q, "unit": "request",
         "amount_unrounded": u, "amount_rounded": r, "rounding_residual": u - r}
        for label, q, u, r in zip(labels, quantities, unrounded, rounded, strict=True)])
    conn.execute(insert(PayoutRow).values(
        builder_id=app_id, app_id=app_id, period=period, currency=currency, gross_billed=total,
        provider_cost=cost, absorbed_cost=absorbed, platform_fee=platform_fee, payment_fee=payment_fee,
        markup_earned=markup, fee_amount=fees,
        payout_amount=max(ZERO, markup + fees - platform_fee - payment_fee), status="pending"))


def statement_totals(ledger: Ledger, period: str) -> dict[tuple[str, str], dict[str, Decimal]]:
    """``{(app, currency): {total_billed, total_unrounded, lines_rounded}}`` of a closed period (for checks)."""
    out = {}
    with ledger.engine.connect() as conn:
        for s in conn.execute(select(StatementRow.__table__).where(StatementRow.period == period)):
            lines = conn.execute(select(StatementLineRow.amount_rounded).where(
                StatementLineRow.statement_id == s.statement_id)).scalars().all()
            out[(s.app_id, s.currency)] = {"total_billed": s.total_billed, "total_unrounded": s.total_unrounded,
                                           "lines_rounded": sum(lines, ZERO)}
    return out


def ledger_sums(ledger: Ledger, period: str) -> dict[tuple[str, str], Decimal]:
    """Σ billed of events booked in ``period`` plus Σ adjustments there, per (app, currency), exact."""
    from kvroute.billing.reports import _msum
    E, A = UsageEventRow, UsageAdjustmentRow
    out: dict[tuple[str, str], Decimal] = defaultdict(lambda: ZERO)
    with ledger.engine.connect() as conn:
        for a, c, s in conn.execute(select(E.app_id, E.currency, _msum(E.billed_amount)).where(
                E.booked_period == period, E.period == period).group_by(E.app_id, E.currency)):
            out[(a, c)] += s
        for a, c, s in conn.execute(select(A.app_id, A.currency, _msum(A.delta_billed_amount)).where(
                A.period == period).group_by(A.app_id, A.currency)):
            out[(a, c)] += s
    return dict(out)
