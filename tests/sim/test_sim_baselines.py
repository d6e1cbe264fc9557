"""Baselines against the behaviour their projects document."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.policies import (
    ExternalSignal,
    PrefixIndexConfig,
    RequestOutcome,
    Router,
    RouterConfig,
    RoutingRequest,
    policy_names,
)
from kvroute.sim.baselines import (
    BASELINES,
    DynamoApprox,
    LiteLLMPromptCaching,
    LlmdApprox,
    RandomPolicy,
    SGLangCacheAware,
    SGLangCacheAwareConfig,
)
from kvroute.sim.engine import make_policy
from kvroute.sim.lineup import DEFAULT_LINEUP

B = ["a", "b", "c"]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def router(clock: Clock) -> Router:
    return Router(RouterConfig(index=PrefixIndexConfig(block_tokens=64.0)), clock=clock)


def req(keys: list[int], rid: str, prompt: int | None = None, cache_prefix_blocks: int | None = None) -> RoutingRequest:
    tags = {} if cache_prefix_blocks is None else {"cache_prefix_blocks": str(cache_prefix_blocks)}
    return RoutingRequest("m", keys, 64, prompt if prompt is not None else 64 * len(keys), request_id=rid, tags=tags)


def test_all_baselines_are_registered_under_distinct_names() -> None:
    names = policy_names()
    for n in BASELINES:
        assert n in names
        assert make_policy(n).name == n
    assert len(set(DEFAULT_LINEUP)) == len(DEFAULT_LINEUP)


def test_random_is_roughly_uniform() -> None:
    clock = Clock()
    r, pol = router(clock), RandomPolicy()
    counts = Counter(r.pick(req([i], f"r{i}"), B, policy=pol).backend for i in range(3000))
    assert all(900 < counts[b] < 1100 for b in B)


def test_litellm_pins_after_success_exact_prefix_and_ttl() -> None:
    clock = Clock()
    r, pol = router(clock), LiteLLMPromptCaching()
    first = r.pick(req(list(range(40)), "r1", cache_prefix_blocks=32), B, policy=pol)
    # not pinned yet: the pin is written on success, so a concurrent sibling is shuffled
    assert first.reason == "simple_shuffle"
    pol.observe(req([], "r1"), RequestOutcome("success", first.backend, clock.t))
    for i in range(10):
        d = r.pick(req(list(range(32)) + [1000 + i] * 8, f"s{i}", cache_prefix_blocks=32), B, policy=pol)
        assert d.backend == first.backend and d.reason == "prompt_cache_pin"
    # exact match only: a prefix one block shorter is a different cacheable prefix
    d = r.pick(req(list(range(40)), "x", cache_prefix_blocks=31), B, policy=pol)
    assert d.reason == "simple_shuffle"
    # short prompts (< 1024 tokens) are not prompt-caching candidates
    assert r.pick(req(list(range(8)), "short", cache_prefix_blocks=8), B, policy=pol).reason == "simple_shuffle"
    clock.t = 301.0  # TTL 300 s
    d = r.pick(req(list(range(40)), "late", cache_prefix_blocks=32), B, policy=pol)
    assert d.reason == "simple_shuffle"


def test_sglang_uses_cli_defaults() -> None:
    cfg = SGLangCacheAwareConfig()
    assert (cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold) == (0.3, 64, 1.5)
    assert cfg.eviction_interval_s == 120 and cfg.max_tree_tokens == (1 << 26) // 4


def test_sglang_match_threshold_and_imbalance_switch() -> None:
    clock = Clock()
    r, pol = router(clock), SGLangCacheAware()
    d0 = r.pick(req(list(range(10)), "g0"), B, policy=pol)
    assert d0.reason == "cache_miss"
    holder = d0.backend
    # match rate 10/12 > 0.3 → the holder, even though it is busier
    d1 = r.pick(req([*range(10), 50, 51], "g1"), B, policy=pol)
    assert d1.backend == holder and d1.reason == "cache_hit"
    # match rate 2/10 = 0.2 ≤ 0.3 → least-loaded worker instead of the holder
    d2 = r.pick(req([0, 1, *range(200, 208)], "g2"), B, policy=pol)
    assert d2.reason == "cache_miss" and d2.backend != holder
    # imbalance: holder has 70 more in flight than the idlest (> 64 and > 1.5×) → least-loaded
    for i in range(70):
        r.load.start(f"busy{i}", holder, 10, clock.t)
    d3 = r.pick(req([*range(10), 99], "g3"), B, policy=pol)
    assert d3.reason == "imbalanced" and d3.backend != holder


def test_llmd_scores_are_weighted_3_2_2_with_scraped_signals() -> None:
    clock = Clock()
    r, pol = router(clock), LlmdApprox()
    keys = list(range(10))
    holder = r.pick(req(keys, "w"), B, policy=pol).backend
    others = [b for b in B if b != holder]
    r.observe(holder, ExternalSignal(at=0.0, queue_depth=10, kv_usage=0.9))
    r.observe(others[0], ExternalSignal(at=0.0, queue_depth=0, kv_usage=0.1))
    r.observe(others[1], ExternalSignal(at=0.0, queue_depth=5, kv_usage=0.5))
    d = r.pick(req(keys, "x"), B, policy=pol)
    # holder: 3·1 + 2·0 + 2·0.1 = 3.2; idle: 3·0 + 2·1 + 2·0.9 = 3.8; middle: 0 + 2·0.5 + 2·0.5 = 2.0
    assert d.scores[holder] == pytest.approx(3.2)
    assert d.scores[others[0]] == pytest.approx(3.8)
    assert d.scores[others[1]] == pytest.approx(2.0)
    assert d.backend == others[0]


def test_dynamo_cost_ttl_and_decode_release() -> None:
    clock = Clock()
    r, pol = router(clock), DynamoApprox()
    keys = list(range(10))
    d0 = r.pick(req(keys, "a"), B, policy=pol)
    r.on_first_token("a")  # prefill done: no active prefill left, 10 decode blocks remain on the holder
    d1 = r.pick(req(keys, "b"), B, policy=pol)
    # holder: max(0 + 10 − 10, 0) + 10 = 10; others: 10 + 0 = 10 → tie → smaller tree (an empty one)
    assert d1.scores[d0.backend] == pytest.approx(10.0)
    assert d1.backend != d0.backend
    r.finish(req(keys, "a"), RequestOutcome("success", d0.backend, clock.t), policy=pol)
    r.finish(req(keys, "b"), RequestOutcome("success", d1.backend, clock.t), policy=pol)
    d2 = r.pick(req(keys, "c"), B, policy=pol)
    assert d2.scores[d2.backend] == pytest.approx(0.0)
    assert d2.backend in (d0.backend, d1.backend)
    r.finish(req(keys, "c"), RequestOutcome("success", d2.backend, clock.t), policy=pol)
    clock.t = 121.0  # TTL 120 s: the approximate tree forgets the blocks
    d3 = r.pick(req(keys, "d"), B, policy=pol)
    assert set(d3.scores.values()) == {10.0}


def test_oracle_reads_real_engine_caches() -> None:
    from decimal import Decimal

    from kvroute.sim.costmodel import CostModel
    from kvroute.sim.engine import FleetConfig, simulate
    from kvroute.sim.presets import Preset
    from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

    kb = SegmentKeys(10)
    cost = CostModel(1000.0, 0.0, 0.1, 0.0, 0.0, 100, 4)
    p = Preset("t", "", cost, 10_000, 10, 1, Decimal("1"), 100_000)
    reqs = [SimRequest(200, 1, kb.keys([(g, 190), (100 + i, 10)]), float(i)) for i, g in enumerate([1, 2, 3, 1, 2, 3])]
    res = simulate(Workload("t", 10, reqs), "oracle", FleetConfig(3, p, metrics_interval_s=None))
    assert [r.hit_tokens for r in res.requests[3:]] == [190, 190, 190]
