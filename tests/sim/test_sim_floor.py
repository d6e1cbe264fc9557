"""The TTFT floor (no router beats it) and the wasted-prefill figure, on the simulated engines."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.sim.costmodel import CostModel
from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.metrics import summarize
from kvroute.sim.presets import Preset
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload
from kvroute.sim.workloads import gsp

BT = 10
POLICIES = ["round_robin", "random", "least_load", "cache_aware", "sglang_cache_aware", "llmd_approx", "dynamo",
            "smg_2026", "llmd_2026", "dynamo_2026", "vllm_sticky_least_loaded", "oracle_ttft"]


def preset(kv_tokens: int = 10_000, chunk: int = 64) -> Preset:
    cost = CostModel(prefill_tok_s=1000.0, attn_s=2e-5, step_overhead_s=0.01, decode_s_per_seq=1e-3,
                     kv_read_s_per_token=1e-6, chunk_tokens=chunk, max_running=4)
    return Preset("test", "floor test engine", cost, kv_tokens, BT, 1, Decimal("1"), 100_000)


def run(reqs: list[SimRequest], replicas: int, policy: str, p: Preset | None = None):
    wl = Workload("t", BT, reqs)
    fleet = FleetConfig(replicas, p or preset(), metrics_interval_s=None)
    return simulate(wl, policy, fleet), wl, fleet


def test_floor_of_a_lone_request_is_its_ttft_and_a_repeat_computes_one_block() -> None:
    kb = SegmentKeys(BT)
    keys = kb.keys([(1, 200)])
    res, _, _ = run([SimRequest(200, 5, keys, 0.0), SimRequest(200, 5, keys, 50.0)], 2, "round_robin")
    first, second = sorted(res.requests, key=lambda r: r.arrival)
    cost = preset().cost
    assert first.floor_s == pytest.approx(cost.cold_prefill_s(200))
    assert first.first_token_at - first.arrival == pytest.approx(first.floor_s)
    # the repeat: someone holds 190 tokens (an engine never reuses the last one): the floor prefills 10
    assert second.floor_s == pytest.approx(cost.prefill_alone_s(190, 10))
    # round robin sent it to the other replica: it recomputed the 190 tokens the first one held
    assert second.held_elsewhere == 190 and second.hit_tokens == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 40), st.floats(0, 3)),
                min_size=1, max_size=25),
       st.integers(40, 600), st.integers(1, 3), st.sampled_from(POLICIES))
def test_floor_is_never_above_any_policys_ttft(rows, kv_blocks, replicas, policy) -> None:
    kb = SegmentKeys(BT)
    reqs = [SimRequest(10 * (blocks + 1) + 3, out, kb.keys([(pre, 10 * blocks), (100 + i, 13)]), t)
            for i, (pre, blocks, out, t) in enumerate(rows)]
    res, wl, fleet = run(reqs, replicas, policy, preset(kv_tokens=kv_blocks * BT))
    for r in res.requests:
        if r.first_token_at < 0:
            continue
        assert 0 < r.floor_s <= r.first_token_at - r.arrival + 1e-9
        assert 0 <= r.held_elsewhere <= r.prompt - 1
    m = summarize(res, wl, fleet)
    assert m.wasted_prefill_tokens >= 0
    if m.completed:
        assert m.floor_p90_s <= m.ttft_p90_s + 1e-9 and m.gap_to_floor_p90 >= 1 - 1e-9


def _shared_prefix_poisson() -> Workload:
    return gsp(BT, groups=4, prompts_per_group=12, system_len=400, question_len=30, output_len=5, rate=4.0)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_wasted_prefill_counts_recomputes_of_a_prefix_held_elsewhere(policy: str) -> None:
    wl = _shared_prefix_poisson()
    one = FleetConfig(1, preset(), metrics_interval_s=None)
    m1 = summarize(simulate(wl, policy, one), wl, one)
    assert m1.wasted_prefill_tokens == 0  # a single replica: nobody else holds anything
    four = FleetConfig(4, preset(), metrics_interval_s=None)
    m4 = summarize(simulate(wl, policy, four), wl, four)
    if policy == "round_robin":
        assert m4.wasted_prefill_tokens > 0 and 0 < m4.wasted_prefill_share < 1
    else:
        rr = summarize(simulate(wl, "round_robin", four), wl, four)
        assert m4.wasted_prefill_tokens < rr.wasted_prefill_tokens
