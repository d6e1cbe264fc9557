"""The simulated engine against hand-computed small cases: timing, prefix reuse, siblings in one step, LRU."""

from __future__ import annotations

import itertools
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.sim.costmodel import CostModel
from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.presets import Preset
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

BT = 10


def preset(kv_tokens: int = 10_000, chunk: int = 100, max_running: int = 4) -> Preset:
    cost = CostModel(prefill_tok_s=1000.0, attn_s=0.0, step_overhead_s=0.1, decode_s_per_seq=0.0,
                     kv_read_s_per_token=0.0, chunk_tokens=chunk, max_running=max_running)
    return Preset("test", "hand-computable engine", cost, kv_tokens, BT, 1, Decimal("1"), 100_000)


def run(reqs: list[SimRequest], p: Preset, replicas: int = 1, policy: str = "round_robin"):
    return simulate(Workload("t", BT, reqs), policy, FleetConfig(replicas, p, metrics_interval_s=None))


def test_single_request_timing_by_hand() -> None:
    kb = SegmentKeys(BT)
    # prefill 250 in chunks 100/100/50: 0.2 + 0.2 + 0.15 → first token at 0.55; two decode steps of 0.1 → 0.75
    res = run([SimRequest(250, 3, kb.keys([(1, 250)]))], preset())
    r = res.requests[0]
    assert r.first_token_at == pytest.approx(0.55)
    assert r.done_at == pytest.approx(0.75)
    assert r.hit_tokens == 0
    assert res.replica_busy[0] == pytest.approx(0.75)


def test_prefix_reuse_after_completion() -> None:
    kb = SegmentKeys(BT)
    a = SimRequest(250, 1, kb.keys([(1, 200), (2, 50)]), 0.0)
    b = SimRequest(250, 1, kb.keys([(1, 200), (3, 50)]), 1.0)  # same 200-token prefix, 20 blocks
    res = run([a, b], preset())
    rb = res.requests[1]
    assert rb.hit_tokens == 200
    assert rb.first_token_at == pytest.approx(1.0 + 0.1 + 50 / 1000)


def test_full_prompt_hit_keeps_last_token_to_compute() -> None:
    kb = SegmentKeys(BT)
    keys = kb.keys([(1, 200)])
    res = run([SimRequest(200, 1, keys, 0.0), SimRequest(200, 1, keys, 5.0)], preset())
    assert res.requests[1].hit_tokens == 190  # (200 − 1) // 10 blocks: the last block is recomputed


def test_siblings_in_the_same_step_share_the_prefix() -> None:
    # vLLM V1 commits a chunk's full blocks to the prefix cache when it schedules the step (allocate_slots),
    # so a sibling admitted later in the same step reuses them: 250 + 10 tokens in one step of 0.1 + 0.26 s
    kb = SegmentKeys(BT)
    keys = kb.keys([(1, 250)])
    together = run([SimRequest(250, 1, keys, 0.0), SimRequest(250, 1, keys, 0.0)], preset(chunk=1000))
    assert [r.hit_tokens for r in together.requests] == [0, 240]
    assert [r.first_token_at for r in together.requests] == pytest.approx([0.36, 0.36])
    # one slot: the sibling waits for the first request to finish, then reuses its prefix all the same
    serial = run([SimRequest(250, 1, keys, 0.0), SimRequest(250, 1, keys, 0.0)], preset(chunk=1000, max_running=1))
    assert [r.hit_tokens for r in serial.requests] == [0, 240]


def test_chunk_visibility_mid_prefill() -> None:
    kb = SegmentKeys(BT)
    keys = kb.keys([(1, 250)])
    # B arrives while A's first chunk runs. At 0.2 A's second chunk takes the whole 100-token budget; at 0.4
    # A's last 50 tokens leave 50 of budget and B is admitted in the same step, after A's last chunk was
    # scheduled: it reuses all 24 blocks it may (the prompt's last token is always computed).
    res = run([SimRequest(250, 1, keys, 0.0), SimRequest(250, 1, keys, 0.05)], preset(chunk=100))
    assert res.requests[1].hit_tokens == 240
    assert res.requests[1].admitted_at == pytest.approx(0.4)
    # what nobody computed yet is no hit: C shares A's 250 tokens and extends them to 500
    longer = kb.keys([(1, 250), (2, 250)])
    res = run([SimRequest(250, 1, keys, 0.0), SimRequest(500, 1, longer, 0.05)], preset(chunk=100))
    assert res.requests[1].hit_tokens == 250


def test_lru_evicts_tail_blocks_first() -> None:
    kb = SegmentKeys(BT)
    p1, p2 = kb.keys([(1, 200)]), kb.keys([(2, 200)])
    # 30 blocks: P1 (20) done → evictable; P2 needs 20 → evicts P1's last 10 blocks; P1 again hits its first 10
    reqs = [SimRequest(200, 1, p1, 0.0), SimRequest(200, 1, p2, 5.0), SimRequest(200, 1, p1, 10.0)]
    res = run(reqs, preset(kv_tokens=300))
    assert res.requests[2].hit_tokens == 100
    assert res.evictions >= 10


def test_kv_pressure_preempts_and_everything_completes() -> None:
    kb = SegmentKeys(BT)
    reqs = [SimRequest(100, 150, kb.keys([(i, 100)]), 0.0) for i in (1, 2)]
    res = run(reqs, preset(kv_tokens=300, chunk=1000))
    assert res.preemptions >= 1
    assert all(r.done_at > 0 for r in res.requests)
    assert res.final_blocks == [(0, 0, res.final_blocks[0][2])]


def test_requests_too_long_for_the_replica_are_dropped() -> None:
    kb = SegmentKeys(BT)
    res = run([SimRequest(5000, 10, kb.keys([(1, 5000)]))], preset(kv_tokens=1000))
    assert res.dropped == 1


def test_closed_loop_follow_ups_start_after_completion() -> None:
    kb = SegmentKeys(BT)
    a = SimRequest(100, 1, kb.keys([(1, 100)]), 0.0)
    b = SimRequest(150, 1, kb.keys([(1, 100), (2, 50)]), 0.0, follows=0, delay=2.0)
    res = run([a, b], preset())
    assert res.requests[1].arrival == pytest.approx(res.requests[0].done_at + 2.0)
    assert res.requests[1].hit_tokens == 100


def test_client_concurrency_cap_holds_requests() -> None:
    kb = SegmentKeys(BT)
    reqs = [SimRequest(100, 5, kb.keys([(i, 100)]), 0.0) for i in range(4)]
    wl = Workload("t", BT, reqs, max_concurrency=1)
    res = simulate(wl, "round_robin", FleetConfig(2, preset(), metrics_interval_s=None))
    ordered = sorted(res.requests, key=lambda r: r.arrival)
    for prev, nxt in itertools.pairwise(ordered):
        assert nxt.arrival >= prev.done_at - 1e-9


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 40), st.floats(0, 3)),
                min_size=1, max_size=25),
       st.integers(4, 600), st.integers(1, 3), st.sampled_from(["round_robin", "cache_aware", "least_load"]))
def test_invariants_hold_on_random_workloads(rows, kv_blocks, replicas, policy) -> None:
    kb = SegmentKeys(BT)
    reqs = [SimRequest(10 * (blocks + 1) + 3, out, kb.keys([(pre, 10 * blocks), (100 + i, 13)]), t)
            for i, (pre, blocks, out, t) in enumerate(rows)]
    p = preset(kv_tokens=kv_blocks * BT, chunk=64)
    res = run(reqs, p, replicas, policy)
    assert len(res.requests) == len(reqs)
    # nothing is stuck: every request either completed or was dropped as too long for the replica
    assert sum(1 for r in res.requests if r.first_token_at >= 0) + res.dropped == len(reqs)
    for r in res.requests:
        if r.first_token_at < 0:  # dropped: too long for this replica
            continue
        assert r.arrival <= r.first_token_at <= r.done_at
        assert 0 <= r.hit_tokens <= r.prompt - 1 and r.hit_tokens % BT == 0
    for pinned, private, evictable in res.final_blocks:
        assert pinned == 0 and private == 0 and evictable <= kv_blocks
