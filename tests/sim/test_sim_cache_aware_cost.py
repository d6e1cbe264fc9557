"""kvroute's ``cache_aware`` cost terms as the simulator relies on them (same Router, simulated clock)."""

from __future__ import annotations

import pytest

from kvroute.policies import CacheAwareConfig, ExternalSignal, PrefixIndexConfig, Router, RouterConfig, RoutingRequest


def test_copy_of_a_held_prefix_costs_more_when_the_target_cache_is_full() -> None:
    now = [0.0]
    r = Router(RouterConfig(index=PrefixIndexConfig(block_tokens=64.0)), clock=lambda: now[0])
    keys = list(range(1, 33))  # 2048 tokens
    first = r.pick(RoutingRequest("m", keys, 64, 2048, request_id="a"), ["x", "y"]).backend
    other = "y" if first == "x" else "x"
    r.on_complete("a", cached_tokens=0)  # no load left anywhere: only the cache terms differ
    r.observe(first, ExternalSignal(at=0.0, kv_usage=0.0))
    r.observe(other, ExternalSignal(at=0.0, kv_usage=0.8))
    d = r.pick(RoutingRequest("m", [*keys, 99], 64, 2112, request_id="b"), ["x", "y"])
    cfg = CacheAwareConfig()
    # holder: 64 uncached tokens; other: 2112 uncached + kv 0.25·0.8·2112 + copy 1.0·0.8·2048
    assert d.scores[first] == pytest.approx(64)
    assert d.scores[other] == pytest.approx(2112 + cfg.kv_weight * 0.8 * 2112 + cfg.replication_weight * 0.8 * 2048)
    assert d.backend == first
