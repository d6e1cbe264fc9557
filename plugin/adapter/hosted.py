"""Hosted-provider specifics: marketplace rate cards from deployments, and provider cache-key forwarding.

Keeping provider-side prompt caches warm: OpenAI-compatible upstreams get ``prompt_cache_key`` and OpenRouter
gets ``session_id`` (OpenRouter's provider-sticky routing key), unless the user already set one. Keys are
hashes, never prompt text.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.plugin.adapter.deployments import Backend
from kvroute.policies.rates import ProviderQuote

CACHE_KEY_PROVIDERS = frozenset({"openai", "openai_compatible", "marketplace", "azure", "deepseek"})


def provider_quote(backend: Backend) -> ProviderQuote | None:
    """The marketplace rate card of a priced hosted backend (None when unpriced or self-hosted)."""
    if backend.self_hosted or backend.input_price is None or backend.output_price is None:
        return None
    return ProviderQuote(backend=backend.id, provider=backend.provider, model=backend.model,
                         input_price=backend.input_price, output_price=backend.output_price,
                         cache_read_price=backend.cache_read_price, kind=backend.provider,
                         currency=backend.currency)


def forward_cache_key(kwargs: dict, backend: Backend, key: str) -> dict | None:
    """Set ``prompt_cache_key`` (OpenAI-compatible) or OpenRouter ``session_id`` unless the user set one."""
    if backend.provider == "openrouter":
        extra = kwargs.get("extra_body")
        if not isinstance(extra, dict):
            extra = {}
        if "session_id" in extra or kwargs.get("session_id"):
            return None
        kwargs["extra_body"] = {**extra, "session_id": key}
        return kwargs
    if backend.provider in CACHE_KEY_PROVIDERS:
        if kwargs.get("prompt_cache_key"):
            return None
        extra = kwargs.get("extra_body")
        if isinstance(extra, Mapping) and extra.get("prompt_cache_key"):
            return None
        kwargs["prompt_cache_key"] = key
        return kwargs
    return None
