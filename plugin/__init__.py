"""kvroute.plugin: LiteLLM adapters. ``kvroute.plugin.kvroute_callback`` is the callback users name in configs."""

from __future__ import annotations

from typing import Any

__all__ = ["kvroute_callback"]


def __getattr__(name: str) -> Any:
    """Create the callback singleton on first access (importing LiteLLM only then)."""
    if name == "kvroute_callback":
        from kvroute.plugin.adapter.litellm_hooks import get_callback

        return get_callback()
    raise AttributeError(f"module 'kvroute.plugin' has no attribute {name!r}")
