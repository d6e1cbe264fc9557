"""The proxy runner: generated LiteLLM configs, and a real ``litellm`` proxy in front of two fake replicas."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from kvroute.plugin.dev.child_processes import live_children
from kvroute.plugin.dev.fleet import Fleet
from kvroute.plugin.dev.proxy_process import KVROUTE_CALLBACK, ModelGroup, ProxyProcess, build_proxy_config
from kvroute.policies.errors import ConfigError


def test_config_with_kvroute_and_fallback():
    replicas = ModelGroup("local", ["http://127.0.0.1:30001/v1", "http://127.0.0.1:30002/v1"],
                          kv_capacity_tokens=4096, block_size=16)
    hosted = ModelGroup("hosted", ["http://127.0.0.1:30003/v1"], engine=None,
                        prices={"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6})
    cfg = build_proxy_config([replicas, hosted], fallbacks={"local": ["hosted"]})
    assert cfg["litellm_settings"]["callbacks"] == [KVROUTE_CALLBACK]
    assert cfg["router_settings"]["fallbacks"] == [{"local": ["hosted"]}]
    assert cfg["general_settings"]["master_key"]
    first, _, third = cfg["model_list"]
    assert first["model_name"] == "local" and first["model_info"]["id"] == "local-0"
    assert first["model_info"]["engine"] == "vllm" and first["model_info"]["kv_capacity_tokens"] == 4096
    assert first["model_info"]["metrics_url"] == "http://127.0.0.1:30001/metrics"
    assert first["litellm_params"] == {"model": "openai/fake-model", "api_base": "http://127.0.0.1:30001/v1",
                                       "api_key": "none", "input_cost_per_token": 0, "output_cost_per_token": 0}
    assert "engine" not in third["model_info"] and third["litellm_params"]["input_cost_per_token"] == 1e-6
    assert yaml.safe_load(yaml.safe_dump(cfg)) == cfg


def test_proxy_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVROUTE_BILLING_DB", "postgresql://elsewhere/db")
    cfg = build_proxy_config([ModelGroup("g", ["http://127.0.0.1:30001/v1"])])
    env = ProxyProcess(cfg, kvroute_settings={"groups": {}}, workdir=tmp_path, env={"EXTRA": "1"}).env()
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["EXTRA"] == "1"
    assert env["KVROUTE_CONFIG"] == str(tmp_path / "kvroute.yaml") and env["KVROUTE_BILLING_DB"]
    isolated = ProxyProcess(cfg, kvroute_settings={}, workdir=tmp_path, inherit_kvroute_env=False).env()
    assert "KVROUTE_BILLING_DB" not in isolated and isolated["KVROUTE_CONFIG"]


def test_baseline_config_and_errors():
    cfg = build_proxy_config([ModelGroup("g", ["http://127.0.0.1:30001/v1"])], kvroute=False, master_key=None)
    assert "callbacks" not in cfg["litellm_settings"]
    assert cfg["router_settings"]["routing_strategy"] == "simple-shuffle"
    assert "general_settings" not in cfg
    with pytest.raises(ConfigError, match="fallbacks"):
        build_proxy_config([ModelGroup("g", ["http://x/v1"])], fallbacks={"g": ["missing"]})
    with pytest.raises(ConfigError, match="duplicate"):
        build_proxy_config([ModelGroup("g", ["http://x/v1"]), ModelGroup("g", ["http://y/v1"])])
    with pytest.raises(ConfigError, match="api_base"):
        build_proxy_config([ModelGroup("g", [])])


@pytest.mark.e2e
def test_real_proxy_in_front_of_two_fake_replicas():
    with Fleet(2, engine="fake") as fleet:
        cfg = build_proxy_config([ModelGroup("local", fleet.api_bases, model=fleet.model)], kvroute=True)
        settings = {"groups": {"local": {"policy": "cache_aware"}}}
        with ProxyProcess(cfg, kvroute_settings=settings) as proxy:
            assert proxy.process.pid in live_children()
            assert yaml.safe_load((proxy.workdir / "kvroute.yaml").read_text()) == {"kvroute": settings}
            body = {"model": "local", "max_tokens": 4,
                    "messages": [{"role": "system", "content": "shared context " * 200},
                                 {"role": "user", "content": "hello"}]}
            with httpx.Client(base_url=proxy.base_url, headers=proxy.headers, timeout=60, trust_env=False) as c:
                assert c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"}
                              ).status_code in (400, 401, 403)
                first = c.post("/v1/chat/completions", json=body)
                assert first.status_code == 200, first.text
                assert first.json()["choices"][0]["message"]["content"]
                served_by = first.headers["x-litellm-model-id"]
                assert served_by in ("local-0", "local-1")
                # streaming through the proxy keeps the usage chunk with the replica's cached-token count
                usage = None
                with c.stream("POST", "/v1/chat/completions",
                              json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage") or usage
                assert usage["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # kvroute kept the prefix's replica
            stats = [httpx.get(url + "/admin/stats").json() for url in fleet.base_urls]
            assert sum(s["succeeded"] for s in stats) == 2
            assert "litellm" in proxy.log_text().lower()  # the proxy's own output is collected
            pid = proxy.process.pid
        assert pid not in live_children() and proxy.process.poll() is not None
        assert not proxy.workdir.exists()
