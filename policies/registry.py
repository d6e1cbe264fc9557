"""Build policies by name from config: one registry line per policy, knobs validated against its config."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from kvroute.policies.base import Policy
from kvroute.policies.cache_aware import CacheAware, CacheAwareConfig
from kvroute.policies.errors import ConfigError
from kvroute.policies.hybrid import Hybrid, HybridConfig
from kvroute.policies.least_load import LeastLoad, LeastLoadConfig
from kvroute.policies.marketplace import Marketplace, MarketplaceConfig
from kvroute.policies.prefix_hash import PrefixHash, PrefixHashConfig
from kvroute.policies.round_robin import RoundRobin, RoundRobinConfig
from kvroute.policies.session_affinity import SessionAffinity, SessionAffinityConfig

DEFAULT_POLICY = "cache_aware"

_REGISTRY: dict[str, tuple[type, type]] = {
    "round_robin": (RoundRobin, RoundRobinConfig),
    "least_load": (LeastLoad, LeastLoadConfig),
    "session_affinity": (SessionAffinity, SessionAffinityConfig),
    "prefix_hash": (PrefixHash, PrefixHashConfig),
    "cache_aware": (CacheAware, CacheAwareConfig),
    "marketplace": (Marketplace, MarketplaceConfig),
    "hybrid": (Hybrid, HybridConfig),
}


def register_policy(name: str, policy_cls: type, config_cls: type) -> None:
    """Add a policy (e.g. a simulator baseline) under ``name``; its config must be a dataclass."""
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError("config_cls must be a dataclass")
    _REGISTRY[name] = (policy_cls, config_cls)


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``known`` to a mistyped ``word``, else ``" (known: ...)"``."""
    known = sorted(known)
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (known: {', '.join(known) or 'none'})"


def build_config(name: str, knobs: Mapping[str, Any] | None = None, where: str = "policy",
                 knobs_where: str | None = None) -> Any:
    """Validated config dataclass for ``name``; an unknown policy raises ``ConfigError`` naming ``where``, an
    unknown or bad knob one naming ``<knobs_where>.<knob>`` (``knobs_where`` defaults to ``where``)."""
    if name not in _REGISTRY:
        raise ConfigError(where, f"unknown policy {name!r}" + did_you_mean(name, policy_names()))
    _, config_cls = _REGISTRY[name]
    knobs = dict(knobs or {})
    knobs_where = knobs_where or where
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for key in knobs:
        if key not in fields:
            raise ConfigError(f"{knobs_where}.{key}", f"unknown knob for {name}" + did_you_mean(str(key), fields))
    try:
        return config_cls(**knobs)
    except (TypeError, ValueError) as exc:
        bad = next((k for k in knobs if k in str(exc)), None)
        raise ConfigError(f"{knobs_where}.{bad}" if bad else knobs_where, str(exc)) from exc


def build_policy(name: str, knobs: Mapping[str, Any] | None = None, where: str = "policy",
                 knobs_where: str | None = None) -> Policy:
    config = build_config(name, knobs, where, knobs_where)
    policy_cls, _ = _REGISTRY[name]
    return policy_cls(config)
