"""Hedging's pure parts: the delay from a route's own TTFT quantile, the budget, the pause, the second route."""

from __future__ import annotations

import pytest

from kvroute.policies.errors import ConfigError
from kvroute.policies.hedging import HedgeBudget, HedgeConfig, Hedger, HedgeRoute, size_class


def test_the_config_reads_percent_budgets_and_refuses_typos():
    cfg = HedgeConfig.parse({"budget": "5%", "min_delay_ms": 100, "max_delay_ms": 2000})
    assert (cfg.budget, cfg.min_delay_s, cfg.max_delay_s, cfg.quantile) == (0.05, 0.1, 2.0, 0.95)
    assert HedgeConfig.parse({"budget": 0.1}).budget == 0.1
    with pytest.raises(ConfigError, match=r"hedge\.budget"):
        HedgeConfig.parse({"budget": 5})  # 500 %? a bare number must be a fraction
    with pytest.raises(ConfigError, match=r"hedge\.budjet"):
        HedgeConfig.parse({"budjet": "5%"})
    with pytest.raises(ConfigError, match="max_delay_ms"):
        HedgeConfig.parse({"min_delay_ms": 500, "max_delay_ms": 100})


def test_no_hedge_before_enough_samples_then_the_routes_own_quantile_clamped():
    h = Hedger(HedgeConfig(min_samples=20, quantile=0.95, min_delay_s=0.2, max_delay_s=5.0))
    for i in range(19):
        h.learn("a", 1000, 0.3, now=float(i))
    assert h.delay("a", 1000, now=20.0) is None
    h.learn("a", 1000, 0.9, now=19.0)  # 1 in 20 slow: the 95th percentile is the 19th of 20
    assert h.delay("a", 1000, now=20.0) == 0.3
    for i in range(5):
        h.learn("a", 1000, 9.0, now=20.0 + i)
    assert h.delay("a", 1000, now=30.0) == 5.0  # clamped to max_delay_s
    assert h.delay("a", 20000, now=30.0) is None  # another prompt-size class has its own samples
    assert size_class(100) < size_class(5000) < size_class(100_000)


def test_the_budget_never_lets_more_than_floor_plus_budget_times_requests_through():
    b = HedgeBudget(0.05, floor=2)
    allowed = 0
    for _ in range(1000):
        b.on_request()
        allowed += b.try_spend()
    assert allowed <= 2 + 0.05 * 1000
    assert allowed >= 0.05 * 1000 - 1  # and it does let the budget through


def route(name: str, **kw) -> HedgeRoute:
    return HedgeRoute(name, hosted=kw.pop("hosted", True), model=kw.pop("model", "m"), **kw)


def test_the_second_route_is_hosted_same_model_and_isolation_closed_and_never_bills_a_loser_in_full():
    h = Hedger(HedgeConfig(floor=10))
    primary = route("a")
    others = [route("self", hosted=False), route("other-model", model="x"), route("open", breaker_closed=False),
              route("bedrock", bills_loser_in_full=True),
              route("cold", expected_hit=0.0, price=1.0), route("warm", expected_hit=0.8, price=2.0)]
    assert h.choose(primary, [primary, *others]).backend == "warm"  # likeliest to hold the prompt cached
    assert h.choose(primary, [primary, *others[:4]]) is None
    assert h.should_hedge(route("self", hosted=False), others) is None  # a replica's request is never hedged


def test_hedging_pauses_when_most_routes_are_late():
    h = Hedger(HedgeConfig(floor=10))
    routes = [route("a"), route("b"), route("c")]
    h.late("a")
    assert h.should_hedge(routes[0], routes) is not None  # one of three late: a stall, not an outage
    h.late("b")
    assert h.paused(r.backend for r in routes)
    assert h.should_hedge(routes[0], routes) is None
    h.settled("b")
    assert not h.paused(r.backend for r in routes)
