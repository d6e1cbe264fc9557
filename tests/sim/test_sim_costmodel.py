"""The step-time model against hand-computed cases, and the presets against their calibration sources."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.policies import ConfigError
from kvroute.sim.costmodel import CostModel
from kvroute.sim.presets import PRESETS, get_preset

CM = CostModel(prefill_tok_s=1000.0, attn_s=1e-6, step_overhead_s=0.1, decode_s_per_seq=0.01,
               kv_read_s_per_token=1e-4, chunk_tokens=100, max_running=4)


def test_step_time_by_hand() -> None:
    # 100 prefill tokens from an empty context, 2 decoders holding 300 context tokens:
    # 0.1 + 100/1000 + 1e-6·100·(0 + 50) + 0.01·2 + 1e-4·300 = 0.1 + 0.1 + 0.005 + 0.02 + 0.03
    assert CM.step_time(100, CM.chunk_attention(0, 100), 2, 300) == pytest.approx(0.255)
    assert CM.chunk_attention(200, 50) == pytest.approx(1e-6 * 50 * 225)


def test_decode_run_closed_form_matches_step_sum() -> None:
    # 3 steps, 2 sequences, context 300 → 400 after 2 steps: Σ (0.1 + 0.02 + 1e-4·(300 + 2j))
    by_hand = sum(0.1 + 0.02 + 1e-4 * (300 + 2 * j) for j in range(3))
    assert CM.decode_run(3, 2, 300) == pytest.approx(by_hand)
    assert CM.decode_run(0, 2, 300) == 0.0


@given(st.integers(1, 500), st.integers(1, 64), st.integers(0, 100_000), st.floats(0.0, 50.0))
def test_decode_steps_before_is_the_step_running_then(steps: int, seqs: int, ctx: int, frac: float) -> None:
    total = CM.decode_run(steps, seqs, ctx)
    elapsed = min(total, frac * total / 50.0)
    j = CM.decode_steps_before(elapsed, seqs, ctx)
    assert j >= 1
    assert CM.decode_run(j, seqs, ctx) >= elapsed - 1e-12
    if j > 1:
        assert CM.decode_run(j - 1, seqs, ctx) < elapsed


def test_cold_prefill_chunks() -> None:
    # 250 tokens in chunks 100, 100, 50; attention over the growing context
    by_hand = sum(0.1 + c / 1000 + 1e-6 * c * (s + c / 2) for s, c in ((0, 100), (100, 100), (200, 50)))
    assert CM.cold_prefill_s(250) == pytest.approx(by_hand)


def test_qwen_preset_reproduces_llmd_calibration() -> None:
    p = get_preset("qwen3-32b-h100-tp2")
    # llm-d: 8,192-token chunk at 15,928 tok/s; 307,328 KV tokens per pod in 64-token blocks
    assert 8192 / p.cost.cold_prefill_s(8192) == pytest.approx(15_928, rel=1e-6)
    assert p.kv_tokens == 307_328 and p.kv_blocks == 4802
    # decode-bound ceiling: ~1.9k tok/s per pod at 100 sequences of 7.2k context (llm-d A3 peak 14,941 / 8)
    step = p.cost.decode_run(1, 100, 100 * 7200)
    assert 1000 < 100 / step < 2500


def test_cpu_preset_matches_measured_cold_prefill() -> None:
    p = get_preset("cpu-llamacpp-34m")
    measured = {1013: 1.30, 2013: 2.67, 4013: 6.97}  # xllamacpp, 34M model, 2 threads
    for tokens, secs in measured.items():
        assert p.cost.cold_prefill_s(tokens) == pytest.approx(secs, rel=0.15)


def test_ci_preset_matches_measured_cold_prefill() -> None:
    p = get_preset("cpu-llamacpp-ci")
    measured = {1013: 0.177, 2013: 0.452, 4013: 1.42}  # xllamacpp, 7.4M CI model
    for tokens, secs in measured.items():
        assert p.cost.cold_prefill_s(tokens) == pytest.approx(secs, rel=0.15)


def test_presets_are_sane_and_unknown_preset_is_a_config_error() -> None:
    for p in PRESETS.values():
        assert p.kv_blocks > 0 and p.cost.prefill_tok_s > 0
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("nope")


def test_cost_model_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        CostModel(0, 0, 0, 0, 0, 1, 1)
    with pytest.raises(ValueError):
        CostModel(1, -1, 0, 0, 0, 1, 1)


def test_a_slower_host_scales_every_compute_time_and_keeps_the_batch_limits():
    from kvroute.sim.presets import get_preset

    preset = get_preset("llamacpp")
    slow = preset.slower(1.25)
    assert preset.slower(1) is preset and slow.kv_tokens == preset.kv_tokens
    assert slow.cost.chunk_tokens == preset.cost.chunk_tokens and slow.cost.max_running == preset.cost.max_running
    for cached, tokens in ((0, 1), (0, 1500), (1200, 3000)):
        assert slow.cost.prefill_alone_s(cached, tokens) == pytest.approx(1.25 * preset.cost.prefill_alone_s(cached,
                                                                                                            tokens))
    assert slow.cost.decode_run(8, 1, 2000) == pytest.approx(1.25 * preset.cost.decode_run(8, 1, 2000))
    with pytest.raises(ValueError):
        preset.cost.slower(0)
