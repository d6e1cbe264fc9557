"""Reports reconcile on SQLite and PostgreSQL: every row adds up, adjustments are in usage,
margin and payouts alike, late events' tokens are counted where they are booked, provisional and frozen rows
mean the same, and ``--by end_user`` breaks a month down per end user."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from billing_helpers import PRICES, event
from hypothesis import given, settings
from hypothesis import strategies as st
from test_property import random_events, random_prices
from typer.testing import CliRunner

from kvroute.billing.cli import report_app
from kvroute.billing.ledger import Ledger
from kvroute.billing.periods import close_period
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.billing.pricing import rate_event
from kvroute.billing.reports import margin_report, payout_report, totals, usage_report
from kvroute.billing.usage import TokenBuckets

CENT = Decimal("0.01")
TOKEN_COLUMNS = {"input_tokens_uncached": "input_uncached", "cache_read_tokens": "cache_read",
                 "cache_write_5m_tokens": "cache_write_5m", "cache_write_1h_tokens": "cache_write_1h",
                 "output_tokens": "output", "reasoning_tokens": "reasoning"}
BILLING_DOC = Path(__file__).resolve().parents[2] / "docs" / "billing.md"


def fee_prices() -> dict[str, Any]:
    prices = copy.deepcopy(PRICES)
    acme = prices["price_books"][1]
    acme["payment_fee_pct"] = "0.03"
    acme["rules"][0]["fee_per_request"] = "0.002"
    return prices


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 10, 20, tzinfo=UTC))


@pytest.fixture
def month(db_url: str, clock: Clock):  # type: ignore[no-untyped-def]
    """October closed with 6 events; 3 late October events and 4 November events booked in November."""
    ledger = Ledger.open(db_url, clock=clock)
    store_prices(ledger, parse_price_data(fee_prices()))
    ledger.insert_events([event(i, provider_cost=Decimal("0.0333"), end_user=f"u{i % 2}") for i in range(4)]
                         + [event(10 + i, app_id="beta", provider_cost=Decimal("0.1")) for i in range(2)])
    clock.at = datetime(2026, 11, 5, tzinfo=UTC)
    assert close_period(ledger, "2026-10", now=clock.at, grace_hours=72).status == "closed"
    late = [event(20 + i, provider_cost=Decimal("0.0111"), end_user="u1",
                  occurred_at=datetime(2026, 10, 30, tzinfo=UTC), tokens=TokenBuckets(7, 11, 13, 0, 17, 5))
            for i in range(3)]
    november = [event(30 + i, provider_cost=Decimal("0.0222"), end_user="u0",
                      occurred_at=datetime(2026, 11, 6, tzinfo=UTC)) for i in range(3)]
    november.append(event(40, attempt=0, is_final=False, status="provider_failure", provider_cost=Decimal("0.005"),
                          occurred_at=datetime(2026, 11, 6, tzinfo=UTC)))
    ledger.insert_events(late + november)
    yield ledger, late, november
    ledger.close()


def rows_add_up(row: dict[str, Any]) -> None:
    """The formulas of docs/billing.md, exactly (provisional rows unrounded; frozen rows rounded and still add up)."""
    fees = row["platform_fee"] + row["payment_fee"]
    assert row["billed_amount"] == row["provider_cost"] + row["markup_amount"] + row["fee_amount"], row
    if "margin_amount" in row:
        assert row["margin_amount"] == row["billed_amount"] - row["provider_cost"] - row["absorbed_cost"] - fees
    if "payout_share" in row:  # margin: each row's share; the payout of a whole app's month floored at 0
        assert row["payout_share"] == row["markup_amount"] + row["fee_amount"] - fees
        if row["payout_amount"] is not None and row["app_id"] != "TOTAL":
            assert row["payout_amount"] == max(Decimal(0), row["payout_share"]), row
    else:  # payouts, provisional or frozen
        assert row["payout_amount"] == max(Decimal(0), row["markup_amount"] + row["fee_amount"] - fees), row


def test_late_events_tokens_are_in_the_usage_report(month) -> None:  # type: ignore[no-untyped-def]
    """Before: a late event's tokens were in no usage report (not October's, frozen; not November's)."""
    ledger, late, november = month
    with ledger.engine.connect() as conn:
        nov = usage_report(conn, ledger.catalog(), "2026-11")
    total = totals(nov)[0]
    for column, bucket in TOKEN_COLUMNS.items():
        assert total[column] == sum(getattr(e.tokens, bucket) for e in late + november), column
    assert total["late_requests"] == 3 and total["requests_total"] == 6


def test_every_margin_row_adds_up_with_adjustments_in_provider_cost(month) -> None:  # type: ignore[no-untyped-def]
    """Before: the provider-cost column left adjustments out and the markup column held the fees too, so
    ``billed = cost + markup + fees`` and the margin did not add up on rows with adjustments."""
    ledger, late, november = month
    catalog = ledger.catalog()
    with ledger.engine.connect() as conn:
        rows = margin_report(conn, catalog, "2026-11")
    claude = next(r for r in rows if r["app_id"] == "acme" and r["backend_id"] == "or-claude")
    rated = [rate_event(e, catalog.rate_for(e.backend_id, e.occurred_at), catalog.book_for(e.app_id, e.occurred_at))
             for e in late + november]
    assert claude["provider_cost"] == sum(r.provider_cost - r.absorbed_cost for r in rated)
    assert claude["absorbed_cost"] == sum(r.absorbed_cost for r in rated) == Decimal("0.005")
    assert claude["adjustments"] == sum(r.billed_amount for r in rated[:3])
    assert claude["billed_amount"] == sum(r.billed_amount for r in rated)
    assert claude["fee_amount"] == Decimal("0.002") * 6
    for row in [*rows, *totals(rows)]:
        rows_add_up(row)


def test_adjustments_are_the_same_in_usage_margin_and_payouts(month) -> None:  # type: ignore[no-untyped-def]
    ledger, _, _ = month
    with ledger.engine.connect() as conn:
        usage = totals(usage_report(conn, ledger.catalog(), "2026-11"))[0]
        margin = totals(margin_report(conn, ledger.catalog(), "2026-11"))[0]
        payouts = payout_report(conn, ledger.catalog(), "2026-11")
    assert usage["adjustments"] == margin["adjustments"] == sum(p["adjustments"] for p in payouts) > 0
    assert usage["provider_cost"] == margin["provider_cost"] == sum(p["provider_cost"] for p in payouts)


def test_provisional_and_frozen_payouts_mean_the_same(month, clock: Clock) -> None:  # type: ignore[no-untyped-def]
    """Before: the frozen ``billed_amount`` included the adjustments that the ``adjustments`` column listed again,
    while the provisional one left them out."""
    ledger, _, _ = month
    with ledger.engine.connect() as conn:
        provisional = {p["app_id"]: p for p in payout_report(conn, ledger.catalog(), "2026-11")}
    clock.at = datetime(2026, 12, 5, tzinfo=UTC)
    close_period(ledger, "2026-11", now=clock.at, grace_hours=72)
    with ledger.engine.connect() as conn:
        frozen = {p["app_id"]: p for p in payout_report(conn, ledger.catalog(), "2026-11")}
    assert set(frozen) == set(provisional) == {"acme"}
    p, f = provisional["acme"], frozen["acme"]
    assert p["status"] == "provisional" and f["status"] == "pending"
    for column in ("billed_amount", "provider_cost", "absorbed_cost", "fee_amount"):
        assert f[column] == p[column].quantize(CENT), column
    for column in ("platform_fee", "payment_fee"):  # frozen: a share of the rounded total
        assert abs(f[column] - p[column]) <= CENT, column
    assert abs(f["adjustments"] - p["adjustments"]) <= CENT
    assert abs(f["markup_amount"] - p["markup_amount"]) <= 3 * CENT  # it carries the rounding residual
    assert f["billed_amount"] - f["adjustments"] == (p["billed_amount"] - p["adjustments"]).quantize(CENT)
    rows_add_up(p)
    rows_add_up(f)
    assert p["payment_fee"] == (p["billed_amount"] * Decimal("0.03")).quantize(Decimal("1e-10")) > 0


def test_the_billing_guide_states_the_formulas() -> None:
    """Before: the payout subtracted a payment fee the README never mentioned (the formulas now live in
    docs/billing.md, which the README links)."""
    text = BILLING_DOC.read_text()
    section = text[text.index("## Reading the reports"):]
    section = section[:section.index("\n## ", 3)] if "\n## " in section[3:] else section
    flat = re.sub(r"\s+", " ", section)
    for formula in ("billed_amount = provider_cost + markup_amount + fee_amount",
                    "payout_share = markup_amount + fee_amount − platform_fee − payment_fee",
                    "payout_amount = max(0, payout_share)",
                    "spend = provider_cost + absorbed_cost = self_hosted_cost + hosted_cost",
                    "cache_savings = cache_read × (input_per_mtok − cache_read_per_mtok) / 1e6",
                    "margin_amount = billed_amount − provider_cost − absorbed_cost − platform_fee − payment_fee",
                    "payment_fee = billed_amount × payment_fee_pct"):
        assert formula in flat, formula


def test_breakdown_per_end_user(month, db_url: str) -> None:  # type: ignore[no-untyped-def]
    ledger, _, _ = month
    runner = CliRunner()
    r = runner.invoke(report_app, ["margin", "--period", "2026-11", "--by", "end_user", "--format", "json",
                                   "--db", db_url])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    by_user = {(row["app_id"], row["end_user"]): row for row in data["rows"]}
    assert set(by_user) == {("acme", "u0"), ("acme", "u1"), ("acme", "(none)")}
    assert "backend_id" not in data["rows"][0]
    assert by_user[("acme", "u1")]["late_requests"] == 3 and Decimal(by_user[("acme", "u1")]["adjustments"]) > 0
    assert by_user[("acme", "(none)")]["requests_total"] == 0  # the failed, non-final attempt
    with ledger.engine.connect() as conn:
        per_backend = totals(margin_report(conn, ledger.catalog(), "2026-11"))[0]
    assert Decimal(data["totals"][0]["billed_amount"]) == per_backend["billed_amount"]
    r = runner.invoke(report_app, ["usage", "--period", "2026-11", "--by", "end_user", "--db", db_url],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "by end_user" in r.output and "u1" in r.output
    r = runner.invoke(report_app, ["usage", "--period", "2026-11", "--by", "planet", "--db", db_url])
    assert r.exit_code == 2 and "--by: must be one or two of app, day, model, backend" in r.output


def run_reconciliation(url: str, n: int, seed: int) -> None:
    """Random events over two months (October closed, late October events, November provisional then frozen):
    every row of every report and grouping adds up, and the totals equal the sums over the events."""
    rng = random.Random(seed)
    now = datetime(2026, 11, 10, tzinfo=UTC)
    clock = Clock(now)
    ledger = Ledger.open(url, clock=clock)
    try:
        prices = random_prices(rng)
        for book in prices["price_books"]:
            if rng.random() < 0.5:
                book["payment_fee_pct"] = str(Decimal(rng.randrange(0, 500)).scaleb(-4))
        store_prices(ledger, parse_price_data(prices))
        catalog = ledger.catalog(refresh=True)

        def users(events: list[Any]) -> list[Any]:
            return [dataclasses.replace(e, end_user=rng.choice([None, "alice", "bob", "carol"])) for e in events]

        october = users(random_events(rng, n, datetime(2026, 10, 1, tzinfo=UTC), 31, "oct"))
        ledger.insert_events(october)
        close_period(ledger, "2026-10", now=now, grace_hours=72)
        late = users(random_events(rng, n // 5, datetime(2026, 10, 1, tzinfo=UTC), 31, "late"))
        november = users(random_events(rng, n // 2, datetime(2026, 11, 1, tzinfo=UTC), 9, "nov"))
        ledger.insert_events(late + november)
        booked = {"2026-10": october, "2026-11": late + november}

        def check(period: str, frozen: bool) -> None:
            events = booked[period]
            rated = [rate_event(e, catalog.rate_for(e.backend_id, e.occurred_at),
                                catalog.book_for(e.app_id, e.occurred_at)) for e in events]
            with ledger.engine.connect() as conn:
                for by in ("backend", "end_user", "app"):
                    rows = margin_report(conn, catalog, period, by=by)
                    usage = usage_report(conn, catalog, period, by=by)
                    for row in rows:
                        rows_add_up(row)
                    total = totals(rows)
                    assert sum(t["billed_amount"] for t in total) == sum(r.billed_amount for r in rated)
                    assert sum(t["provider_cost"] + t["absorbed_cost"] for t in total) == sum(
                        r.provider_cost for r in rated)
                    assert sum(t["fee_amount"] for t in total) == sum(r.fee_amount for r in rated)
                    assert sum(t["requests_total"] for t in total) == sum(e.is_final for e in events)
                    utotal = totals(usage)
                    for column, bucket in TOKEN_COLUMNS.items():
                        assert sum(t[column] for t in utotal) == sum(getattr(e.tokens, bucket) for e in events)
                    assert sum(t["adjustments"] for t in utotal) == sum(t["adjustments"] for t in total)
                payouts = payout_report(conn, catalog, period)
            per_app: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
            for e, r in zip(events, rated, strict=True):
                per_app[(e.app_id, r.currency)] += r.billed_amount
            assert {(p["app_id"], p["currency"]) for p in payouts} == set(per_app)
            for p in payouts:
                rows_add_up(p)
                expected = per_app[(p["app_id"], p["currency"])]
                assert p["status"] == ("pending" if frozen else "provisional")
                assert p["billed_amount"] == (expected.quantize(CENT) if frozen else expected)

        check("2026-10", frozen=True)
        check("2026-11", frozen=False)
        clock.at = datetime(2026, 12, 5, tzinfo=UTC)
        close_period(ledger, "2026-11", now=clock.at, grace_hours=72)
        check("2026-11", frozen=True)
    finally:
        ledger.close()


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_ledgers_reconcile(tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    path = tmp_path_factory.mktemp("reconcile") / "billing.db"
    run_reconciliation(f"sqlite:///{path}", 300, seed)


@pytest.mark.slow
def test_random_ledger_reconciles_on_postgresql(pg_url: str) -> None:
    run_reconciliation(pg_url, 1500, seed=20261201)


def test_late_event_of_a_closed_month_beyond_the_grace(month) -> None:  # type: ignore[no-untyped-def]
    """A late event is counted once: November's row, never October's frozen one."""
    ledger, late, _ = month
    with ledger.engine.connect() as conn:
        oct_rows = usage_report(conn, ledger.catalog(), "2026-10")
    assert sum(r["requests_total"] for r in oct_rows) == 6 and sum(r["late_requests"] for r in oct_rows) == 0
    assert all(e.occurred_at < datetime(2026, 11, 1, tzinfo=UTC) - timedelta(days=1) for e in late)


def test_one_payout_figure_in_every_report(db_url: str) -> None:
    """Before: ``report margin --by app`` showed an app's payout as −1.16 (TOTAL 146.47) while ``report payouts``
    floored it at 0 (TOTAL 147.64). Now each app's month is floored at 0 wherever a payout is shown, and rows finer
    than an app carry their unfloored ``payout_share``."""
    prices = copy.deepcopy(PRICES)
    prices["price_books"].append({"app": "thin", "version": 1, "effective_from": "2026-01-01",
                                  "platform_fee_pct": "5%", "rules": [{"name": "at-cost"}]})
    ledger = Ledger.open(db_url, clock=Clock(datetime(2026, 10, 20, tzinfo=UTC)))
    try:
        store_prices(ledger, parse_price_data(prices))
        ledger.insert_events([event(i, app_id="thin", provider_cost=Decimal("0.5")) for i in range(3)]
                             + [event(10 + i, provider_cost=Decimal("0.1")) for i in range(3)])
        with ledger.engine.connect() as conn:
            apps = {r["app_id"]: r for r in margin_report(conn, ledger.catalog(), "2026-10", by="app")}
            backends = margin_report(conn, ledger.catalog(), "2026-10", by="backend")
            payouts = {p["app_id"]: p for p in payout_report(conn, ledger.catalog(), "2026-10")}
        runner = CliRunner()
        totals_of = {kind: json.loads(runner.invoke(report_app, [kind, "--period", "2026-10", "--format", "json",
                                                                 "--db", db_url, *extra]).stdout)["totals"][0]
                     for kind, extra in (("margin", ["--by", "backend"]), ("payouts", []))}
    finally:
        ledger.close()
    assert apps["thin"]["payout_share"] == Decimal("-0.075") and apps["thin"]["payout_amount"] == 0
    assert payouts["thin"]["payout_amount"] == 0
    assert apps["acme"]["payout_amount"] == payouts["acme"]["payout_amount"] > 0
    assert all(r["payout_amount"] is None for r in backends)  # not whole apps: only their shares
    assert sum(r["payout_share"] for r in backends) == apps["thin"]["payout_share"] + apps["acme"]["payout_share"]
    assert Decimal(totals_of["margin"]["payout_amount"]) == Decimal(totals_of["payouts"]["payout_amount"]) \
        == payouts["acme"]["payout_amount"]
