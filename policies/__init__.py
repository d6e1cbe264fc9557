"""kvroute.policies: the routing brain (pure Python, no LiteLLM).

Public API: build a ``Router``, fingerprint requests, pick backends, report outcomes.
"""

from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.cache_aware import CacheAware, CacheAwareConfig
from kvroute.policies.decision import Decision
from kvroute.policies.errors import ConfigError, InputError, KvrouteError
from kvroute.policies.fingerprint import FingerprintConfig, Fingerprinter, chain_seed, token_keys
from kvroute.policies.least_load import LeastLoad
from kvroute.policies.load import BackendLoad, ExternalSignal, LoadTracker
from kvroute.policies.prefix_hash import PrefixHash, PrefixHashConfig
from kvroute.policies.prefix_index import PrefixIndex, PrefixIndexConfig, PrefixLocator
from kvroute.policies.registry import DEFAULT_POLICY, build_policy, policy_names, register_policy
from kvroute.policies.request import RoutingRequest
from kvroute.policies.round_robin import RoundRobin
from kvroute.policies.router import Router, RouterConfig
from kvroute.policies.session_affinity import SessionAffinity, SessionAffinityConfig

__all__ = [
    "DEFAULT_POLICY",
    "BackendLoad",
    "CacheAware",
    "CacheAwareConfig",
    "ConfigError",
    "Decision",
    "ExternalSignal",
    "FingerprintConfig",
    "Fingerprinter",
    "InputError",
    "KvrouteError",
    "LeastLoad",
    "LoadTracker",
    "Policy",
    "PrefixHash",
    "PrefixHashConfig",
    "PrefixIndex",
    "PrefixIndexConfig",
    "PrefixLocator",
    "RoundRobin",
    "Router",
    "RouterConfig",
    "RoutingRequest",
    "RoutingState",
    "SessionAffinity",
    "SessionAffinityConfig",
    "build_policy",
    "chain_seed",
    "policy_names",
    "register_policy",
    "token_keys",
]
