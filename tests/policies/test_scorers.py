"""Scorers in seconds and the speed the load tracker learns (observed TTFT, decode time, busy seconds)."""

from __future__ import annotations

import math

import pytest

from kvroute.policies import LoadTracker
from kvroute.policies.load import BackendLoad
from kvroute.policies.scorers import (
    Candidate,
    duplicate_work,
    eviction,
    kv_pressure,
    own_prefill,
    queue_wait,
    slot_wait,
)
from kvroute.policies.speed import EngineSpeed

SPEED = EngineSpeed(prefill_tok_s=10_000.0, attn_s=1e-9, step_s=0.01, decode_s_per_seq=1e-3, chunk_tokens=4096,
                    slots=2)


def cand(**kw) -> Candidate:
    view = BackendLoad(kw.pop("inflight", 0), 0, kw.pop("queue_tokens", 0.0), kw.pop("running", 0),
                       kw.pop("kv", 0.0), -math.inf)
    base = dict(backend="b", prompt=10_000, matched=0, view=view, factor=1.0, work_s=0.0, queued=0, decode_s=0.0,
                resident_tokens=0.0, capacity_tokens=0.0, best_matched=0)
    base.update(kw)
    return Candidate(**base)


def test_prefill_seconds_are_linear_plus_attention_plus_step_floors():
    # 10k new tokens after 2k cached: 1 s linear + 1e-9·10k·(2k + 5k) + 3 chunks × 10 ms
    assert SPEED.prefill_s(10_000, 2_000) == pytest.approx(1.0 + 0.07 + 0.03)
    assert own_prefill(cand(matched=2_000, prompt=12_000), SPEED) == pytest.approx(1.1)
    # running decoders share each of the 3 steps; the learned factor scales prior seconds
    assert own_prefill(cand(matched=2_000, prompt=12_000, running=5, factor=2.0), SPEED) == pytest.approx(
        2 * (1.1 + 3 * 5 * 1e-3))
    with pytest.raises(ValueError):
        EngineSpeed(prefill_tok_s=0)


def test_queue_wait_takes_router_work_or_engine_queue_whichever_is_larger():
    assert queue_wait(cand(work_s=0.5, factor=2.0), SPEED) == pytest.approx(1.0)
    assert queue_wait(cand(work_s=0.5, queue_tokens=20_000), SPEED) == pytest.approx(2.0)


def test_slot_wait_only_when_every_slot_is_taken():
    assert slot_wait(cand(inflight=1, decode_s=4.0), SPEED) == 0.0
    assert slot_wait(cand(inflight=2, decode_s=4.0), SPEED) == pytest.approx(2.0)  # 1 of 2 slots frees in 4/2 s
    assert slot_wait(cand(inflight=3, decode_s=4.0), SPEED) == pytest.approx(4.0)


def test_kv_pressure_when_new_blocks_do_not_fit_the_free_kv():
    assert kv_pressure(cand(kv=0.5, capacity_tokens=40_000, decode_s=3.0), SPEED) == 0.0  # 10k fit in 20k
    # nothing running to finish: a whole decode duration
    assert kv_pressure(cand(kv=0.9, capacity_tokens=40_000, decode_s=3.0), SPEED) == pytest.approx(3.0)


def test_kv_pressure_waits_for_the_earliest_of_the_running_requests():
    # 36k used by 10 running (3.6k each, one ending every 0.3 s); 10k new against 4k free: 6k short, 2 endings
    full = cand(kv=0.9, capacity_tokens=40_000, decode_s=3.0, running=10)
    assert kv_pressure(full, SPEED) == pytest.approx(2 / 10 * 3.0)
    # short by more than every running request frees: all of them, one whole decode duration
    assert kv_pressure(cand(kv=0.9, capacity_tokens=40_000, decode_s=3.0, running=10, prompt=60_000),
                       SPEED) == pytest.approx(3.0)


def test_kv_pressure_counts_the_output_this_request_and_the_running_ones_will_add():
    # 20k used by 10 running, 10k new fits the 20k free now; but with a mean output of 2k this request holds
    # 12k by its end and the running ones add 10 × 1k more: 2k short, one ending (2k each) frees it
    half = cand(kv=0.5, capacity_tokens=40_000, decode_s=3.0, running=10)
    assert kv_pressure(half, SPEED) == 0.0
    half.output_tokens = 2_000.0
    assert kv_pressure(half, SPEED) == pytest.approx(1 / 10 * 3.0)


def test_eviction_prices_only_what_does_not_fit_the_free_cache():
    assert eviction(cand(resident_tokens=10_000, capacity_tokens=40_000), SPEED) == 0.0
    full = cand(resident_tokens=36_000, capacity_tokens=40_000)
    assert eviction(full, SPEED) == pytest.approx(SPEED.prefill_s(6_000))


def test_duplicate_work_grows_with_the_queue_behind_and_is_zero_for_the_holder_and_onto_an_idle_backend():
    holder = cand(matched=8_000, best_matched=8_000)
    assert duplicate_work(holder, SPEED) == 0.0
    extra = SPEED.prefill_s(10_000) - SPEED.prefill_s(2_000, 8_000)
    # an idle backend: nobody waits behind the recompute (this request's own prefill is own_prefill's)
    assert duplicate_work(cand(best_matched=8_000), SPEED) == 0.0
    # busy: once for the capacity the next arrival loses, once more per request queued there
    assert duplicate_work(cand(best_matched=8_000, inflight=1), SPEED) == pytest.approx(extra)
    assert duplicate_work(cand(best_matched=8_000, inflight=4, queued=3), SPEED) == pytest.approx(4 * extra)


def test_tracker_learns_speed_factor_decode_time_and_busy_seconds():
    t = LoadTracker()
    assert t.factor("a") == 1.0 and t.decode_s("a") == 0.0
    t.start("r1", "a", 1000, 0.0, work_s=0.1, ttft_s=0.1)
    assert t.work_s("a", 0.0) == pytest.approx(0.1) and t.queued("a") == 1
    t.first_token("r1", 0.4)  # took 4x the prediction
    assert t.factor("a") == pytest.approx(4.0) and t.factor("b") == pytest.approx(4.0)  # fleet-wide
    assert t.work_s("a", 0.4) == 0.0 and t.queued("a") == 0
    t.release("r1", 2.4)
    assert t.decode_s("a") == pytest.approx(2.0)
    for i in range(50):  # later requests match the prediction: the factor converges back towards 1
        t.start(f"s{i}", "a", 1000, 10.0 + i, work_s=0.1, ttft_s=0.1)
        t.first_token(f"s{i}", 10.1 + i)
        t.release(f"s{i}", 10.2 + i)
    assert t.factor("a") == pytest.approx(1.0, rel=0.05)
    busy = t.busy("a", 60.0)
    assert busy > 0 and t.busy("a", 60.0 + t.busy_half_life_s) == pytest.approx(busy / 2)
    t.release("never-started")  # idempotent, no error
    t.remove_backend("a")
    assert t.busy("a", 100.0) == 0.0 and t.work_s("a", 100.0) == 0.0
