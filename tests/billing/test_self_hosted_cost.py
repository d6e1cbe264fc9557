"""One unit of cost: a GPU-hour rate card gives exact per-Mtok prices, the price file reads
it, ``token_cost`` charges what the ledger charges, and usage/margin reports split self-hosted and hosted
(overflow) spend per app by the backend's kind in the price file, on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from billing_helpers import PRICES, event

from kvroute.billing.ledger import Ledger
from kvroute.billing.price_file import parse_price_data, read_price_file
from kvroute.billing.price_store import store_prices
from kvroute.billing.pricing import GpuRateCard, rate_event, token_cost
from kvroute.billing.reports import margin_report, totals, usage_report
from kvroute.billing.usage import TokenBuckets
from kvroute.policies.errors import ConfigError, InputError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def card_prices(**rate: object) -> dict:
    prices = copy.deepcopy(PRICES)
    prices["backends"][0]["rates"] = [{"effective_from": "2026-01-01", **rate}]
    return prices


def test_gpu_card_prices_are_gpu_seconds_per_token_rounded_half_even() -> None:
    card = GpuRateCard(Decimal("2.50"), Decimal(15928), Decimal(2500), gpus=2)
    # 2.50 × 2 × 1e6 / (15928 × 3600) = 0.08719794...; 5e6 / (2500 × 3600) = 0.5555...
    assert card.input_per_mtok == Decimal("0.087198")
    assert card.output_per_mtok == Decimal("0.555556")
    assert card.per_token() == (Decimal("0.087198") / 1_000_000, Decimal("0.555556") / 1_000_000)
    rate = card.cost_rate("replica-0")
    assert rate.source == "self_hosted_amortized" and rate.cache_read_per_mtok == 0
    assert rate.cache_write_5m_per_mtok == card.input_per_mtok
    # 1,000 uncached + 3,000 cached + 200 out = (1000 × 0.087199 + 200 × 0.555556) / 1e6
    assert token_cost(rate, input_uncached=1000, cache_read=3000, output=200) == Decimal("0.0001983092")


def test_token_cost_is_what_the_ledger_charges() -> None:
    pf = parse_price_data(card_prices(gpu_hour="3.60 USD", prefill_tok_s=10000, decode_tok_s=1000))
    rate = pf.rates[0]
    assert (rate.input_per_mtok, rate.output_per_mtok) == (Decimal("0.1"), Decimal("1"))
    e = event(1, backend_id="vllm-a", provider="self_hosted", route_kind="self_hosted", served_model="llama-8b",
              tokens=TokenBuckets(1000, 3000, 0, 0, 400, 0))
    rating = rate_event(e, rate, None)
    assert rating.provider_cost == token_cost(rate, input_uncached=1000, cache_read=3000, output=400)
    assert rating.provider_cost == Decimal("0.0005")  # 1000 × 0.1 / 1e6 + 400 × 1 / 1e6


@pytest.mark.parametrize(("rate", "key", "words"), [
    ({"gpu_hour": "2.50 EUR", "prefill_tok_s": 1000, "decode_tok_s": 100}, "gpu_hour", "never converted"),
    ({"gpu_hour": "2.50", "prefill_tok_s": 1000}, "decode_tok_s", "required"),
    ({"prefill_tok_s": 1000, "decode_tok_s": 100}, "gpu_hour", "required"),
    ({"gpu_hour": "2.50", "prefill_tok_s": 0, "decode_tok_s": 100}, "prefill_tok_s", "positive"),
    ({"gpu_hour": "-1", "prefill_tok_s": 10, "decode_tok_s": 100}, "gpu_hour", "negative"),
    ({"gpu_hour": "2.50", "prefill_tok_s": 10, "decode_tok_s": 100, "gpus": 0}, "gpus", ">= 1"),
    ({"gpu_hour": "2.50", "tokens_per_s": 10, "decode_tok_s": 100}, "tokens_per_s", "either"),
    ({"gpu_hour": "two", "prefill_tok_s": 10, "decode_tok_s": 100}, "gpu_hour", "not a decimal"),
])
def test_bad_gpu_cards_name_the_field(rate: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_price_data(card_prices(**rate))
    assert key in str(err.value) and words in str(err.value)


def test_bad_card_values_raise_input_error() -> None:
    with pytest.raises(InputError, match="decode_tok_s"):
        GpuRateCard(Decimal(1), Decimal(10), Decimal(0))


def test_example_price_file_has_a_gpu_hour_card() -> None:
    pf = read_price_file(EXAMPLES / "prices.yaml")
    raw = yaml.safe_load((EXAMPLES / "prices.yaml").read_text())
    cards = [r for b in raw["backends"] for r in b["rates"] if "prefill_tok_s" in r]
    assert cards, "examples/prices.yaml should show a GPU-hour card with prefill_tok_s / decode_tok_s"
    self_hosted = [r for r in pf.rates if r.source == "self_hosted_amortized"]
    assert self_hosted and all(r.input_per_mtok > 0 and r.output_per_mtok > r.input_per_mtok for r in self_hosted)


def test_reports_split_self_hosted_and_hosted_spend_per_app(db_url: str) -> None:
    ledger = Ledger.open(db_url, clock=lambda: datetime(2026, 10, 20, tzinfo=UTC))
    try:
        store_prices(ledger, parse_price_data(PRICES))
        # the self-hosted events carry route_kind "direct" (as a plugin without the kind would record them): the
        # price file's backend entry decides the kind
        ledger.insert_events(
            [event(i, backend_id="vllm-a", provider="self_hosted", served_model="llama-8b", route_kind="direct")
             for i in range(3)]
            + [event(10 + i) for i in range(2)]
            + [event(20, app_id="beta", backend_id="vllm-a", provider="self_hosted", served_model="llama-8b")]
            + [event(30, attempt=0, is_final=False, status="provider_failure", provider_cost=Decimal("0.004"))])
        catalog = ledger.catalog()
        with ledger.engine.connect() as conn:
            by_app = usage_report(conn, catalog, "2026-10", by="app")
            margin = margin_report(conn, catalog, "2026-10", by="app")
            by_backend = usage_report(conn, catalog, "2026-10", by="backend")
    finally:
        ledger.close()
    rows = {r["app_id"]: r for r in by_app}
    acme, beta = rows["acme"], rows["beta"]
    assert (acme["self_hosted_requests"], acme["hosted_requests"]) == (3, 2)
    assert (beta["self_hosted_requests"], beta["hosted_requests"]) == (1, 0)
    for row in (*by_app, *margin, *by_backend):
        assert row["self_hosted_cost"] + row["hosted_cost"] == row["provider_cost"] + row["absorbed_cost"]
    self_rows = [r for r in by_backend if r["backend_id"] == "vllm-a" and r["app_id"] == "acme"]
    hosted_rows = [r for r in by_backend if r["backend_id"] == "or-claude" and r["app_id"] == "acme"]
    assert acme["self_hosted_cost"] == sum(r["provider_cost"] + r["absorbed_cost"] for r in self_rows) > 0
    assert acme["hosted_cost"] == sum(r["provider_cost"] + r["absorbed_cost"] for r in hosted_rows) > 0
    assert beta["hosted_cost"] == 0 and beta["self_hosted_cost"] > 0
    m = {r["app_id"]: r for r in margin}["acme"]
    assert (m["self_hosted_cost"], m["hosted_cost"]) == (acme["self_hosted_cost"], acme["hosted_cost"])
    total = totals(by_app)[0]
    assert total["self_hosted_cost"] == acme["self_hosted_cost"] + beta["self_hosted_cost"]


def test_a_gpu_hour_card_wins_over_litellms_model_list_cost_and_is_the_fallback_otherwise() -> None:
    pf = parse_price_data(card_prices(gpu_hour="3.60 USD", prefill_tok_s=10000, decode_tok_s=1000))
    card = pf.rates[0]
    tokens = TokenBuckets(1000, 0, 0, 0, 400, 0)
    typed = Decimal("0.123")  # what LiteLLM computed from the replica's model_list per-token price
    e = event(1, backend_id="vllm-a", provider="vllm", route_kind="self_hosted", served_model="llama-8b",
              tokens=tokens, litellm_cost=typed)
    rating = rate_event(e, card, None)
    assert (rating.provider_cost, rating.cost_source) == (Decimal("0.0005"), "self_hosted_amortized")
    inp, out = card.per_token()  # the price the hybrid router takes: the same amount for the same tokens
    assert inp * 1000 + out * 400 == rating.provider_cost
    assert rate_event(e, None, None).provider_cost == typed  # no card: the model_list price books
    manual = parse_price_data(card_prices(input_per_mtok="0.1", output_per_mtok="1")).rates[0]
    assert rate_event(e, manual, None).cost_source == "litellm"  # only an amortised card comes first
    reported = event(2, backend_id="vllm-a", provider="vllm", tokens=tokens, provider_cost=Decimal("0.9"))
    assert rate_event(reported, card, None).cost_source == "provider_reported"  # an explicit figure still wins


def test_a_backend_with_a_gpu_hour_card_is_self_hosted_unless_the_file_says_otherwise() -> None:
    prices = card_prices(gpu_hour="3.60 USD", prefill_tok_s=10000, decode_tok_s=1000)
    del prices["backends"][0]["route_kind"]
    del prices["backends"][1]["route_kind"]
    kinds = {b.backend_id: b.route_kind for b in parse_price_data(prices).backends}
    assert kinds == {"vllm-a": "self_hosted", "or-claude": "direct"}
    prices["backends"][0]["route_kind"] = "direct"
    assert parse_price_data(prices).backends[0].route_kind == "direct"
