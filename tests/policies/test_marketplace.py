"""Marketplace ranking (cache-adjusted price, speed, tier, health), app rules, provider stickiness."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvroute.policies import Router, RoutingState, build_policy
from kvroute.policies.errors import ConfigError
from kvroute.policies.health import BreakerConfig, HealthBoard, Outcome
from kvroute.policies.load import LoadTracker
from kvroute.policies.marketplace import (
    Marketplace,
    MarketplaceConfig,
    ProviderQuote,
)
from kvroute.policies.prefix_index import PrefixIndex
from kvroute.policies.request import RoutingRequest


def quote(backend, provider=None, inp="0.000003", out="0.000015", read=None, tier="standard", **kw):
    return ProviderQuote(backend, provider or backend, "m", Decimal(inp), Decimal(out),
                         Decimal(read) if read is not None else None, uptime_tier=tier, **kw)


def req(session=None, app=None, prompt=4000, keys=(11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155,
                                                   166, 177, 188), rid="r"):
    return RoutingRequest(model="m", keys=list(keys), block_tokens=64.0, prompt_tokens=prompt,
                          session_key=session, app=app, request_id=rid)


STATE = RoutingState(index=PrefixIndex(), load=LoadTracker())


def pick(policy, request, candidates, now=0.0):
    return policy.select(request, candidates, STATE, now)


def test_cache_adjusted_price_learns_expected_hit():
    mp = Marketplace(MarketplaceConfig(ttft_weight=0, throughput_weight=0))
    mp.set_quotes([quote("caching", inp="0.000003", read="0.0000003"), quote("flat", inp="0.000002")])
    assert pick(mp, req(), ["caching", "flat"]).backend == "flat"
    for _ in range(20):
        mp.learn("caching", 1.0, prompt_tokens=1000, cached_tokens=900)
    assert mp.expected_hit("caching") == pytest.approx(0.9, abs=0.02)
    eff = mp.effective_price("caching")
    assert isinstance(eff, Decimal) and eff < Decimal("0.000001")
    d = pick(mp, req(), ["caching", "flat"], 2.0)
    assert d.backend == "caching" and d.reason == "best_score"
    assert d.scores["caching"] < d.scores["flat"]


def test_effective_price_is_exact_decimal():
    q = quote("a", inp="0.000003", read="0.0000003")
    assert q.effective_input_price(0.5) == Decimal("0.00000165")
    assert q.effective_input_price(2.0) == Decimal("0.0000003")  # clamped to [0, 1]


def test_ttft_and_throughput_rank_equal_prices():
    mp = Marketplace()
    mp.set_quotes([quote("slow"), quote("fast")])
    for i in range(10):
        mp.learn("slow", float(i), ttft_s=2.0, output_tokens=100, duration_s=10.0)
        mp.learn("fast", float(i), ttft_s=0.2, output_tokens=100, duration_s=1.0)
    assert pick(mp, req(), ["slow", "fast"], 10.0).backend == "fast"


def test_uptime_tier_and_unpriced_backends_rank_last():
    mp = Marketplace()
    mp.set_quotes([quote("a", tier="best_effort"), quote("b", tier="premium")])
    assert pick(mp, req(), ["a", "b"]).backend == "b"
    d = pick(mp, req(), ["a", "unknown"])
    assert d.backend == "a" and d.scores["unknown"] >= d.scores["a"]
    with pytest.raises(ConfigError, match="uptime_tier"):
        mp.set_quotes([quote("x", tier="gold")])


def test_health_penalty_lowers_rank_and_open_breakers_are_filtered():
    board = HealthBoard(BreakerConfig(jitter=0.0, ttft_slo_s=1.0, eval_interval_s=0.0))
    mp = Marketplace(health=board)
    mp.set_quotes([quote("cheap", inp="0.000001"), quote("dear", inp="0.000002")])
    assert pick(mp, req(), ["cheap", "dear"]).backend == "cheap"
    for i in range(10):  # cheap gets slow: degraded, still closed
        board.record("cheap", Outcome.SUCCESS, float(i), ttft_s=5.0)
    assert board.state("cheap") == "closed"
    assert pick(mp, req(), ["cheap", "dear"], 10.0).backend == "dear"
    board.record("dear", Outcome.CONFIG_FAILURE, 11.0)
    assert pick(mp, req(), ["cheap", "dear"], 12.0).backend == "cheap"
    board.record("cheap", Outcome.CAPACITY, 12.0, retry_after_s=30)
    d = pick(mp, req(), ["cheap", "dear"], 13.0)  # both open: the one back first (29 s against 898 s) is tried
    assert (d.backend, d.reason) == ("cheap", "breakers_open")
    assert pick(mp, req(), ["cheap", "dear"], 43.0).backend == "cheap"


def test_every_route_open_tries_the_one_back_soonest_but_never_one_a_rule_refuses():
    board = HealthBoard(BreakerConfig(jitter=0.0))
    mp = Marketplace(MarketplaceConfig(apps={"frugal": {"max_price": {"prompt": "1.5", "completion": "20"}}}),
                     health=board)
    mp.set_quotes([quote("a", inp="0.000001"), quote("b", inp="0.000001"), quote("dear", inp="0.000009")])
    board.record("a", Outcome.CAPACITY, 0.0, retry_after_s=5)
    board.record("b", Outcome.CAPACITY, 0.0, retry_after_s=2)
    board.record("dear", Outcome.CAPACITY, 0.0, retry_after_s=1)
    assert pick(mp, req(), ["a", "b", "dear"], 0.5).backend == "dear"  # back in 0.5 s
    d = pick(mp, req(app="frugal"), ["a", "b", "dear"], 0.5)  # over its max price, dear is never tried
    assert (d.backend, d.reason) == ("b", "breakers_open")
    assert pick(mp, req(app="frugal"), ["dear"], 0.5).reason == "no_acceptable_provider:over_max_price"
    assert pick(mp, req(), ["a", "b", "dear"], 2.5).reason != "breakers_open"  # dear and b closed again


def test_app_allow_deny_order_and_max_price():
    cfg = MarketplaceConfig(apps={
        "acme": {"allow": ["openai", "shareai"], "deny": ["shareai/b2"]},
        "ordered": {"order": ["anthropic", "openai"]},
        "frugal": {"max_price": {"prompt": "1.5", "completion": "20"}},
        "*": {"deny": ["anthropic"]},
    })
    mp = Marketplace(cfg)
    mp.set_quotes([
        quote("openai/a", "openai", inp="0.0000025"),
        quote("shareai/b1", "shareai", inp="0.000001"),
        quote("shareai/b2", "shareai", inp="0.0000005"),
        quote("anthropic/c", "anthropic", inp="0.000003"),
    ])
    all_ = ["openai/a", "shareai/b1", "shareai/b2", "anthropic/c"]
    assert pick(mp, req(app="acme"), all_).backend == "shareai/b1"
    d = pick(mp, req(app="ordered"), all_)
    assert d.backend == "anthropic/c" and d.reason == "app_order"
    assert pick(mp, req(app="someone"), ["anthropic/c"]).reason == "no_acceptable_provider:denied"
    assert pick(mp, req(app="someone"), all_).backend == "shareai/b2"
    assert pick(mp, req(app="frugal"), all_).backend == "shareai/b2"
    d = pick(mp, req(app="frugal"), ["openai/a", "anthropic/c"])
    assert d.backend is None and d.reason == "no_acceptable_provider:over_max_price"
    assert pick(mp, req(app="frugal"), ["not-priced"]).reason == "no_acceptable_provider:unpriced"
    strict = Marketplace(MarketplaceConfig(apps={"a": {"max_price": {"completion": "12"}}}))
    strict.set_quotes([quote("x", out="0.000015"), quote("y", out="0.000012")])
    assert pick(strict, req(app="a"), ["x", "y"]).backend == "y"  # 12/Mtok is at the cap, not over it


def test_max_context_filter():
    mp = Marketplace()
    mp.set_quotes([quote("small", inp="0.000001", max_context=2048), quote("big")])
    assert pick(mp, req(prompt=4000), ["small", "big"]).backend == "big"
    assert pick(mp, req(prompt=1000), ["small", "big"]).backend == "small"


def test_session_stickiness_keeps_the_provider_cache_warm():
    board = HealthBoard(BreakerConfig(jitter=0.0, consecutive_failures=2))
    mp = Marketplace(MarketplaceConfig(ttft_weight=0, throughput_weight=0), health=board)
    mp.set_quotes([quote("a", inp="0.000002", read="0.0000002"), quote("b", inp="0.000002", read="0.0000002")])
    r = req(session="s1")
    first = pick(mp, r, ["a", "b"]).backend
    other = "b" if first == "a" else "a"
    mp.record_success(r, first, 1.0, cached_tokens=0)  # with a session id any success pins
    # The other one becomes cheaper on paper; the conversation stays where its cache is.
    for _ in range(10):
        mp.learn(other, 2.0, prompt_tokens=1000, cached_tokens=1000)
    d = pick(mp, r, ["a", "b"], 3.0)
    assert d.backend == first and d.reason == "provider_sticky"
    # A failure on the sticky provider does not move the pin.
    board.record(first, Outcome.PROVIDER_FAILURE, 4.0)
    assert pick(mp, r, ["a", "b"], 5.0).backend == first
    # Stickiness yields to health: an open breaker sends the session elsewhere ...
    board.record(first, Outcome.PROVIDER_FAILURE, 6.0)
    d = pick(mp, r, ["a", "b"], 7.0)
    assert d.backend == other and d.reason == "best_score"
    # ... and the next success there re-pins it.
    mp.record_success(r, other, 8.0, cached_tokens=0)
    assert pick(mp, r, ["a", "b"], 100.0).backend == other
    # Idle TTL (10 min): after it, ranking decides again.
    assert mp.sticky_backend(r, 8.0 + 599) == other
    assert mp.sticky_backend(r, 8.0 + 601) is None


def test_stickiness_only_where_cache_reads_are_cheaper():
    mp = Marketplace()
    mp.set_quotes([quote("flat", inp="0.000002"), quote("cheap", inp="0.000001")])
    r = req(session="s")
    mp.record_success(r, "flat", 0.0, cached_tokens=500)
    assert mp.sticky_backend(r, 1.0) is None
    assert pick(mp, r, ["flat", "cheap"], 1.0).backend == "cheap"


def test_prefix_stickiness_starts_after_a_cache_hit():
    mp = Marketplace(MarketplaceConfig(ttft_weight=0, throughput_weight=0))
    mp.set_quotes([quote("a", inp="0.000002", read="0.0000002"), quote("b", inp="0.0000021", read="0.0000002")])
    r = req()
    mp.record_success(r, "b", 0.0, cached_tokens=0)
    assert mp.sticky_backend(r, 1.0) is None
    mp.record_success(r, "b", 1.0, cached_tokens=1024)
    assert mp.sticky_backend(r, 2.0) == "b"
    assert pick(mp, r, ["a", "b"], 2.0).reason == "provider_sticky"
    # Same prefix, different tail: same conversation key.
    r2 = req(keys=(11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 999, 998))
    assert pick(mp, r2, ["a", "b"], 3.0).backend == "b"


def test_sticky_moves_to_another_endpoint_of_the_same_provider():
    mp = Marketplace()
    mp.set_quotes([quote("or/x1", "openrouter", read="0.0000003"), quote("or/x2", "openrouter", read="0.0000003"),
                   quote("cheap", inp="0.000001")])
    r = req(session="s")
    mp.record_success(r, "or/x1", 0.0)
    d = pick(mp, r, ["or/x2", "cheap"], 1.0)
    assert d.backend == "or/x2" and d.reason == "provider_sticky"


def test_app_order_disables_stickiness():
    mp = Marketplace(MarketplaceConfig(apps={"o": {"order": ["b"]}}))
    mp.set_quotes([quote("a", read="0.0000001"), quote("b", read="0.0000001")])
    r = req(session="s", app="o")
    mp.record_success(r, "a", 0.0)
    assert pick(mp, r, ["a", "b"], 1.0).backend == "b"


def test_registry_and_router_integration():
    router = Router(clock=lambda: 5.0)
    policy = router.set_policy("hosted", "marketplace", {
        "quotes": {"p1": {"provider": "openai", "input_price": "0.000002", "output_price": "0.000008",
                          "cache_read_price": "0.0000005", "kind": "openai"},
                   "p2": {"provider": "openrouter", "input_price": "0.000001", "output_price": "0.000004",
                          "kind": "openrouter"}},
        "apps": {"strict": {"allow": ["openai"]}},
    })
    assert isinstance(policy, Marketplace)
    kwargs = {"model": "m", "messages": [{"role": "user", "content": "x" * 8000}]}
    _, decision = router.route(kwargs, ["p1", "p2"], group="hosted")
    assert decision.policy == "marketplace" and decision.backend == "p2"
    _, decision = router.route(kwargs, ["p1", "p2"], group="hosted", app="strict")
    assert decision.backend == "p1"


@pytest.mark.parametrize(
    ("knobs", "key"),
    [
        ({"apps": {"a": {"allow": "openai"}}}, "groups.g.apps"),
        ({"apps": {"a": {"colour": []}}}, "groups.g.apps"),
        ({"apps": {"a": {"max_price": {"prompt": "-1"}}}}, "groups.g.apps"),
        ({"quotes": {"b": {"input_price": "x", "output_price": "1"}}}, "groups.g.quotes"),
        ({"quotes": {"b": {"output_price": "1"}}}, "groups.g.quotes"),
        ({"quotes": {"b": {"input_price": "1", "output_price": "1", "uptime_tier": "gold"}}}, "groups.g.quotes"),
        ({"hit_alpha": 0}, "groups.g.hit_alpha"),
        ({"nope": 1}, "groups.g.nope"),
    ],
)
def test_bad_knobs_name_the_key(knobs, key):
    with pytest.raises(ConfigError) as info:
        build_policy("marketplace", knobs, where="groups.g")
    assert info.value.key == key


def test_router_applies_app_rules_to_a_single_candidate():
    router = Router()
    router.set_policy("hosted", "marketplace", {
        "quotes": {"p1": {"provider": "openai", "input_price": "0.00001", "output_price": "0.00003"}},
        "apps": {"frugal": {"max_price": {"prompt": "1"}}},
    })
    kwargs = {"model": "m", "messages": [{"role": "user", "content": "hello " * 100}]}
    _, decision = router.route(kwargs, ["p1"], group="hosted", app="frugal")
    assert decision.backend is None and decision.reason == "no_acceptable_provider:over_max_price"
    _, decision = router.route(kwargs, ["p1"], group="hosted", app="other")
    assert decision.backend == "p1"
