"""Simulated hosted providers: TTFT distribution, prices with cache reads, rate limits with
Retry-After, outages, and their integration with the replica simulator through real policy objects."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest

from kvroute.billing.pricing import token_cost
from kvroute.policies.errors import ConfigError
from kvroute.policies.hybrid import Hybrid
from kvroute.policies.rolling import percentile
from kvroute.sim.engine import FleetConfig
from kvroute.sim.hosted import HostedBackend, HostedSpec, read_hosted
from kvroute.sim.mixed_fleet import Strategy, Tier, simulate_mixed
from kvroute.sim.presets import get_preset
from kvroute.sim.spend import replica_rate_card
from kvroute.sim.strategies import build_strategy
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

BT = 64
QWEN = get_preset("qwen3-32b-h100-tp2")


def spec(name: str = "p", **over: object) -> HostedSpec:
    fields: dict = {"ttft_p50_s": 0.4, "ttft_p90_s": 1.0, "output_tok_s": 50.0, "input_per_mtok": Decimal("1"),
                    "output_per_mtok": Decimal("2"), "cached_per_mtok": Decimal("0.1"), "cache_hit_prob": 1.0}
    fields.update(over)
    return HostedSpec(name, **fields)


def keys(n_blocks: int, seg: int = 1) -> list[int]:
    return SegmentKeys(BT).keys([(seg, n_blocks * BT)])


def test_ttft_follows_the_lognormal_p50_and_p90() -> None:
    b = HostedBackend(spec(), BT, seed=3)
    ttfts = sorted(b.attempt(i * 1.0, 100, 10, []).first_token_at - i * 1.0 for i in range(4000))
    assert percentile(ttfts, 0.5) == pytest.approx(0.4, rel=0.06)
    assert percentile(ttfts, 0.9) == pytest.approx(1.0, rel=0.06)
    ok = b.attempt(10_000.0, 100, 51, [])
    assert ok.done_at - ok.first_token_at == pytest.approx(50 / 50.0)  # the 50 tokens after the first at 50 tok/s


def test_cache_reads_need_the_prefix_served_before_within_the_ttl_and_cost_less() -> None:
    b = HostedBackend(spec(cache_ttl_s=300.0, cache_min_tokens=1024), BT)
    prompt = keys(40)  # 2,560 tokens
    first = b.attempt(0.0, 40 * BT + 10, 100, prompt)
    again = b.attempt(10.0, 40 * BT + 10, 100, prompt)
    assert first.cached_tokens == 0 and again.cached_tokens == 40 * BT
    assert again.cost == token_cost(b.rate, input_uncached=10, cache_read=40 * BT, output=100) < first.cost
    assert first.cost == (Decimal(40 * BT + 10) * 1 + 100 * 2) / 1_000_000
    short = keys(8, seg=2)  # 512 tokens: below the provider's minimum cacheable prefix
    b.attempt(20.0, 8 * BT + 5, 10, short)
    assert b.attempt(21.0, 8 * BT + 5, 10, short).cached_tokens == 0
    assert b.attempt(10.0 + 301.0, 40 * BT + 10, 100, prompt).cached_tokens == 0  # idle past the TTL


def test_rpm_and_tpm_limits_answer_429_with_retry_after() -> None:
    b = HostedBackend(spec(rpm=3), BT)
    assert [b.attempt(t, 100, 10, []).kind for t in (0.0, 10.0, 20.0)] == ["ok"] * 3
    limited = b.attempt(30.0, 100, 10, [])
    assert limited.kind == "rate_limited" and limited.retry_after_s == pytest.approx(30.0)
    assert limited.cost == 0
    assert b.attempt(60.5, 100, 10, []).kind == "ok"  # the first one left the window
    t = HostedBackend(spec(tpm=1000), BT)
    assert t.attempt(0.0, 600, 100, []).kind == "ok"
    assert t.attempt(1.0, 600, 100, []).kind == "rate_limited"
    assert t.attempt(1.0, 200, 50, []).kind == "ok"


def test_outage_windows_fail_fast_and_end() -> None:
    b = HostedBackend(spec(outages=((100.0, 160.0),), error_latency_s=0.3), BT)
    down = b.attempt(120.0, 100, 10, [])
    assert down.kind == "error" and down.answered_at == pytest.approx(120.3)
    assert b.attempt(99.0, 100, 10, []).kind == "ok" and b.attempt(160.0, 100, 10, []).kind == "ok"


@pytest.mark.parametrize(("raw", "key"), [
    ({"routes": {"a": {"price": {"input": "1", "output": "2"}, "ttft": {"p50": 0.5, "p90": 0.4},
                       "output_tok_s": 10}}}, "ttft_p90_s"),
    ({"routes": {"a": {"price": {"input": "-1", "output": "2"}, "ttft": {"p50": 0.5, "p90": 1},
                       "output_tok_s": 10}}}, "input_per_mtok"),
    ({"routes": {"a": {"price": {"input": "1", "output": "2"}, "ttft": {"p50": 0.5, "p90": 1},
                       "output_tok_s": 10, "rpm": 0}}}, "rpm"),
    ({"routes": {"a": {"price": {"input": "1", "output": "2"}, "ttft": {"p50": 0.5, "p90": 1},
                       "output_tok_s": 10, "speed": 3}}}, "speed"),
    ({"routes": {"a": {"price": {"input": "1"}, "ttft": {"p50": 0.5, "p90": 1}, "output_tok_s": 10}}}, "price"),
    ({"routes": {"a": {"price": {"input": "1", "output": "2"}, "ttft": {"p50": 0.5, "p90": 1},
                       "output_tok_s": 10, "outages": [[5, 1]]}}}, "outages"),
    ({"routes": {}}, "routes"),
    ({"routes": {"a": {}}, "ttft_target_s": 0}, "ttft_target_s"),
    ({"routes": {"a": {}}, "target": 1}, "target"),
])
def test_bad_hosted_files_name_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        read_hosted(raw)
    assert key in str(err.value)


def burst(n: int, at: float = 0.0, gap: float = 0.0, prompt_blocks: int = 30, output: int = 50) -> Workload:
    kb = SegmentKeys(BT)
    reqs = [SimRequest(prompt_blocks * BT, output, kb.keys([(i + 1, prompt_blocks * BT)]), at + i * gap, app="a")
            for i in range(n)]
    return Workload("burst", BT, reqs)


def test_a_429_is_retried_on_the_next_route_and_a_full_house_waits_for_retry_after() -> None:
    card = replica_rate_card(QWEN)
    fleet = FleetConfig(1, QWEN)
    routes = [spec("a", rpm=2), spec("b", rpm=1)]
    strategy = build_strategy("always_hosted", fleet, routes, target_s=2.0, card=card)
    result = simulate_mixed(burst(4, gap=1.0), strategy, fleet, routes, card.cost_rate("self"))
    served = [t.backend for t in result.tracks]
    assert sorted(served[:3]) == ["a", "a", "b"] and all(t.hosted for t in result.tracks)
    last = result.tracks[3]  # every route full at t=3: waits for the soonest Retry-After (a's window frees at 60)
    assert last.backend == "a" and last.ttft >= 60.0 - 3.0 and last.failures == 2
    assert result.failures["a:rate_limited"] >= 1 and result.failures["b:rate_limited"] >= 1


def test_an_outage_fails_over_and_the_breaker_keeps_traffic_away() -> None:
    card = replica_rate_card(QWEN)
    fleet = FleetConfig(1, QWEN)
    cheap_down = spec("cheap", input_per_mtok=Decimal("0.1"), output_per_mtok=Decimal("0.2"),
                      outages=((0.0, 1000.0),))
    routes = [cheap_down, spec("dear")]
    strategy = build_strategy("always_hosted", fleet, routes, target_s=2.0, card=card)
    result = simulate_mixed(burst(30, gap=0.5), strategy, fleet, routes, card.cost_rate("self"))
    assert all(t.backend == "dear" and math.isfinite(t.first_token_at) for t in result.tracks)
    assert 1 <= result.failures["cheap:error"] < 30  # the breaker opened: most requests never tried it


def test_fallback_on_error_overflows_only_when_a_replica_queue_is_full() -> None:
    card = replica_rate_card(QWEN)
    fleet = FleetConfig(1, QWEN)
    routes = [spec("h")]
    quiet = simulate_mixed(burst(5, gap=2.0), build_strategy("fallback_on_error", fleet, routes, target_s=2.0,
                                                             card=card, queue_limit=4), fleet, routes,
                           card.cost_rate("self"))
    assert not any(t.hosted for t in quiet.tracks)
    rate = card.cost_rate("self")
    for t in quiet.tracks:
        assert t.cost == token_cost(rate, input_uncached=t.prompt - t.cached_tokens, cache_read=t.cached_tokens,
                                    output=t.output)
    flood = simulate_mixed(burst(300, prompt_blocks=120), build_strategy(
        "fallback_on_error", fleet, routes, target_s=2.0, card=card, queue_limit=4), fleet, routes, rate)
    assert any(t.hosted for t in flood.tracks) and flood.failures["replica-0:queue_full"] >= 1


def test_hybrid_is_the_real_policy_and_overflows_a_burst_only() -> None:
    card = replica_rate_card(QWEN)
    fleet = FleetConfig(2, QWEN)
    routes = [spec("h", ttft_p50_s=0.3, ttft_p90_s=0.6)]
    strategy = build_strategy("hybrid", fleet, routes, target_s=2.0, card=card)
    assert isinstance(strategy.tiers[0].policy, Hybrid)  # the policies/ object, no simulator copy
    calm = simulate_mixed(burst(20, gap=3.0), strategy, fleet, routes, card.cost_rate("self"))
    assert not any(t.hosted for t in calm.tracks)
    strategy = build_strategy("hybrid", fleet, routes, target_s=2.0, card=card)
    spiky = simulate_mixed(burst(400, gap=0.01, prompt_blocks=120), strategy, fleet, routes, card.cost_rate("self"))
    hosted = [t for t in spiky.tracks if t.hosted]
    assert hosted and len(hosted) < len(spiky.tracks)
    assert spiky.reasons["hybrid:overflow_latency"] == len(hosted)
    assert strategy.tiers[0].policy.guard.total_spent == sum(t.cost for t in hosted)  # the same unit of cost


def test_a_strategy_naming_an_unknown_backend_is_refused() -> None:
    card = replica_rate_card(QWEN)
    fleet = FleetConfig(1, QWEN)
    bad = Strategy("x", (Tier(("nowhere",), build_strategy("self_hosted", fleet, [], target_s=1.0,
                                                             card=card).tiers[0].policy),))
    with pytest.raises(ValueError, match="nowhere"):
        simulate_mixed(burst(1), bad, fleet, [], card.cost_rate("self"))
    with pytest.raises(ValueError, match="known"):
        build_strategy("hosted_only", fleet, [], target_s=1.0, card=card)


def test_replica_card_is_the_presets_gpu_hour_over_its_modelled_throughput() -> None:
    card = replica_rate_card(QWEN)
    assert card.gpus == 2 and card.gpu_hour == Decimal("2.50")
    assert float(card.prefill_tok_s) == pytest.approx(15_928, rel=1e-3)  # llm-d's calibration point
    assert card.input_per_mtok == (Decimal(5) * 1_000_000 / (card.prefill_tok_s * 3600)).quantize(Decimal("1e-6"))


def test_with_every_breaker_open_a_request_waits_for_the_soonest_cooldown() -> None:
    from kvroute.policies import HealthBoard

    card = replica_rate_card(QWEN)
    fleet = FleetConfig(1, QWEN)
    routes = [spec("a"), spec("b")]
    health = HealthBoard()
    health.breaker("a").force_open(0.0, 30.0)
    health.breaker("b").force_open(0.0, 10.0)
    strategy = build_strategy("always_hosted", fleet, routes, target_s=2.0, card=card)
    result = simulate_mixed(burst(1), strategy, fleet, routes, card.cost_rate("self"), health=health)
    (t,) = result.tracks
    assert t.backend == "b" and 10.0 <= t.first_token_at < 10.0 + 5.0 and not result.failures
