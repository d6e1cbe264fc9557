"""The 2026 anchors: SMG 1.9, llm-d 0.10 guides, Dynamo 1.6 and vllm-router's ``sticky_least_loaded``.

Each class is a reading of its upstream source with that source's defaults, named in its docstring; the
simulator builds them from the shared policy registry like every other baseline (``kvroute.sim.lineup``
registers them). Like the 2025 anchors they learn cache state from their own picks (approximate index), load
from the router's in-flight counts, and completions through ``observe``.

====================== ============================================= ===============================================
policy                 routes on                                     spreads a prefix when
====================== ============================================= ===============================================
smg_2026               best prefix match > 0.3 (char-tree reading),  the chosen worker's in-flight > 1.5 × fleet mean
                       least in-flight among the holders             and > mean + 64 (then the spill worker is
                                                                     inserted too)
llmd_2026              affinity filter (match ≥ 0.80) + token-load   the best sticky endpoint's estimated TTFT is
                       scorer (least router-tracked in-flight tokens) > 18 s above the best other endpoint's
dynamo_2026            lowest ``scale·max(prefill − credit, 0) +      a holder's outstanding prefill makes its
                       decode`` in blocks                            decayed credit worth less than the recompute
vllm_sticky_least_     a session stays where it started; a new       never (only when its worker leaves)
loaded                 session goes to the worker with fewest
                       sessions
====================== ============================================= ===============================================
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvroute.policies import (
    Policy,
    PrefixIndex,
    RequestOutcome,
    RoutingRequest,
    RoutingState,
    register_policy,
)
from kvroute.policies.decision import Decision
from kvroute.policies.hashing import Rendezvous
from kvroute.sim.baselines import DynamoApprox, DynamoConfig, OwnIndex, _decision


# --- SMG 1.9 cache_aware ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Smg2026Config:
    """SMG v1.9.0 ``smg launch --policy cache_aware`` CLI defaults (``model_gateway/src/main.rs``):
    ``--cache-threshold`` 0.3, ``--balance-rel-threshold`` 1.5, ``--balance-abs-threshold`` 64, tree of
    ``--max-tree-size`` 2^26 characters (≈ 2^24 tokens at 4 characters per token); ``--overlap-decay`` and
    ``--selection-temperature`` 0 (off), as by default."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = (1 << 26) // 4


class Smg2026CacheAware(Policy):
    """SMG 1.9 ``cache_aware`` (``model_gateway/src/policies/cache_aware.rs``): the fleet-wide
    imbalance switch is gone. Per request: if the best match rate beats ``cache_threshold``, pressure-select
    (least in-flight) among the workers holding that match; else the least-loaded worker. Then the per-request
    spill gate: if the chosen worker's in-flight exceeds ``rel × fleet mean`` *and* ``mean + abs``, spill to
    the least-loaded worker. The chosen worker's tree gets the prompt (a spilled prefix gains a tenant).
    Least-loaded ties go to fewer requests processed, then the worker's position."""

    name = "smg_2026"

    def __init__(self, config: Smg2026Config | None = None) -> None:
        self.config = config or Smg2026Config()
        self._own = OwnIndex(lambda bt: self.config.max_tree_tokens)
        self._processed: dict[str, int] = {}

    def _tree(self, request: RoutingRequest) -> PrefixIndex:
        return self._own.get(request)

    def _least(self, workers: Sequence[str], loads: Mapping[str, int], order: Mapping[str, int]) -> str:
        return min(workers, key=lambda b: (loads[b], self._processed.get(b, 0), order[b]))

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        cfg = self.config
        tree = self._tree(request)
        order = {b: i for i, b in enumerate(candidates)}
        loads = {b: state.load.inflight(b) for b in candidates}
        matches = tree.match(request.keys, candidates, now)
        top = max(matches.values(), default=0)
        rate = top * request.block_tokens / request.prompt_tokens if request.prompt_tokens else 0.0
        if top > 0 and rate > cfg.cache_threshold:
            holders = [b for b in candidates if matches.get(b, 0) == top]
            backend, reason = self._least(holders, loads, order), "cache_hit"
        else:
            backend, reason = self._least(candidates, loads, order), "cache_miss"
        mean = sum(loads.values()) / len(loads)
        if loads[backend] > cfg.balance_rel_threshold * mean and loads[backend] > mean + cfg.balance_abs_threshold:
            spill = self._least(candidates, loads, order)
            if spill != backend:
                backend, reason = spill, "spill"
        tree.record(backend, request.keys, now)
        self._processed[backend] = self._processed.get(backend, 0) + 1
        return _decision(self.name, request, backend, reason, matches.get(backend, 0))


# --- llm-d 0.10 guides: prefix-cache-affinity filter + token-load scorer -------------------------------
@dataclass(frozen=True, slots=True)
class Llmd2026Config:
    """llm-d router v0.10.0 as the guides configure it (``guides/optimized-baseline``): approximate prefix
    producer (per-pod LRU of 31,250 blocks, ≤ 2048 blocks matched), ``prefix-cache-affinity-filter``
    (``affinityThreshold`` 0.80, ``maxTTFTPenaltyMs`` 18,000, ``peakPrefillThroughput`` 15,928 tokens/s,
    ``explorationProbability`` 0), ``token-load-scorer`` (normaliser 4 Mi tokens), max-score picker."""

    affinity_threshold: float = 0.80
    max_ttft_penalty_ms: float = 18_000.0
    peak_prefill_throughput: float = 15_928.0
    token_load_max: int = 4 * 1024 * 1024
    lru_capacity_blocks: int = 31_250
    max_prefix_blocks: int = 2048
    seed: int = 0


class Llmd2026(Policy):
    """Filter then score (``pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity``,
    ``.../scorer/tokenload``): keep the endpoints whose prefix score (matched / total blocks) is at least
    ``affinity_threshold``; reopen the pool to every endpoint when the best sticky endpoint's estimated TTFT
    (in-flight tokens / ``peakPrefillThroughput``) exceeds the best other endpoint's by more than
    ``maxTTFTPenaltyMs``. Survivors are scored ``1 − min(1, in-flight tokens / 4 Mi)``; the highest wins, random
    tie-break. In-flight tokens are the prompt tokens of the requests the router sent and not yet completed;
    the index is written at the pick."""

    name = "llmd_2026"

    def __init__(self, config: Llmd2026Config | None = None) -> None:
        self.config = config or Llmd2026Config()
        self._rng = random.Random(self.config.seed)
        self._own = OwnIndex(lambda bt: self.config.lru_capacity_blocks * bt)
        self._tokens: dict[str, int] = {}
        self._inflight: dict[str, tuple[str, int]] = {}

    def affinity_pool(self, scores: Mapping[str, float], tokens: Mapping[str, int]) -> tuple[list[str], str]:
        """The filter: (endpoints kept, why)."""
        cfg = self.config
        sticky = [b for b, s in scores.items() if s >= cfg.affinity_threshold]
        if not sticky:
            return list(scores), "no_affinity"
        others = [b for b in scores if b not in sticky]
        if others and cfg.max_ttft_penalty_ms > 0:
            def ttft_ms(b: str) -> float:
                return tokens.get(b, 0) / cfg.peak_prefill_throughput * 1000.0
            if min(map(ttft_ms, sticky)) - min(map(ttft_ms, others)) > cfg.max_ttft_penalty_ms:
                return list(scores), "affinity_released"
        return sticky, "affinity"

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        cfg = self.config
        index = self._own.get(request)
        keys = request.keys[: cfg.max_prefix_blocks]
        matches = index.match(keys, candidates, now)
        total = len(keys)
        prefix = {b: (matches.get(b, 0) / total if total else 0.0) for b in candidates}
        pool, reason = self.affinity_pool(prefix, self._tokens)
        scores = {b: 1.0 - min(1.0, self._tokens.get(b, 0) / cfg.token_load_max) for b in pool}
        top = max(scores.values())
        best = [b for b in pool if scores[b] >= top - 1e-12]
        backend = best[0] if len(best) == 1 else self._rng.choice(best)
        index.record(backend, keys, now)
        if request.request_id:
            self._inflight[request.request_id] = (backend, request.prompt_tokens)
            self._tokens[backend] = self._tokens.get(backend, 0) + request.prompt_tokens
        return _decision(self.name, request, backend, reason, matches.get(backend, 0), scores)

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        """The request's prompt tokens leave its worker's load."""
        got = self._inflight.pop(request.request_id or "", None)
        if got is not None:
            b, tokens = got
            self._tokens[b] = max(0, self._tokens.get(b, 0) - tokens)


# --- Dynamo 1.6 cost with overlap-credit decay ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Dynamo2026Config(DynamoConfig):
    """Dynamo 1.6 (``docs/components/router/router-configuration.md``, ``lib/kv-router/src/scheduling/
    selector.rs``) without KV events: ``prefill_load_scale`` 1.0, ``--router-kv-overlap-score-credit`` 1.0,
    ``--router-temperature`` 0 (argmin), TTL 120 s, tree 2^20 blocks. ``--router-kv-overlap-score-credit-decay``
    defaults to 0 (off) upstream; the 2026 form compared here turns it on at 1.0."""

    overlap_credit_decay: float = 1.0


class Dynamo2026(DynamoApprox):
    """``cost = prefill_load_scale · max(active_prefill + prompt_blocks − credit · overlap, 0) + decode_blocks``
    with the device credit decayed for busy holders: ``credit / (1 + decay · normalised_excess_prefill)``.
    Our reading of the normalisation: a worker's active prefill blocks above the least busy worker's, in
    units of this request's prompt blocks (one request's worth of excess halves the credit at decay 1).
    Host/disk tier credits are absent here (the simulated engines have one tier)."""

    name = "dynamo_2026"

    def __init__(self, config: Dynamo2026Config | None = None) -> None:
        super().__init__(config or Dynamo2026Config())

    def credit(self, active_prefill_blocks: Mapping[str, float], prompt_blocks: int) -> dict[str, float]:
        cfg = self.config
        decay = getattr(cfg, "overlap_credit_decay", 0.0)
        low = min(active_prefill_blocks.values(), default=0.0)
        unit = max(1, prompt_blocks)
        return {b: cfg.overlap_credit / (1.0 + decay * max(0.0, a - low) / unit)
                for b, a in active_prefill_blocks.items()}


# --- vllm-router sticky_least_loaded ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VllmStickyLeastLoadedConfig:
    """vllm-router 0.1.x ``--policy sticky_least_loaded``: idle session TTL 7,200 s
    (``VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S``)."""

    session_ttl_s: float = 7200.0


class VllmStickyLeastLoaded(Policy):
    """vllm-router (``vllm-project/router``, README and ``docs/load_balancing/README.md``, 0.1.15): a new
    session goes to the worker with the fewest active sessions (ties by rendezvous hash) and stays there until
    that worker is unavailable or the session is idle past the TTL. The session key is the request's session
    id; a request without one is keyed like ``consistent_hash``'s last fallback, by a hash of its body (here
    the prompt's last block key), so each distinct prompt is its own session."""

    name = "vllm_sticky_least_loaded"

    def __init__(self, config: VllmStickyLeastLoadedConfig | None = None) -> None:
        self.config = config or VllmStickyLeastLoadedConfig()
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (worker, last use)
        self._count: dict[str, int] = {}
        self._hrw = Rendezvous()

    def _expire(self, now: float) -> None:
        ttl = self.config.session_ttl_s
        while self._sessions:
            key, (worker, last) = next(iter(self._sessions.items()))
            if now - last <= ttl:
                break
            del self._sessions[key]
            self._count[worker] -= 1

    @staticmethod
    def session_of(request: RoutingRequest) -> str:
        if request.session_key:
            return f"s:{request.session_key}"
        if request.keys:
            return f"b:{request.keys[-1]}"
        return f"r:{request.request_id or ''}"

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        self._expire(now)
        key = self.session_of(request)
        bound = self._sessions.pop(key, None)
        if bound is not None and bound[0] in candidates:
            backend, reason = bound[0], "sticky"
        else:
            if bound is not None:
                self._count[bound[0]] -= 1
            backend = min(candidates, key=lambda b: (self._count.get(b, 0), -self._hrw.weight(key, b), b))
            self._count[backend] = self._count.get(backend, 0) + 1
            reason = "new_session"
        self._sessions[key] = (backend, now)
        return _decision(self.name, request, backend, reason)


ANCHORS_2026: dict[str, tuple[type, type]] = {
    "smg_2026": (Smg2026CacheAware, Smg2026Config),
    "llmd_2026": (Llmd2026, Llmd2026Config),
    "dynamo_2026": (Dynamo2026, Dynamo2026Config),
    "vllm_sticky_least_loaded": (VllmStickyLeastLoaded, VllmStickyLeastLoadedConfig),
}
for _name, (_cls, _cfg) in ANCHORS_2026.items():
    register_policy(_name, _cls, _cfg)
