"""Deployment classification: self-hosted replicas vs hosted providers, prices as Decimal."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvroute.plugin.adapter.deployments import Deployments, classify
from kvroute.policies.errors import ConfigError


def dep(model, api_base=None, info=None, **params):
    return {"model_name": "g", "litellm_params": {"model": model, "api_base": api_base, **params},
            "model_info": {"id": "d1", **(info or {})}}


def test_vllm_replica_from_model_info():
    b = classify(dep("openai/llama", "http://10.0.0.1:8000/v1", {"engine": "vLLM", "kv_capacity_tokens": 400000,
                                                                "block_size": 16, "metrics_url": "http://x/metrics"}))
    assert b.self_hosted and b.engine == "vllm" and b.provider == "vllm"
    assert (b.kv_capacity_tokens, b.block_size, b.metrics_url) == (400000, 16, "http://x/metrics")


@pytest.mark.parametrize(("model", "info", "engine"), [
    ("hosted_vllm/llama", {}, "vllm"),
    ("openai/x", {"engine": "sglang"}, "sglang"),
    ("openai/x", {"engine": "llama.cpp"}, "llamacpp"),
])
def test_engines(model, info, engine):
    b = classify(dep(model, "http://127.0.0.1:1/v1", info))
    assert b.self_hosted and b.engine == engine


@pytest.mark.parametrize(("model", "api_base", "info", "provider"), [
    ("openai/gpt-4o", None, {}, "openai"),
    ("anthropic/claude-3-5-sonnet-20240620", None, {}, "anthropic"),
    ("openrouter/deepseek/deepseek-chat", None, {}, "openrouter"),
    ("openai/llama", "https://api.shareai.now/v1", {}, "marketplace"),
    ("openai/llama", "https://my-gateway.example/v1", {}, "openai_compatible"),
    ("openai/llama", "https://x.example/v1", {"provider": "Together"}, "together"),
])
def test_hosted_providers(model, api_base, info, provider):
    b = classify(dep(model, api_base, info))
    assert not b.self_hosted and b.provider == provider


def test_prices_from_model_info_params_and_cost_map():
    cost_map = {"gpt-4o": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05,
                           "cache_read_input_token_cost": 1.25e-06}}
    b = classify(dep("openai/gpt-4o"), cost_map)
    assert b.input_price == Decimal("2.5E-6") and b.cache_read_price == Decimal("1.25E-6") and b.caching_pays
    b = classify(dep("openai/gpt-4o", info={"input_cost_per_token": "0.000001"}), cost_map)
    assert b.input_price == Decimal("0.000001") and b.output_price == Decimal("1E-5")
    b = classify(dep("openai/custom", "http://h/v1", input_cost_per_token=3e-6, output_cost_per_token=6e-6), cost_map)
    assert b.input_price == Decimal("3E-6") and b.cache_read_price == b.input_price and not b.caching_pays
    assert classify(dep("openai/unknown", "http://h/v1")).input_price is None


def test_litellm_cost_map_is_used_by_default():
    fleet = Deployments(lambda: __import__("litellm").model_cost)
    b = fleet.backend(dep("openai/gpt-4o"))
    assert b.input_price is not None and b.input_price > 0
    assert fleet.backend(dep("openai/gpt-4o")) is b  # cached by id


@pytest.mark.parametrize(("entry", "key"), [
    ({"model_name": "g", "litellm_params": {"model": "x"}, "model_info": {}}, "model_list.0.model_info.id"),
    (dep("openai/x", info={"engine": "tgi"}), "model_list.0.model_info.engine"),
    (dep("openai/x", info={"kv_capacity_tokens": -5, "engine": "vllm"}), "model_list.0.model_info.kv_capacity_tokens"),
    (dep("openai/x", info={"input_cost_per_token": "cheap"}), "model_list.0.model_info.input_cost_per_token"),
    (dep("openai/x", info={"output_cost_per_token": -1}), "model_list.0.model_info.output_cost_per_token"),
])
def test_bad_entries_name_the_field(entry, key):
    with pytest.raises(ConfigError) as err:
        Deployments().add_model_list([entry])
    assert err.value.key == key


def test_group_kind_override_and_groups():
    fleet = Deployments(group_kind=lambda g: "self_hosted" if g == "g" else "auto")
    added = fleet.add_model_list([dep("openai/x", "http://h/v1")])
    assert added[0].self_hosted and fleet.groups()["g"] == added
    assert added[0].as_dict()["id"] == "d1"
