"""The fake engine's timing follows the work (llama.cpp CI calibration): a compute queue per replica, prefill
cost of uncached tokens over their context, decode steps shared; and the demo on fake engines shows it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from kvroute.plugin.fake_engine import FakeEngine, FakeEngineConfig, FakeEngineServer


def test_prefill_cost_matches_the_llamacpp_ci_preset_within_15_percent():
    # shared/engines/README.md, 7.4M model: cold 1013 tok 0.177 s, 2013 tok 0.452 s, 4013 tok 1.42 s
    engine = FakeEngine(FakeEngineConfig(prefill_tokens_per_s=1 / 1.142e-4))
    for tokens, measured in ((1013, 0.177), (2013, 0.452), (4013, 1.42)):
        assert engine.prefill_seconds(tokens, 0) == pytest.approx(measured, rel=0.15)
    # a cached 4,003-token prefix with 10 new tokens costs a tiny fraction of the cold prompt
    assert engine.prefill_seconds(10, 4003) < 0.02 * engine.prefill_seconds(4013, 0)


def chat(tag: str, words: int) -> dict:
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": f"{tag} " + "word " * words}]}


async def _ttft(client: httpx.AsyncClient, body: dict) -> float:
    t0 = time.perf_counter()
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    return time.perf_counter() - t0


async def test_concurrent_cold_prefills_queue_behind_each_other_on_one_replica():
    """Slots run concurrently but share one compute: the later of four cold prompts waits for the others."""
    config = FakeEngineConfig(slots=4, prefill_tokens_per_s=20_000, context_cost=0.0, decode_s_per_token=0)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url) as client:
        alone = await _ttft(client, chat("solo", 2500))  # ~0.15 s of prefill work
        together = await asyncio.gather(*(_ttft(client, chat(f"c{i}", 2500)) for i in range(4)))
    # the four cost about 4x the work: the slowest waits for three others (a ratio in the same run)
    assert max(together) > 2.5 * alone
    stats = server.engine.stats
    assert stats.cached_tokens == 0
    assert stats.prefill_seconds == pytest.approx(stats.prompt_tokens / config.prefill_tokens_per_s, rel=0.01)


async def test_decode_steps_are_shared_by_the_sequences_decoding():
    engine = FakeEngine(FakeEngineConfig(decode_s_per_token=0.01, decode_batch_share=0.1))
    engine.decoding = 1
    one = engine._decode_step_s()
    engine.decoding = 11
    assert engine._decode_step_s() == pytest.approx(2 * one)  # ten more sequences: +10 % each


@pytest.mark.e2e
def test_demo_on_fake_engines_beats_round_robin_on_ttft_p90_and_throughput():
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    run = subprocess.run([sys.executable, "-m", "kvroute.plugin.cli", "demo", "--engine", "fake", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    kv, rr = result["policies"]["kvroute"], result["policies"]["round_robin"]
    assert kv["failed"] == 0 and rr["failed"] == 0
    assert kv["cached_token_share"] > rr["cached_token_share"]
    assert kv["ttft_p90_s"] < rr["ttft_p90_s"], result
    assert kv["requests_per_s"] > rr["requests_per_s"], result
