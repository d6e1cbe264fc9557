"""One truth per backend: the price file's provider and route kind are what every event of a declared backend is
rated, matched and reported under, whatever the event said (a streamed attempt's ``unknown`` provider, a
deployment's ``direct`` route kind), and a price file loaded after the first events redeclares the backend."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import yaml
from billing_helpers import event

from kvroute.billing.ledger import Ledger
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.billing.reports import margin_report
from kvroute.billing.usage import TokenBuckets

EXAMPLE_PRICES = Path(__file__).resolve().parents[2] / "examples" / "prices.yaml"
WHEN = datetime(2026, 10, 3, 12, tzinfo=UTC)
TOKENS = TokenBuckets(input_uncached=900, cache_read=100, output=40)


def _hosted(i: int, provider: str, streamed: bool, backend: str = "provider-a") -> object:
    """An attempt on a hosted deployment as the plugin saw it: route kind ``direct``, the payload's provider."""
    return event(i, app_id="acme", occurred_at=WHEN, served_model="fake-model", provider=provider,
                 backend_id=backend, route_kind="direct", tokens=TOKENS, streamed=streamed)


def _expected_hosted(backend: str) -> dict[str, Decimal]:
    """acme's ``hosted`` rule from the example price file, computed here from the YAML itself."""
    data = yaml.safe_load(EXAMPLE_PRICES.read_text())
    rate = next(b for b in data["backends"] if b["id"] == backend)["rates"][0]
    rule = next(r for b in data["price_books"] if b.get("app") == "acme" for r in b["rules"] if r["name"] == "hosted")
    cost = (TOKENS.input_uncached * Decimal(rate["input_per_mtok"]) + TOKENS.cache_read
            * Decimal(rate["cache_read_per_mtok"]) + TOKENS.output * Decimal(rate["output_per_mtok"])) / 10**6
    s = rule["surcharge_per_mtok"]
    surcharge = (TOKENS.input_uncached * Decimal(s["input"]) + TOKENS.cache_read * Decimal(s["cache_read"])
                 + TOKENS.output * Decimal(s["output"])) / 10**6
    markup = cost * Decimal(rule["markup_pct"])
    return {"cost": cost, "markup": markup, "surcharge": surcharge, "billed": cost + markup + surcharge}


def _rows(ledger: Ledger) -> list[dict]:
    from sqlalchemy import select

    from kvroute.billing.models import PriceRuleRow, UsageEventRow

    E, R = UsageEventRow, PriceRuleRow
    with ledger.engine.connect() as conn:
        q = select(E.request_id, E.provider, E.route_kind, E.provider_cost, E.markup_amount, E.surcharge_amount,
                   E.billed_amount, R.name.label("rule")).outerjoin(R, R.price_rule_id == E.price_rule_id)
        return [dict(r._mapping) for r in conn.execute(q.order_by(E.request_id))]


def test_declared_backend_rates_every_attempt_under_the_price_files_identity(db_url):
    ledger = Ledger.open(db_url)
    try:
        store_prices(ledger, parse_price_data(yaml.safe_load(EXAMPLE_PRICES.read_text())))
        ledger.insert_events([_hosted(0, "openai", False), _hosted(1, "unknown", True)])
        want = _expected_hosted("provider-a")
        rows = _rows(ledger)
        assert [(r["provider"], r["route_kind"], r["rule"]) for r in rows] == [
            ("provider-a", "marketplace", "hosted")] * 2
        for r in rows:
            assert (r["provider_cost"], r["markup_amount"], r["surcharge_amount"], r["billed_amount"]) == (
                want["cost"], want["markup"], want["surcharge"], want["billed"])
        with ledger.engine.connect() as conn:
            report = margin_report(conn, ledger.catalog(), "2026-10", app="acme")
        backend_rows = [r for r in report if r.get("backend_id") == "provider-a"]
        assert len(backend_rows) == 1  # one row per backend, streamed or not
        assert backend_rows[0]["hosted_cost"] == 2 * want["cost"] and backend_rows[0]["self_hosted_cost"] == 0
    finally:
        ledger.close()


def test_a_price_file_loaded_after_traffic_redeclares_the_backend(sqlite_url):
    ledger = Ledger.open(sqlite_url)
    try:
        ledger.insert_events([_hosted(0, "unknown", True, backend="provider-b")])  # before load-prices
        summary = store_prices(ledger, parse_price_data(yaml.safe_load(EXAMPLE_PRICES.read_text())))
        assert summary.backends_updated == 1 and summary.backends_added == 4
        again = store_prices(ledger, parse_price_data(yaml.safe_load(EXAMPLE_PRICES.read_text())))
        assert again.backends_updated == 0 and again.backends_added == 0  # idempotent
        ledger.insert_events([_hosted(1, "openai", False, backend="provider-b")])
        first, second = _rows(ledger)
        assert (first["provider"], first["route_kind"], first["rule"]) == ("unknown", "direct", None)  # as booked
        assert (second["provider"], second["route_kind"], second["rule"]) == ("provider-b", "marketplace", "hosted")
        assert second["billed_amount"] == _expected_hosted("provider-b")["billed"]
        from sqlalchemy import select

        from kvroute.billing.models import Backend
        with ledger.engine.connect() as conn:
            declared = conn.execute(select(Backend.provider, Backend.route_kind, Backend.declared_at)
                                    .where(Backend.backend_id == "provider-b")).one()
        assert declared[:2] == ("provider-b", "marketplace") and declared[2] is not None
    finally:
        ledger.close()


def test_an_undeclared_backend_keeps_the_events_own_identity(sqlite_url):
    ledger = Ledger.open(sqlite_url)
    try:
        store_prices(ledger, parse_price_data(yaml.safe_load(EXAMPLE_PRICES.read_text())))
        ledger.insert_events([_hosted(0, "openai_compatible", False, backend="elsewhere")])
        (row,) = _rows(ledger)
        assert (row["provider"], row["route_kind"]) == ("openai_compatible", "direct")
    finally:
        ledger.close()
