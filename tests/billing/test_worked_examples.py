"""The worked examples of docs/billing.md, run on a ledger priced by examples/prices.yaml: the figures the guide
prints are the figures the reports give."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from billing_helpers import event
from typer.testing import CliRunner

from kvroute.billing.cli import billing_app, report_app
from kvroute.billing.ledger import Ledger
from kvroute.billing.usage import TokenBuckets

ROOT = Path(__file__).resolve().parents[2]
GUIDE = re.sub(r"\s+", " ", (ROOT / "docs" / "billing.md").read_text())
runner = CliRunner()
AT = datetime(2026, 10, 3, 12, tzinfo=UTC)


def cli(*args: str) -> dict:
    r = runner.invoke(report_app, list(args))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    r = runner.invoke(billing_app, ["load-prices", str(ROOT / "examples" / "prices.yaml"), "--db", url])
    assert r.exit_code == 0, r.output
    return url


def hosted(i: int, tokens: TokenBuckets, **over: object) -> object:
    return event(i, served_model="fake-model", provider="provider-a", backend_id="provider-a",
                 route_kind="marketplace", tokens=tokens, **over)


def test_what_the_cache_saved(db: str) -> None:
    ledger = Ledger.open(db)
    try:
        ledger.insert_events([hosted(1, TokenBuckets(0, 12000, 0, 0, 10, 0)),
                              event(2, app_id="globex", served_model="fake-model", provider="self_hosted",
                                    backend_id="replica-1", route_kind="self_hosted",
                                    tokens=TokenBuckets(0, 12000, 0, 0, 10, 0))])
    finally:
        ledger.close()
    rows = {r["app_id"]: r for r in cli("usage", "--period", "2026-10", "--by", "app", "--format", "json",
                                        "--db", db)["rows"]}
    assert Decimal(rows["acme"]["cache_savings"]) == Decimal("0.0108")
    assert Decimal(rows["globex"]["cache_savings"]) == Decimal("0.0012")
    assert rows["globex"]["prefill_seconds_saved"] == 1.5 and rows["acme"]["prefill_seconds_saved"] is None
    for text in ("12,000 × (1 − 0.10) / 1e6 = **$0.0108**", "12,000 × 0.10 / 1e6 = **$0.0012**",
                 "12,000 / 8,000 = **1.5 s**"):
        assert text in GUIDE, text


def test_the_latency_quantiles_and_the_session_costs(db: str) -> None:
    ttfts = [80, 85, 90, 95, 100, 110, 120, 150, 400, 900]
    events = [hosted(i, TokenBuckets(100, 0, 0, 0, 10, 0), ttft_ms=t, occurred_at=AT + timedelta(minutes=i))
              for i, t in enumerate(ttfts)]
    ledger = Ledger.open(db)
    try:
        ledger.insert_events(events)
    finally:
        ledger.close()
    row = cli("usage", "--period", "2026-10", "--by", "app", "--format", "json", "--db", db)["rows"][0]
    assert (row["ttft_p50_ms"], row["ttft_p90_ms"], row["ttft_p99_ms"]) == (100, 400, 900)
    assert "p50 = the 5th = **100 ms**, p90 = the 9th = **400 ms**, p99 = the 10th = **900 ms**" in GUIDE


def test_the_statement_example(db: str) -> None:
    ledger = Ledger.open(db)
    try:
        ledger.insert_events([hosted(1, TokenBuckets(1000, 3000, 0, 0, 400, 0))])
    finally:
        ledger.close()
    margin = cli("margin", "--period", "2026-10", "--by", "app", "--format", "json", "--db", db)["rows"][0]
    assert Decimal(margin["billed_amount"]) == Decimal("0.00342")
    r = runner.invoke(report_app, ["statement", "--app", "acme", "--period", "2026-10", "--db", db])
    lines = {line["bucket"]: line for line in json.loads(r.stdout)["lines"]}
    assert {b: Decimal(line["unit_price"]) for b, line in lines.items()} == {
        "input_uncached": Decimal("1.70"), "cache_read": Decimal("0.12"), "output": Decimal("3.40")}
    for text in ("input **$0.0017** (unit price $1.70 per Mtok)", "cached input **$0.00036** ($0.12)",
                 "output **$0.00136** ($3.40)", "billed $0.00342"):
        assert text in GUIDE, text
