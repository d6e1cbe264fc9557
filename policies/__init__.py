"""kvroute.policies: the routing brain (pure Python, no LiteLLM).

Public API: build a ``Router``, fingerprint requests, pick backends, report outcomes.
"""

from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.cache_aware import CacheAware, CacheAwareConfig
from kvroute.policies.decision import Decision
from kvroute.policies.errors import ConfigError, InputError, KvrouteError
from kvroute.policies.fingerprint import (
    ChainKey,
    FingerprintConfig,
    Fingerprinter,
    chain_seed,
    session_key,
    token_keys,
)
from kvroute.policies.health import BreakerConfig, BreakerState, CircuitBreaker, HealthBoard, Outcome
from kvroute.policies.hybrid import HostedQuote, Hybrid, HybridConfig, OverflowGuard
from kvroute.policies.least_load import LeastLoad
from kvroute.policies.lifecycle import FleetView, RequestOutcome, RouteSides
from kvroute.policies.load import BackendLoad, ExternalSignal, LoadTracker
from kvroute.policies.marketplace import Marketplace, MarketplaceConfig
from kvroute.policies.outcomes import Attribution, FailureKind, classify
from kvroute.policies.prefix_hash import PrefixHash, PrefixHashConfig
from kvroute.policies.prefix_index import PrefixIndex, PrefixIndexConfig, PrefixLocator
from kvroute.policies.rates import ProviderQuote, SelfHostedRate
from kvroute.policies.registry import DEFAULT_POLICY, build_policy, policy_names, register_policy
from kvroute.policies.request import RoutingRequest
from kvroute.policies.round_robin import RoundRobin
from kvroute.policies.router import Router, RouterConfig
from kvroute.policies.session_affinity import SessionAffinity, SessionAffinityConfig

__all__ = [
    "DEFAULT_POLICY",
    "Attribution",
    "BackendLoad",
    "BreakerConfig",
    "BreakerState",
    "CacheAware",
    "CacheAwareConfig",
    "ChainKey",
    "CircuitBreaker",
    "ConfigError",
    "Decision",
    "ExternalSignal",
    "FailureKind",
    "FingerprintConfig",
    "Fingerprinter",
    "FleetView",
    "HealthBoard",
    "HostedQuote",
    "Hybrid",
    "HybridConfig",
    "InputError",
    "KvrouteError",
    "LeastLoad",
    "LoadTracker",
    "Marketplace",
    "MarketplaceConfig",
    "Outcome",
    "OverflowGuard",
    "Policy",
    "PrefixHash",
    "PrefixHashConfig",
    "PrefixIndex",
    "PrefixIndexConfig",
    "PrefixLocator",
    "ProviderQuote",
    "RequestOutcome",
    "RoundRobin",
    "RouteSides",
    "Router",
    "RouterConfig",
    "RoutingRequest",
    "RoutingState",
    "SelfHostedRate",
    "SessionAffinity",
    "SessionAffinityConfig",
    "build_policy",
    "chain_seed",
    "classify",
    "policy_names",
    "register_policy",
    "session_key",
    "token_keys",
]
