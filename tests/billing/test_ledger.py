"""The ledger on SQLite and PostgreSQL: idempotent rated inserts, price loading, periods, statements, reports."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from billing_helpers import PRICES, event
from sqlalchemy import func, select

from kvroute.billing.ledger import Ledger
from kvroute.billing.models import StatementRow, UsageAdjustmentRow, UsageEventRow
from kvroute.billing.periods import close_period, ledger_sums, statement_totals
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.billing.reports import MARGIN_COLUMNS, margin_report, payout_report, totals, usage_report
from kvroute.billing.usage import TokenBuckets
from kvroute.policies.errors import ConfigError, InputError


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 10, 20, tzinfo=UTC))


@pytest.fixture
def ledger(db_url: str, clock: Clock):  # type: ignore[no-untyped-def]
    led = Ledger.open(db_url, clock=clock)
    store_prices(led, parse_price_data(PRICES))
    yield led
    led.close()


def _count(led: Ledger, table) -> int:  # type: ignore[no-untyped-def]
    with led.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def test_insert_is_idempotent_and_rated(ledger: Ledger) -> None:
    events = [event(i) for i in range(50)]
    assert ledger.insert_events(events) == 50
    assert ledger.insert_events([*events, event(50)]) == 1
    assert ledger.count_events() == 51
    with ledger.engine.connect() as conn:
        row = conn.execute(select(UsageEventRow.__table__).where(UsageEventRow.request_id == "req-0")).one()
    cost = (1000 * 3 + 3000 * Decimal("0.3") + 200 * Decimal("3.75") + 400 * 15) / Decimal(1_000_000)
    assert row.provider_cost == cost and isinstance(row.provider_cost, Decimal)
    assert row.billed_amount == cost * Decimal("1.2") + (1000 * Decimal("0.5") + 400) / Decimal(1_000_000)
    assert row.price_book_version == 1 and row.cost_source == "rate_card"


def test_amounts_are_exact_at_1e_10(ledger: Ledger) -> None:
    tiny = [event(i, provider_cost=Decimal("0.000000001"), app_id="tiny") for i in range(10)]
    ledger.insert_events(tiny)
    sums = ledger_sums(ledger, "2026-10")
    assert sums[("tiny", "USD")] == Decimal("0.0000000011") * 10  # +10 % default book, no float drift


def test_price_books_load_once_and_refuse_edits(ledger: Ledger) -> None:
    again = store_prices(ledger, parse_price_data(PRICES))
    assert again.books_added == 0 and again.books_unchanged == 2
    edited = json.loads(json.dumps(PRICES))
    edited["price_books"][1]["rules"][0]["markup_pct"] = "0.25"
    with pytest.raises(ConfigError, match=r"price_books\[acme v1\].*bump the version"):
        store_prices(ledger, parse_price_data(edited))
    edited["price_books"][1]["version"] = 2
    edited["price_books"][1]["effective_from"] = "2026-10-15"
    assert store_prices(ledger, parse_price_data(edited)).books_added == 1
    ledger.insert_events([event(1, provider_cost=Decimal(1)),
                          event(2, provider_cost=Decimal(1), occurred_at=datetime(2026, 10, 16, tzinfo=UTC))])
    with ledger.engine.connect() as conn:
        rows = dict(conn.execute(select(UsageEventRow.request_id, UsageEventRow.price_book_version)).all())
    assert rows == {"req-1": 1, "req-2": 2}


def test_close_period_grace_window_statements_and_late_events(ledger: Ledger, clock: Clock) -> None:
    ledger.insert_events([event(i, provider_cost=Decimal("0.333333")) for i in range(7)])
    ledger.insert_events([event(100 + i, app_id="beta", provider_cost=Decimal("0.1")) for i in range(3)])
    with pytest.raises(InputError, match="has not ended"):
        close_period(ledger, "2026-10", now=clock.at)
    clock.at = datetime(2026, 11, 1, 10, tzinfo=UTC)
    assert close_period(ledger, "2026-10", now=clock.at, grace_hours=72).status == "closing"
    ledger.insert_events([event(7, provider_cost=Decimal("0.333333"))])  # inside the grace window: lands normally
    clock.at += timedelta(hours=72)
    result = close_period(ledger, "2026-10", now=clock.at, grace_hours=72)
    assert result.status == "closed" and result.apps == ("acme", "beta")
    statements = statement_totals(ledger, "2026-10")
    sums = ledger_sums(ledger, "2026-10")
    for key, s in statements.items():
        assert s["total_billed"] == sums[key].quantize(Decimal("0.01"))
        assert s["lines_rounded"] == s["total_billed"]
    # late event of the closed period: booked into the open one as an adjustment, October untouched
    late = event(8, provider_cost=Decimal("0.333333"))
    ledger.insert_events([late])
    ledger.insert_events([late])  # fired twice: still one event, one adjustment
    assert statement_totals(ledger, "2026-10") == statements
    assert _count(ledger, UsageAdjustmentRow.__table__) == 1
    with ledger.engine.connect() as conn:
        adj = conn.execute(select(UsageAdjustmentRow.__table__)).one()
        assert (adj.period, adj.original_period, adj.kind) == ("2026-11", "2026-10", "late_event")
        nov = margin_report(conn, ledger.catalog(), "2026-11")
        oct_rows = margin_report(conn, ledger.catalog(), "2026-10")
    assert len(nov) == 1 and nov[0]["adjustments"] == nov[0]["billed_amount"] == adj.delta_billed_amount
    assert nov[0]["requests_total"] == nov[0]["late_requests"] == 1  # counted where it is booked
    assert sum(r["requests_total"] for r in oct_rows) == 11
    assert close_period(ledger, "2026-10", now=clock.at).statements == 0  # closing twice changes nothing
    with ledger.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(StatementRow.__table__)).scalar_one() == 2
        payouts = payout_report(conn, ledger.catalog(), "2026-10")
    assert {p["app_id"]: p["status"] for p in payouts} == {"acme": "pending", "beta": "pending"}


def test_report_columns_and_totals(ledger: Ledger) -> None:
    ledger.insert_events([
        event(1, provider_cost=Decimal("0.01")),
        event(1, attempt=1, provider_cost=Decimal("0.004"), is_final=False, status="provider_failure",
              backend_id="vllm-a", provider="self_hosted", served_model="llama-8b", route_kind="self_hosted"),
        event(2, provider_cost=Decimal("0.02"), fallback_depth=1),
        event(3, backend_id="vllm-a", provider="self_hosted", served_model="llama-8b", route_kind="self_hosted",
              tokens=TokenBuckets(100, 900, 0, 0, 50, 0)),
    ])
    with ledger.engine.connect() as conn:
        rows = margin_report(conn, ledger.catalog(), "2026-10")
        usage = usage_report(conn, ledger.catalog(), "2026-10", app="acme")
    assert list(rows[0]) == list(MARGIN_COLUMNS)
    claude = next(r for r in rows if r["backend_id"] == "or-claude")
    llama = next(r for r in rows if r["backend_id"] == "vllm-a")
    assert claude["requests_total"] == 2 and claude["requests_with_fallback"] == 1
    assert "claude: +20 %" in claude["pricing_rule"] and "(v1)" in claude["pricing_rule"]
    assert llama["attempts_absorbed"] == 1 and llama["absorbed_cost"] == Decimal("0.004")
    assert llama["requests_total"] == 1
    # vllm: amortised 1 $/Mtok input+output, 0.10 cache read → cost 0.00024; fee 0.0005 → 0.00074 → min 0.001
    assert llama["billed_amount"] == Decimal("0.001") and llama["provider_cost"] == Decimal("0.00024")
    assert llama["cache_hit_ratio"] == 0.75  # (900 + 3000 of the failed attempt) / 5200 prompt tokens
    assert llama["margin_amount"] == Decimal("0.001") - Decimal("0.00024") - Decimal("0.004") - llama["platform_fee"]
    total = totals(rows)[0]
    assert total["billed_amount"] == sum(r["billed_amount"] for r in rows)
    assert usage and all(r["app_id"] == "acme" for r in usage)


def test_migrations_match_the_models(db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kvroute.billing.db import open_engine
    from kvroute.billing.models import Base
    engine = open_engine(db_url)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()


def test_postgres_urls_get_the_psycopg3_driver() -> None:
    from kvroute.billing.db import database_url
    assert database_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert database_url(".kvroute/billing.db").startswith("sqlite:///")


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvroute.billing.settings import BillingSettings
    monkeypatch.setenv("KVROUTE_BILLING_DB", "postgresql://billing@db/ledger")
    monkeypatch.setenv("KVROUTE_BILLING_SPOOL", "/var/spool/kvroute")
    s = BillingSettings().ledger
    assert s.billing_db == "postgresql://billing@db/ledger" and str(s.billing_spool) == "/var/spool/kvroute"
    monkeypatch.delenv("KVROUTE_BILLING_DB")
    monkeypatch.delenv("KVROUTE_DATA_DIR", raising=False)
    from kvroute.billing.location import location_from
    assert location_from(BillingSettings()).db_url == f"sqlite:///{Path.cwd() / '.kvroute' / 'billing.db'}"
    monkeypatch.setenv("KVROUTE_DATA_DIR", "/srv/kvroute")  # the proxy's data directory holds the ledger
    assert location_from(BillingSettings()).db_url == "sqlite:////srv/kvroute/billing.db"
