"""llama.cpp replicas behind a real LiteLLM proxy with kvroute: the same long prompt sent one request at a time stays
on the replica that computed it first, and llama.cpp reports the prefix cached."""

from __future__ import annotations

import httpx
import pytest

from kvroute.plugin.dev.llamacpp import xllamacpp_available
from kvroute.plugin.dev.tiny_model import stdlib_sources

NEEDS_ENGINES = "needs the engines extra: pip install 'kvroute[engines]' (xllamacpp, gguf, ...)"
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not xllamacpp_available(), reason=NEEDS_ENGINES)]


@pytest.mark.parametrize("replicas", [2, 3])
def test_repeats_of_one_long_prompt_stay_on_the_first_llamacpp_replica(tmp_path_factory, replicas):
    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
    from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

    cache_dir = str(tmp_path_factory.mktemp("kvroute-cache"))
    doc = "".join(p.read_text(errors="ignore") for p in stdlib_sources()[:4])[:6000]
    opts = ReplicaOptions(cache_dir=cache_dir, cache_ram_mib=32, threads=1, parallel=1)
    with Fleet(replicas, engine="llamacpp", options=opts, name_prefix="rep") as fleet:
        group = ModelGroup("tiny", fleet.api_bases, model=fleet.model, engine="llamacpp", id_prefix="tiny")
        config = build_proxy_config([group], kvroute=True)
        with ProxyProcess(config, inherit_kvroute_env=False) as proxy, \
                httpx.Client(timeout=120, trust_env=False) as client:
            seen = []
            for i in range(5):
                body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": f"question {i}"}]}
                r = client.post(proxy.base_url + "/v1/chat/completions", headers=proxy.headers, json=body)
                assert r.status_code == 200, r.text[:300]
                usage = r.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                seen.append((r.headers.get("x-litellm-model-id"), usage["prompt_tokens"], cached))
            metrics = client.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers).text
    assert seen[0][1] > 1000, seen  # a long prompt on the tiny model's tokenizer
    assert seen[0][0] and all(b == seen[0][0] for b, _, _ in seen), seen
    assert all(cached >= 0.9 * prompt for _, prompt, cached in seen[1:]), seen
    assert 'reason="prefix_spill"' not in metrics
