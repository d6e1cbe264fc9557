"""Property: for random events across apps, models and price rules, statement totals equal the sum of the
event amounts to the cent (late events included), and re-ingesting everything changes nothing."""

from __future__ import annotations

import os
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.billing.events import UsageEvent
from kvroute.billing.ledger import Ledger
from kvroute.billing.models import UsageAdjustmentRow
from kvroute.billing.periods import close_period, ledger_sums, statement_totals
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.billing.pricing import rate_event
from kvroute.billing.usage import TokenBuckets

APPS = [f"app{i}" for i in range(12)]
MODELS = [("openrouter", "claude-sonnet", "marketplace"), ("openai", "gpt-5", "direct"),
          ("self_hosted", "llama-8b", "self_hosted"), ("deepseek", "deepseek-v4", "marketplace"),
          ("gemini", "gemini-3-flash", "direct")]
STATUSES = ["success"] * 8 + ["provider_failure", "capacity", "zero_completion", "client_error"]
CENT = Decimal("0.01")


def _money(rng: random.Random, top: int, places: int = 6) -> str:
    return str(Decimal(rng.randrange(0, top * 10**places)).scaleb(-places))


def random_prices(rng: random.Random) -> dict:
    backends = []
    for provider, model, kind in MODELS:
        for r in range(2):
            backends.append({"id": f"{model}-{r}", "provider": provider, "served_model": model, "route_kind": kind,
                             "rates": [{"effective_from": "2026-01-01",
                                        **{f: _money(rng, 20, 3) for f in ("input_per_mtok", "cache_read_per_mtok",
                                                                           "cache_write_5m_per_mtok",
                                                                           "cache_write_1h_per_mtok",
                                                                           "output_per_mtok")}}]})
    books = []
    for app in [None, *APPS[:9]]:
        rules = []
        for j in range(rng.randint(1, 4)):
            rule: dict = {"name": f"r{j}"}
            if rng.random() < 0.6:
                rule["match"] = rng.choice([{"provider": MODELS[j % 5][0]}, {"model": MODELS[j % 5][1][:4] + "*"},
                                            {"route_kind": MODELS[j % 5][2]}, {"backend": f"{MODELS[j % 5][1]}-0"}])
            if rng.random() < 0.8:
                rule["markup_pct"] = _money(rng, 1, 4)
            if rng.random() < 0.5:
                rule["surcharge_per_mtok"] = {b: _money(rng, 2, 3) for b in ("input", "output", "cache_read")
                                              if rng.random() < 0.7}
            if rng.random() < 0.4:
                rule["fee_per_request"] = _money(rng, 1, 5)
            if rng.random() < 0.2:
                rule["min_per_request"] = _money(rng, 1, 4)
            if rng.random() < 0.2:
                rule["max_per_request"] = str(Decimal(rule.get("min_per_request", "0")) + Decimal(_money(rng, 2, 3)))
            rule["bill_failed_attempts"] = rng.random() < 0.3
            rule["bill_zero_completion"] = rng.random() < 0.3
            rules.append(rule)
        book = {"version": 1, "effective_from": "2026-01-01", "rules": rules,
                "platform_fee_pct": _money(rng, 1, 2) if rng.random() < 0.5 else "0"}
        if app:
            book["app"] = app
        books.append(book)
    return {"backends": backends, "price_books": books}


def random_events(rng: random.Random, n: int, start: datetime, days: int, tag: str) -> list[UsageEvent]:
    events = []
    for i in range(n):
        provider, model, kind = rng.choice(MODELS)
        status = rng.choice(STATUSES)
        prompt = rng.randrange(0, 20000)
        read = rng.randrange(0, prompt + 1)
        out = 0 if status == "zero_completion" else rng.randrange(1, 2000)
        cost = rng.random()
        events.append(UsageEvent(
            request_id=f"{tag}-{i // 2}", attempt=i % 2, is_final=rng.random() < 0.9, app_id=rng.choice(APPS),
            occurred_at=start + timedelta(seconds=rng.randrange(days * 86400)), served_model=model,
            provider=provider, backend_id=f"{model}-{rng.randrange(2)}", route_kind=kind, status=status,
            tokens=TokenBuckets(prompt - read, read, rng.randrange(50), rng.randrange(10), out,
                                rng.randrange(out + 1)),
            provider_cost=Decimal(rng.randrange(10**7)).scaleb(-9) if cost < 0.3 else None,
            litellm_cost=Decimal(rng.randrange(10**7)).scaleb(-9) if 0.3 <= cost < 0.5 else None,
            fallback_depth=rng.randrange(3)))
    return events


def run_property(url: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    now = datetime(2026, 11, 10, tzinfo=UTC)
    ledger = Ledger.open(url, clock=lambda: now)
    try:
        store_prices(ledger, parse_price_data(random_prices(rng)))
        catalog = ledger.catalog(refresh=True)
        october = random_events(rng, n, datetime(2026, 10, 1, tzinfo=UTC), 31, "oct")
        batch = 5000
        for i in range(0, len(october), batch):
            ledger.insert_events(october[i:i + batch])
        close_period(ledger, "2026-10", now=now, grace_hours=72)
        late = random_events(rng, n // 20, datetime(2026, 10, 1, tzinfo=UTC), 31, "late")
        november = random_events(rng, n // 10, datetime(2026, 11, 1, tzinfo=UTC), 9, "nov")
        ledger.insert_events(late + november)

        expected: dict[str, dict[tuple[str, str], Decimal]] = {"2026-10": defaultdict(Decimal),
                                                               "2026-11": defaultdict(Decimal)}
        for e in october:
            r = rate_event(e, catalog.rate_for(e.backend_id, e.occurred_at), catalog.book_for(e.app_id, e.occurred_at))
            expected["2026-10"][(e.app_id, r.currency)] += r.billed_amount
        for e in late + november:  # late events land in November as adjustments
            r = rate_event(e, catalog.rate_for(e.backend_id, e.occurred_at), catalog.book_for(e.app_id, e.occurred_at))
            expected["2026-11"][(e.app_id, r.currency)] += r.billed_amount

        later = datetime(2026, 12, 5, tzinfo=UTC)
        close_period(ledger, "2026-11", now=later, grace_hours=72)
        before = {p: statement_totals(ledger, p) for p in ("2026-10", "2026-11")}
        for period, sums in expected.items():
            assert ledger_sums(ledger, period) == {k: v for k, v in sums.items()}
            statements = before[period]
            assert set(statements) == set(sums)
            for key, total in sums.items():
                s = statements[key]
                assert s["total_billed"] == total.quantize(CENT), (period, key)
                assert s["lines_rounded"] == s["total_billed"]
                assert s["total_unrounded"] == total

        count, adjustments = ledger.count_events(), _count_adjustments(ledger)
        assert adjustments == len(late)
        # re-ingest everything: nothing changes
        everything = october + late + november
        for i in range(0, len(everything), batch):
            assert ledger.insert_events(everything[i:i + batch]) == 0
        assert ledger.count_events() == count == len(everything)
        assert _count_adjustments(ledger) == adjustments
        assert {p: statement_totals(ledger, p) for p in before} == before
        for period, sums in expected.items():
            assert ledger_sums(ledger, period) == dict(sums)
    finally:
        ledger.close()


def _count_adjustments(ledger: Ledger) -> int:
    from sqlalchemy import func, select
    with ledger.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(UsageAdjustmentRow.__table__)).scalar_one()


@pytest.mark.slow
def test_100k_events_sqlite(sqlite_url: str) -> None:
    run_property(sqlite_url, int(os.environ.get("KVROUTE_BILLING_PROPERTY_EVENTS", "100000")), seed=20261129)


@pytest.mark.slow
def test_random_events_postgresql(pg_url: str) -> None:
    run_property(pg_url, 10000, seed=7)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_small_random_ledgers(tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    path = tmp_path_factory.mktemp("prop") / "billing.db"
    run_property(f"sqlite:///{path}", 400, seed)
