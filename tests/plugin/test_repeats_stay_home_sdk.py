"""The same long prompt sent one request at a time through ``litellm.Router`` + the kvroute callback to an idle
fleet: every repeat goes to the first replica and is served from its cache (the engine reports it cached)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from test_hooks_sdk import fleet, installed, litellm_flush, sender

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.settings import KvrouteSettings

pytestmark = pytest.mark.timeout(180)

SYSTEM = "You are a careful assistant for contract law questions. "  # ~14 tokens a repeat on the fake engines


def model_list(servers, capacity: int) -> list[dict]:
    return [{"model_name": "llama", "litellm_params": {"model": "openai/fake-model", "api_base": s.base_url + "/v1",
                                                     "api_key": "x"},
             "model_info": {"id": f"r{i}", "engine": "vllm", "kv_capacity_tokens": capacity}}
            for i, s in enumerate(servers)]


@pytest.mark.parametrize("replicas", [2, 4, 8])
@pytest.mark.parametrize("repeats", [110, 450, 1800], ids=["1.5k", "6k", "25k"])
async def test_repeats_of_one_long_prompt_stay_on_the_first_replica_and_are_cached(replicas: int, repeats: int):
    import litellm

    capacity = 65536
    cb = KvrouteCallback(KvrouteSettings().check_policies(), metrics=Metrics(CollectorRegistry()), mount=False)
    async with fleet(replicas, capacity=capacity) as servers:
        with installed(cb):
            router = litellm.Router(model_list=model_list(servers, capacity), num_retries=0)
            send = sender(router)
            system = {"role": "system", "content": SYSTEM * repeats}
            seen = []
            for i in range(5):  # one at a time, each sent as soon as the previous answer is back
                _, prompt, cached, backend = await send([system, {"role": "user", "content": f"q{i}"}])
                seen.append((backend, prompt, cached))
            await litellm_flush(cb)
    first = seen[0][0]
    assert all(b == first for b, _, _ in seen), seen
    assert seen[0][2] == 0
    for _, prompt, cached in seen[1:]:
        assert cached >= 0.9 * prompt, seen  # the engine computed only the new question
    assert cb.metrics.registry.get_sample_value("kvroute_decisions_total", {
        "group": "llama", "policy": "cache_aware", "reason": "prefix_spill"}) is None
    assert not cb.metrics.registry.get_sample_value("kvroute_wasted_prefill_tokens_total", {"group": "llama"})


async def test_wasted_prefill_counter_counts_what_round_robin_recomputes():
    """The proxy-side counter: prompt tokens a pick sends to a replica while another held them (index at the pick).
    Round robin over two replicas recomputes the long prompt once on the second; kvroute never does here."""
    import litellm

    capacity = 65536
    cb = KvrouteCallback(KvrouteSettings(groups={"llama": {"policy": "round_robin"}}).check_policies(),
                         metrics=Metrics(CollectorRegistry()), mount=False)
    async with fleet(2, capacity=capacity) as servers:
        with installed(cb):
            router = litellm.Router(model_list=model_list(servers, capacity), num_retries=0)
            send = sender(router)
            system = {"role": "system", "content": SYSTEM * 450}
            for i in range(4):
                await send([system, {"role": "user", "content": f"q{i}"}])
            await litellm_flush(cb)
    wasted = cb.metrics.registry.get_sample_value("kvroute_wasted_prefill_tokens_total", {"group": "llama"})
    assert 6000 < wasted < 6400  # the second request prefilled the ~6.3k-token prompt the first replica held
