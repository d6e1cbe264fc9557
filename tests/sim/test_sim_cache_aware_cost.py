"""kvroute's ``cache_aware`` cost terms as the simulator relies on them (same Router, simulated clock)."""

from __future__ import annotations

import pytest

from kvroute.policies import ExternalSignal, PrefixIndexConfig, Router, RouterConfig, RoutingRequest
from kvroute.policies.speed import EngineSpeed


def test_copy_onto_a_full_cache_is_priced_as_the_cache_it_evicts() -> None:
    now = [0.0]
    # index capacity 40 blocks of 64 tokens: a 2,048-token prompt fills 32 of them
    r = Router(RouterConfig(index=PrefixIndexConfig(block_tokens=64.0, capacity_tokens=40 * 64)),
               clock=lambda: now[0])
    keys = list(range(1, 33))
    first = r.pick(RoutingRequest("m", keys, 64, 2048, request_id="a"), ["x", "y"]).backend
    other = "y" if first == "x" else "x"
    r.on_complete("a", cached_tokens=0)
    filler = list(range(1000, 1040))  # the other backend's cache is full of someone else's prefix
    r.pick(RoutingRequest("m", filler, 64, 40 * 64, request_id="f"), [other])
    r.on_complete("f", cached_tokens=0)
    for b in ("x", "y"):
        r.observe(b, ExternalSignal(at=0.0, kv_usage=0.0))
    d = r.pick(RoutingRequest("m", [*keys, 99], 64, 2112, request_id="b"), ["x", "y"])
    speed = EngineSpeed()
    own_holder = speed.prefill_s(2112 - 2048, 2048)
    assert d.scores[first] == pytest.approx(own_holder)
    # the other backend: its whole uncached prefill and the 2,112 tokens of cache it evicts (weight 0.5); the
    # duplicate of the held prefix costs nobody else there (idle: no one waits behind it)
    own_other = speed.prefill_s(2112)
    evicts = 0.5 * speed.prefill_s(2112)
    assert d.scores[other] == pytest.approx(own_other + evicts)
    assert d.backend == first
