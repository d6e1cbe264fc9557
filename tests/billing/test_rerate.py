"""``kvroute billing rerate``: a month's events priced again under the books in force, on SQLite and PostgreSQL.

Amounts are computed here from the price file's terms (cost × (1 + markup)), independently of the ledger."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import yaml
from billing_helpers import event
from sqlalchemy import func, select
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app, report_app
from kvroute.billing.ledger import Ledger
from kvroute.billing.models import RerateRunRow, UsageAdjustmentRow, UsageEventRow
from kvroute.billing.periods import close_period, statement_totals
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.billing.rerate import apply_rerate

runner = CliRunner()
COST = Decimal("0.01")  # each event's reported provider cost


def _prices(acme_markup: str, version: int = 1, rate_card: bool = True) -> dict:
    backend: dict = {"id": "or-claude", "provider": "openrouter", "served_model": "claude-sonnet",
                     "route_kind": "marketplace"}
    if rate_card:
        backend["rates"] = [{"effective_from": "2026-01-01", "input_per_mtok": "3", "output_per_mtok": "15"}]
    return {"currency": "USD", "backends": [backend], "price_books": [
        {"app": "acme", "version": version, "effective_from": "2026-01-01",
         "rules": [{"name": "all", "markup_pct": acme_markup}]},
        {"app": "beta", "version": 1, "effective_from": "2026-01-01", "rules": [{"name": "all", "markup_pct": "10%"}]},
    ]}


def _load(ledger: Ledger, data: dict) -> None:
    store_prices(ledger, parse_price_data(data))


def _events(month: int, n: int, app: str = "acme", start: int = 0, **over) -> list:
    return [event(start + i, app_id=app, occurred_at=datetime(2026, month, 3 + i % 20, 12, tzinfo=UTC), **over)
            for i in range(n)]


def _margin(db: str, period: str) -> dict[str, dict]:
    r = runner.invoke(report_app, ["margin", "--period", period, "--format", "json", "--db", db])
    assert r.exit_code == 0, r.output
    return {row["app_id"]: row for row in json.loads(r.stdout)["rows"]}


def _dec(value: object) -> Decimal:
    return Decimal(str(value))


def test_dry_run_diff_then_apply_then_nothing(db_url: str) -> None:
    """A markup typed as "0.02" (meant 0.20) for acme after 20 events; beta's 5 events are right."""
    ledger = Ledger.open(db_url)
    try:
        _load(ledger, _prices("0.02"))
        ledger.insert_events(_events(11, 20, provider_cost=COST) + _events(11, 5, "beta", provider_cost=COST))
        _load(ledger, _prices("0.20", version=2))  # the fix: a new version of acme's book, same start
    finally:
        ledger.close()
    wrong, right = 20 * COST * Decimal("1.02"), 20 * COST * Decimal("1.20")
    before = _margin(db_url, "2026-11")
    assert _dec(before["acme"]["billed_amount"]) == wrong

    dry = runner.invoke(billing_app, ["rerate", "--month", "2026-11", "--db", db_url])
    assert dry.exit_code == 0, dry.output
    print("\n" + dry.output)
    lines = dry.output.splitlines()
    assert lines[0] == "re-rate 2026-11: 20 of 25 event(s) change · dry run (--apply writes it)"
    acme = next(line for line in lines if line.startswith("acme"))
    assert acme.split()[:3] == ["acme", "or-claude", "20"]
    assert f"{wrong.normalize():f} → {right.normalize():f}" in acme and f"+{(right - wrong).normalize():f}" in acme
    assert "in place USD" in acme and not any(line.startswith("beta") for line in lines)
    assert _margin(db_url, "2026-11") == before  # a dry run writes nothing

    applied = runner.invoke(billing_app, ["rerate", "--month", "2026-11", "--apply", "--who", "alice", "--db", db_url])
    assert applied.exit_code == 0, applied.output
    assert "run 1 by alice" in applied.output and "20 event(s) re-priced in place" in applied.output
    after = _margin(db_url, "2026-11")
    assert _dec(after["acme"]["billed_amount"]) == right
    assert _dec(after["acme"]["markup_amount"]) == 20 * COST * Decimal("0.20")
    assert after["acme"]["rerated_events"] == 20 and "RE-RATED: 20" in after["acme"]["pricing_rule"]
    assert "+20 % (v2)" in after["acme"]["pricing_rule"]
    assert after["beta"] == before["beta"] and after["beta"]["rerated_events"] == 0

    again = runner.invoke(billing_app, ["rerate", "--month", "2026-11", "--apply", "--db", db_url])
    assert again.exit_code == 0 and "nothing changes" in again.output, again.output
    assert _margin(db_url, "2026-11") == after
    ledger = Ledger.open(db_url)
    try:
        with ledger.engine.connect() as conn:
            runs = conn.execute(select(RerateRunRow.__table__)).all()
            marked = conn.execute(select(func.count()).select_from(UsageEventRow).where(
                UsageEventRow.rerate_run_id == 1)).scalar_one()
    finally:
        ledger.close()
    assert len(runs) == 1 and runs[0].created_by == "alice" and runs[0].events_rerated == 20
    assert runs[0].period == "2026-11" and runs[0].summary[0]["new_billed"] == f"{right.normalize():f}"
    assert marked == 20


def test_a_closed_month_is_corrected_by_adjustments_on_the_next_open_statement(db_url: str) -> None:
    ledger = Ledger.open(db_url)
    try:
        _load(ledger, _prices("0.02"))
        ledger.insert_events(_events(10, 10, provider_cost=COST))
        close_period(ledger, "2026-10", force=True, now=datetime(2026, 11, 5, tzinfo=UTC))
        frozen = statement_totals(ledger, "2026-10")
        with ledger.engine.connect() as conn:
            rows_before = conn.execute(select(UsageEventRow.__table__).order_by(UsageEventRow.event_id)).all()
        _load(ledger, _prices("0.20", version=2))
        now = datetime(2026, 11, 15, tzinfo=UTC)
        first = apply_rerate(ledger, "2026-10", created_by="bob", now=now)
        assert first.run_id is not None and len(first.plan.adjustments) == 10 and not first.plan.in_place
        assert apply_rerate(ledger, "2026-10", created_by="bob", now=now).run_id is None  # idempotent
        assert statement_totals(ledger, "2026-10") == frozen  # the frozen month is untouched
        with ledger.engine.connect() as conn:
            assert conn.execute(select(UsageEventRow.__table__).order_by(UsageEventRow.event_id)).all() == rows_before
            adjustments = conn.execute(select(UsageAdjustmentRow.__table__)).all()
        assert {(a.kind, a.period, a.original_period, a.created_by) for a in adjustments} == {
            ("rerate", "2026-11", "2026-10", "bob")}
        delta = COST * (Decimal("1.20") - Decimal("1.02"))
        assert all(a.delta_billed_amount == delta and a.delta_markup_amount == delta for a in adjustments)
        november = _margin(db_url, "2026-11")["acme"]
        assert _dec(november["adjustments"]) == 10 * delta and _dec(november["billed_amount"]) == 10 * delta
        assert november["rerated_events"] == 10 and "RE-RATED: 10" in november["pricing_rule"]
        close_period(ledger, "2026-11", force=True, now=datetime(2026, 12, 5, tzinfo=UTC))
        assert statement_totals(ledger, "2026-11")[("acme", "USD")]["total_billed"] == Decimal("0.02")  # 0.018
        # a later fix corrects the correction: only the new difference is booked
        _load(ledger, _prices("0.25", version=3))
        third = apply_rerate(ledger, "2026-10", created_by="bob", now=datetime(2026, 12, 10, tzinfo=UTC))
        assert {a["period"] for a in third.plan.adjustments} == {"2026-12"}
        assert all(a["delta_billed_amount"] == COST * Decimal("0.05") for a in third.plan.adjustments)
    finally:
        ledger.close()


def test_events_booked_before_load_prices_are_priced_by_a_rerate(db_url: str) -> None:
    """Events that arrived before ``load-prices`` sit at cost 0 (UNPRICED); a re-rate prices them from the card."""
    ledger = Ledger.open(db_url)
    try:
        ledger.insert_events(_events(11, 4))  # no reported cost, no rate card yet
    finally:
        ledger.close()
    assert _margin(db_url, "2026-11")["acme"]["unpriced_events"] == 4
    ledger = Ledger.open(db_url)
    try:
        _load(ledger, _prices("20%"))
        result = apply_rerate(ledger, "2026-11", created_by="carol")
    finally:
        ledger.close()
    (line,) = result.plan.lines
    assert (line.unpriced_before, line.unpriced_after, line.events) == (4, 0, 4)
    # helper tokens: 1000 uncached input, 400 output (cache buckets have no price on this card)
    cost = (1000 * Decimal(3) + 400 * Decimal(15)) / Decimal(1_000_000)
    row = _margin(db_url, "2026-11")["acme"]
    assert row["unpriced_events"] == 0 and _dec(row["billed_amount"]) == 4 * cost * Decimal("1.2")


def test_a_rerate_moves_rows_booked_before_load_prices_to_the_declared_provider_and_rule(db_url: str) -> None:
    """Rows booked as the deployment saw them (``openai``, ``direct``) take the provider and route kind the price file
    declares for their backend once it is loaded, and with them the rule that matches that route kind."""
    ledger = Ledger.open(db_url)
    try:
        ledger.insert_events(_events(11, 3, provider="openai", route_kind="direct", provider_cost=COST))
    finally:
        ledger.close()
    data = _prices("0.10")
    data["price_books"][0]["rules"] = [{"name": "hosted", "match": {"route_kind": "marketplace"}, "markup_pct": "20%"},
                                       {"name": "other", "markup_pct": "0%"}]
    ledger = Ledger.open(db_url)
    try:
        _load(ledger, data)
        apply_rerate(ledger, "2026-11", created_by="dave")
        with ledger.engine.connect() as conn:
            kinds = set(conn.execute(select(UsageEventRow.provider, UsageEventRow.route_kind)
                                     .where(UsageEventRow.app_id == "acme")))
    finally:
        ledger.close()
    assert kinds == {("openrouter", "marketplace")}
    row = _margin(db_url, "2026-11")["acme"]
    assert _dec(row["billed_amount"]) == 3 * COST * Decimal("1.2")
    assert _dec(row["hosted_cost"]) == 3 * COST and _dec(row["self_hosted_cost"]) == 0


def test_rerate_names_a_bad_month_and_a_missing_ledger(tmp_path: Path) -> None:
    r = runner.invoke(billing_app, ["rerate", "--month", "2026-13", "--db", str(tmp_path / "l.db")])
    assert r.exit_code == 2 and "--month: expected YYYY-MM" in r.output
    r = runner.invoke(billing_app, ["rerate", "--month", "2026-11", "--db", str(tmp_path / "none.db")])
    assert r.exit_code == 2 and "no usage ledger" in r.output


def test_a_book_in_another_currency_is_refused_not_converted(tmp_path: Path) -> None:
    db = str(tmp_path / "l.db")
    prices = tmp_path / "p.yaml"
    prices.write_text(yaml.safe_dump(_prices("0.02")))
    assert runner.invoke(billing_app, ["load-prices", str(prices), "--db", db]).exit_code == 0
    ledger = Ledger.open(db)
    try:
        ledger.insert_events(_events(11, 2))  # priced from the USD rate card
    finally:
        ledger.close()
    euro = _prices("0.20", version=2)
    euro["price_books"][0]["currency"] = "EUR"
    prices.write_text(yaml.safe_dump(euro))
    assert runner.invoke(billing_app, ["load-prices", str(prices), "--db", db]).exit_code == 0
    r = runner.invoke(billing_app, ["rerate", "--month", "2026-11", "--apply", "--db", db])
    assert r.exit_code == 2 and r.output.startswith("error: currency: ") and "never" in r.output, r.output
