"""LiteLLM's other routing filters narrow the deployments before kvroute picks (``plugin/adapter/peer_filters.py``)."""

from __future__ import annotations

import litellm
import pytest
from litellm.caching.dual_cache import DualCache
from litellm.integrations.custom_logger import CustomLogger
from litellm.router_strategy.budget_limiter import RouterBudgetLimiting

from kvroute.plugin.adapter.peer_filters import PeerFilters


def dep(i: str, **params) -> dict:
    return {"model_name": "hosted", "litellm_params": {"model": "openai/m", **params}, "model_info": {"id": i}}


class DropFirst(CustomLogger):
    async def async_filter_deployments(self, model, healthy_deployments, messages, request_kwargs=None,
                                       parent_otel_span=None):
        return healthy_deployments[1:]


class Owner(CustomLogger):  # stands for kvroute's callback: never its own peer
    async def async_filter_deployments(self, model, healthy_deployments, messages, request_kwargs=None,
                                       parent_otel_span=None):
        return []


@pytest.fixture
def callbacks(monkeypatch):
    monkeypatch.setattr(litellm, "callbacks", [])
    return litellm.callbacks


async def test_other_filters_narrow_first_and_list_changes_are_seen(callbacks):
    owner = Owner()
    peers = PeerFilters(owner)
    callbacks.extend([owner, CustomLogger(), "a-string-callback"])  # a logger that filters nothing is no peer
    assert peers.peers() == ()
    assert await peers.narrow("hosted", [dep("a"), dep("b")], None, {}) == [dep("a"), dep("b")]
    callbacks.append(DropFirst())
    assert await peers.narrow("hosted", [dep("a"), dep("b")], None, {}) == [dep("b")]
    assert await peers.narrow("hosted", [], None, {}) == []


async def test_litellms_budget_limiter_drops_the_deployment_over_budget(callbacks):
    cache = DualCache()
    model_list = [dep("a", max_budget=0.001, budget_duration="1d"), dep("b")]
    limiter = RouterBudgetLimiting(dual_cache=cache, provider_budget_config=None, model_list=model_list)
    try:
        peers = PeerFilters(object())
        assert peers.peers() == (limiter,)  # it registers itself in litellm.callbacks
        assert await peers.narrow("hosted", list(model_list), None, {}) == model_list
        await cache.async_set_cache("deployment_spend:a:1d", 0.002)
        assert await peers.narrow("hosted", list(model_list), None, {}) == [model_list[1]]
        with pytest.raises(ValueError, match="crossed budget"):  # all over: LiteLLM's own error, unchanged
            await peers.narrow("hosted", [model_list[0]], None, {})
    finally:
        limiter.retire()
