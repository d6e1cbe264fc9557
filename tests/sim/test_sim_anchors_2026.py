"""The 2026 anchors, each on a tiny hand-made case showing its characteristic behaviour."""

from __future__ import annotations

import pytest

from kvroute.policies import PrefixIndexConfig, RequestOutcome, Router, RouterConfig, RoutingRequest, policy_names
from kvroute.sim.anchors2026 import (
    ANCHORS_2026,
    Dynamo2026,
    Dynamo2026Config,
    Llmd2026,
    Llmd2026Config,
    Smg2026CacheAware,
    Smg2026Config,
    VllmStickyLeastLoaded,
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


def req(keys: list[int], rid: str, session: str | None = None) -> RoutingRequest:
    return RoutingRequest("m", keys, 64, 64 * len(keys), request_id=rid, session_key=session)


def test_registered_in_the_default_lineup_with_upstream_defaults() -> None:
    for name in ANCHORS_2026:
        assert name in policy_names() and name in DEFAULT_LINEUP
        assert make_policy(name).name == name
    smg = Smg2026Config()
    assert (smg.cache_threshold, smg.balance_rel_threshold, smg.balance_abs_threshold) == (0.3, 1.5, 64)
    llmd = Llmd2026Config()
    assert (llmd.affinity_threshold, llmd.max_ttft_penalty_ms, llmd.peak_prefill_throughput) == (0.8, 18_000, 15_928)
    dyn = Dynamo2026Config()
    assert (dyn.prefill_load_scale, dyn.overlap_credit, dyn.ttl_s) == (1.0, 1.0, 120.0)


def test_smg_2026_spills_only_past_the_per_request_gate() -> None:
    clock = Clock()
    r, pol = router(clock), Smg2026CacheAware()
    holder = r.pick(req(list(range(10)), "g0"), B, policy=pol).backend
    # 60 in flight on the holder: mean 20, 60 > 1.5 x 20 but not > 20 + 64 -> stays (the 2025 switch spilled at 64+)
    for i in range(60):
        r.load.start(f"busy{i}", holder, 10, clock.t)
    d = r.pick(req([*range(10), 50], "g1"), B, policy=pol)
    assert d.backend == holder and d.reason == "cache_hit"
    # 130 in flight: mean ≈ 43.7, 131 > 1.5 x mean and > mean + 64 -> spill, and the spilled worker now holds it
    for i in range(60, 130):
        r.load.start(f"busy{i}", holder, 10, clock.t)
    d = r.pick(req([*range(10), 51], "g2"), B, policy=pol)
    assert d.reason == "spill" and d.backend != holder
    spilled = d.backend
    for i in range(130):
        r.load.release(f"busy{i}")
    r.on_complete("g1")
    r.on_complete("g2")
    # pressure-select among the holders: both hold the prefix; the one with less in flight wins
    for i in range(3):
        r.load.start(f"more{i}", holder, 10, clock.t)
    d = r.pick(req([*range(10), 52], "g3"), B, policy=pol)
    assert d.backend == spilled and d.reason == "cache_hit"


def test_llmd_2026_releases_affinity_past_the_ttft_penalty() -> None:
    clock = Clock()
    pol = Llmd2026(Llmd2026Config(max_ttft_penalty_ms=100.0, peak_prefill_throughput=1000.0))
    r = router(clock)
    keys = list(range(10))  # 640 tokens
    holder = r.pick(req(keys, "w0"), B, policy=pol).backend
    # the holder has 640 in-flight tokens = 640 ms estimated, idle ones 0 ms: penalty 640 > 100 -> pool reopens
    d = r.pick(req(keys, "w1"), B, policy=pol)
    assert d.reason == "affinity_released" and d.backend != holder
    pol.observe(req([], "w0"), RequestOutcome("success", holder, clock.t))
    pol.observe(req([], "w1"), RequestOutcome("success", d.backend, clock.t))
    # both idle again: two sticky endpoints now, the filter keeps them only
    d2 = r.pick(req(keys, "w2"), B, policy=pol)
    assert d2.reason == "affinity" and d2.backend in (holder, d.backend)
    # with the guide's 18 s penalty the same load stays sticky
    sticky = Llmd2026()
    r2 = router(clock)
    h = r2.pick(req(keys, "x0"), B, policy=sticky).backend
    d3 = r2.pick(req(keys, "x1"), B, policy=sticky)
    assert d3.reason == "affinity" and d3.backend == h
    # below the 0.80 threshold: no affinity, token load decides
    d4 = r2.pick(req([*keys[:7], 70, 71, 72], "x2"), B, policy=sticky)
    assert d4.reason == "no_affinity" and d4.backend != h


def test_dynamo_2026_decays_credit_for_busy_holders() -> None:
    clock = Clock()
    keys = list(range(10))
    # the holder has 20 blocks of other prefill outstanding (two prompts' worth above the idlest worker)
    # cost = 20 active + 10 prompt − credit · 10 overlap + 10 decode; elsewhere 0 + 10 − 0 + 0 = 10
    for pol, credit in ((Dynamo2026(Dynamo2026Config(overlap_credit_decay=0.0)), 1.0),
                        (Dynamo2026(), 1.0 / (1.0 + 1.0 * 20 / 10))):
        r = router(clock)
        holder = r.pick(req(keys, "h0"), B, policy=pol).backend
        r.on_first_token("h0")
        r.load.start("other", holder, 20 * 64, clock.t)
        d = r.pick(req(keys, "h1"), B, policy=pol)
        assert d.scores[holder] == pytest.approx(20 + 10 - credit * 10 + 10)
        assert all(v == pytest.approx(10.0) for b, v in d.scores.items() if b != holder)
    # an idle holder keeps its full credit: decay only touches workers above the least busy one
    assert Dynamo2026().credit({"a": 0.0, "b": 5.0}, 10) == {"a": 1.0, "b": pytest.approx(1 / 1.5)}


def test_vllm_sticky_least_loaded_binds_sessions_by_count() -> None:
    clock = Clock()
    r, pol = router(clock), VllmStickyLeastLoaded()
    first = {s: r.pick(req([i], f"{s}-0", session=s), B, policy=pol).backend for i, s in enumerate("xyz")}
    assert sorted(first.values()) == B  # three new sessions spread over three workers
    for turn in range(1, 4):  # later turns stay, whatever the load
        for s in "xyz":
            assert r.pick(req([99, turn], f"{s}-{turn}", session=s), B, policy=pol).backend == first[s]
    clock.t = 7201.0  # idle past the TTL: the binding is forgotten, counts are back to zero
    d = r.pick(req([5], "x-late", session="x"), B, policy=pol)
    assert d.reason == "new_session"
