"""Rating formulas, price-file validation, JSON event schema."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from billing_helpers import PRICES, event
from hypothesis import given
from hypothesis import strategies as st

from kvroute.billing.events import event_from_json, event_id_for
from kvroute.billing.periods import allocate
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.pricing import CostRate, PriceBook, PriceRule, rate_event
from kvroute.billing.usage import TokenBuckets
from kvroute.policies.errors import ConfigError, InputError

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RATE = CostRate("or-claude", T0, input_per_mtok=Decimal(3), cache_read_per_mtok=Decimal("0.3"),
                cache_write_5m_per_mtok=Decimal("3.75"), output_per_mtok=Decimal(15))


def book(*rules: PriceRule) -> PriceBook:
    return PriceBook("acme", 1, T0, rules=rules)


def test_a_request_that_reached_no_backend_has_nothing_to_price() -> None:
    e = event(status="no_route", is_final=True, backend_id="router", provider="litellm-router", route_kind="direct",
              tokens=TokenBuckets(0, 0, 0, 0, 0, 0))
    r = rate_event(e, None, book(PriceRule("r", 0, markup_pct=Decimal("0.2"), fee_per_request=Decimal("0.01"))))
    assert (r.cost_source, r.provider_cost, r.billed_amount, r.absorbed_cost) == ("not_called", 0, 0, 0)


def test_cost_from_rate_card_and_markup_surcharge_fee() -> None:
    e = event(tokens=TokenBuckets(1000, 3000, 200, 0, 400, 0))
    rule = PriceRule("r", 0, markup_pct=Decimal("0.2"), surcharge_per_mtok={"input": Decimal("0.5"),
                                                                              "output": Decimal(1)},
                     fee_per_request=Decimal("0.001"))
    r = rate_event(e, RATE, book(rule))
    cost = (1000 * 3 + 3000 * Decimal("0.3") + 200 * Decimal("3.75") + 400 * 15) / Decimal(1_000_000)
    assert r.provider_cost == cost and r.cost_source == "rate_card"
    surcharge = (1000 * Decimal("0.5") + 400 * 1) / Decimal(1_000_000)
    assert r.surcharge_amount == surcharge
    assert r.billed_amount == cost + cost * Decimal("0.2") + surcharge + Decimal("0.001")
    assert r.markup_amount == cost * Decimal("0.2") and r.absorbed_cost == 0


def test_cost_source_order_reported_then_litellm_then_rate_card() -> None:
    e = event(provider_cost=Decimal("0.01"), litellm_cost=Decimal("0.02"))
    assert rate_event(e, RATE, None).provider_cost == Decimal("0.01")
    e = event(litellm_cost=Decimal("0.02"))
    r = rate_event(e, RATE, None)
    assert (r.provider_cost, r.cost_source) == (Decimal("0.02"), "litellm")
    assert rate_event(event(), None, None).cost_source == "unknown"


def test_min_max_clamp_and_unbilled_attempts() -> None:
    e = event(provider_cost=Decimal("0.00001"))
    r = rate_event(e, None, book(PriceRule("m", 0, min_per_request=Decimal("0.001"))))
    assert r.billed_amount == Decimal("0.001") and r.markup_amount == Decimal("0.00099")
    r = rate_event(event(provider_cost=Decimal(5)), None, book(PriceRule("m", 0, max_per_request=Decimal(1))))
    assert r.billed_amount == 1
    failed = event(provider_cost=Decimal("0.5"), is_final=False, status="provider_failure")
    r = rate_event(failed, None, book(PriceRule("m", 0, markup_pct=Decimal("0.5"))))
    assert r.billed_amount == 0 and r.absorbed_cost == Decimal("0.5")
    r = rate_event(failed, None, book(PriceRule("m", 0, markup_pct=Decimal("0.5"), bill_failed_attempts=True)))
    assert r.billed_amount == Decimal("0.75")
    empty = event(provider_cost=Decimal("0.1"), status="zero_completion")
    assert rate_event(empty, None, book(PriceRule("m", 0))).billed_amount == 0
    assert rate_event(empty, None, book(PriceRule("m", 0, bill_zero_completion=True))).billed_amount == Decimal("0.1")


def test_first_matching_rule_wins() -> None:
    rules = (PriceRule("claude", 0, match_model="claude-*", markup_pct=Decimal("0.3")),
             PriceRule("rest", 1, markup_pct=Decimal("0.1")))
    assert rate_event(event(provider_cost=Decimal(1)), None, book(*rules)).billed_amount == Decimal("1.3")
    other = event(provider_cost=Decimal(1), served_model="gpt-x")
    assert rate_event(other, None, book(*rules)).billed_amount == Decimal("1.1")


def test_reasoning_rate_applies_to_the_reasoning_part_only() -> None:
    rate = CostRate("b", T0, output_per_mtok=Decimal(10), reasoning_per_mtok=Decimal(20))
    assert rate.cost(TokenBuckets(0, 0, 0, 0, 100, 40)) == (60 * 10 + 40 * 20) / Decimal(1_000_000)


@given(st.lists(st.decimals(min_value=Decimal("-5"), max_value=Decimal("50"), places=10), min_size=1,
                max_size=60))
def test_allocation_sums_to_the_rounded_total(amounts: list[Decimal]) -> None:
    rounded = allocate(amounts, "USD")
    assert sum(rounded) == sum(amounts).quantize(Decimal("0.01"), rounding="ROUND_HALF_EVEN")
    assert all(abs(r - a) < Decimal("0.01") for r, a in zip(rounded, amounts, strict=True))


def test_price_file_errors_name_the_rule() -> None:
    bad = json.loads(json.dumps(PRICES))
    bad["price_books"][1]["rules"][0]["surcharge_per_mtok"]["outptu"] = "1"
    with pytest.raises(ConfigError) as err:
        parse_price_data(bad)
    assert err.value.key == "price_books[acme v1].rules[claude].surcharge_per_mtok.outptu"
    bad = json.loads(json.dumps(PRICES))
    bad["price_books"][1]["rules"][1]["fee_per_request"] = "abc"
    with pytest.raises(ConfigError, match=r"rules\[selfhosted\]\.fee_per_request"):
        parse_price_data(bad)
    bad = json.loads(json.dumps(PRICES))
    bad["price_books"][1]["rules"][1]["min_per_request"] = "5"
    bad["price_books"][1]["rules"][1]["max_per_request"] = "1"
    with pytest.raises(ConfigError, match="above max_per_request"):
        parse_price_data(bad)
    pf = parse_price_data(PRICES)
    vllm = next(r for r in pf.rates if r.backend_id == "vllm-a")
    assert vllm.input_per_mtok == Decimal(1) and vllm.source == "self_hosted_amortized"  # 3.60 $/h ÷ 3.6 Mtok/h


def test_event_json_round_trip_and_field_errors() -> None:
    e = event(provider_cost=Decimal("0.0012345678901"), end_user="u1")
    back = event_from_json(json.loads(e.to_line(), parse_float=Decimal), archive=True)
    assert back == e and back.event_id == event_id_for("acme", "req-0", 0)
    line = e.to_json()
    for field, value, where in [("occurred_at", "2026-10-03 12:00", "occurred_at"),
                                ("status", "ok", "status"), ("usage", {"output": -1}, "usage.output"),
                                ("provider_cost", "1e", "provider_cost"), ("colour", 1, "colour"),
                                ("event_id", "0" * 32, "event_id")]:
        broken = {**line, field: value}
        with pytest.raises(InputError) as err:
            event_from_json(broken)
        assert err.value.where == where
    raw = {**{k: v for k, v in line.items() if k not in ("usage", "event_id")},
           "raw_usage": {"input_tokens": 5, "cache_read_input_tokens": 10, "output_tokens": 2}}
    assert event_from_json(raw).tokens == TokenBuckets(5, 10, 0, 0, 2, 0)
