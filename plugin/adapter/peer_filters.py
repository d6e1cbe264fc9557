"""LiteLLM's other routing filters (budget limits, affinity, tag filters...), run before kvroute picks.

LiteLLM runs every callback's ``async_filter_deployments`` in turn on what the previous one kept. kvroute narrows
to the one deployment it picks, so a filter after it (``RouterBudgetLimiting`` dropping a deployment over its
budget) could drop that pick and leave nothing although another deployment qualified: the client got
``429 No deployments available - crossed budget`` where the same proxy without kvroute served it. ``PeerFilters``
runs the other filters first, so kvroute picks among what they keep; LiteLLM's own later run then keeps the pick.
"""

from __future__ import annotations

from typing import Any

import litellm
from litellm.integrations.custom_logger import CustomLogger


def _is_filter(callback: object) -> bool:
    """A callback that overrides ``async_filter_deployments`` (the base returns its input unchanged), other than
    kvroute's own and LiteLLM's prompt-caching check (a preference LiteLLM's filter loop also skips)."""
    if not isinstance(callback, CustomLogger):
        return False
    kind = type(callback)
    if kind.async_filter_deployments is CustomLogger.async_filter_deployments:
        return False
    return not kind.__module__.startswith("kvroute.") and kind.__name__ != "PromptCachingDeploymentCheck"


class PeerFilters:
    """The routing filters registered next to ``owner`` in ``litellm.callbacks`` (re-read when the list changes)."""

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self._seen: tuple[int, int] | None = None
        self._peers: tuple[CustomLogger, ...] = ()

    def peers(self) -> tuple[CustomLogger, ...]:
        callbacks = litellm.callbacks if isinstance(litellm.callbacks, list) else []
        seen = (id(callbacks), len(callbacks))
        if seen != self._seen:
            self._peers = tuple(cb for cb in callbacks if cb is not self.owner and _is_filter(cb))
            self._seen = seen
        return self._peers

    async def narrow(self, model: str, deployments: list, messages: Any, request_kwargs: dict | None) -> list:
        """What every peer filter keeps of ``deployments``, in order; a peer's error (every deployment over
        budget...) propagates, and LiteLLM's own run of that filter raises it to the client unchanged."""
        for peer in self.peers():
            if not deployments:
                break
            deployments = await peer.async_filter_deployments(
                model=model, healthy_deployments=deployments, messages=messages, request_kwargs=request_kwargs,
                parent_otel_span=None)
        return deployments
