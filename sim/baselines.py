"""Baseline routers re-implemented from their upstream sources (2025 forms) as ``Policy`` objects.

Each one is registered in the shared policy registry under its own name, so the simulator (and any
experiment) builds it exactly like kvroute's own policies. Round robin and least-load are kvroute's
built-ins (``round_robin``, ``least_load``). Each is a ``Policy``: baselines that learn from completions do it in
``observe``; the oracles read the simulated engines handed to ``bind`` (``FleetView.replicas``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.policies import (
    CacheAware,
    CacheAwareConfig,
    Decision,
    FleetView,
    Policy,
    PrefixIndex,
    PrefixIndexConfig,
    RequestOutcome,
    RoutingRequest,
    RoutingState,
    register_policy,
)


def _decision(policy: str, request: RoutingRequest, backend: str, reason: str, matched_blocks: int = 0,
              scores: dict[str, float] | None = None) -> Decision:
    matched = min(request.prompt_tokens, int(matched_blocks * request.block_tokens))
    return Decision(backend, policy, reason, matched_tokens=matched, matched_blocks=matched_blocks,
                    prompt_tokens=request.prompt_tokens, scores=scores or {}, request_id=request.request_id,
                    predicted_prefill_tokens=request.prompt_tokens - matched)


# --- random -----------------------------------------------------------------------------------------

class OwnIndex:
    """A baseline's own prefix index, built on its first request with that request's block size (``capacity``
    maps the block size in tokens to a capacity in tokens), the same object afterwards."""

    def __init__(self, capacity: Callable[[float], float], ttl_s: float | None = None) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self.index: PrefixIndex | None = None

    def get(self, request: RoutingRequest) -> PrefixIndex:
        if self.index is None:
            bt = max(1.0, float(request.block_tokens))
            self.index = PrefixIndex(PrefixIndexConfig(capacity_tokens=int(self._capacity(bt)), block_tokens=bt,
                                                       ttl_s=self._ttl_s))
        return self.index

@dataclass(frozen=True, slots=True)
class RandomConfig:
    """Uniform choice (LiteLLM's default ``simple-shuffle`` with equal weights); ``seed`` fixes the draw."""

    seed: int = 0


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, config: RandomConfig | None = None) -> None:
        self.config = config or RandomConfig()
        self._rng = random.Random(self.config.seed)

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        return _decision(self.name, request, self._rng.choice(list(candidates)), "random")


# --- LiteLLM prompt_caching -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LiteLLMPromptCachingConfig:
    """LiteLLM ``optional_pre_call_checks: ["prompt_caching"]``: pin TTL 300 s, prompts of ≥ 1024 tokens."""

    ttl_s: float = 300.0
    min_prompt_tokens: int = 1024
    seed: int = 0


class LiteLLMPromptCaching(Policy):
    """Exact pin of the cacheable prefix (up to the last ``cache_control`` marker) to the deployment that
    served it, written on success, read before routing; otherwise simple-shuffle (uniform random).

    The marker position comes from the request tag ``cache_prefix_blocks`` (set by workloads and log
    loaders where a client would put ``cache_control``); without a marker the check does nothing.
    """

    name = "litellm_prompt_caching"

    def __init__(self, config: LiteLLMPromptCachingConfig | None = None) -> None:
        self.config = config or LiteLLMPromptCachingConfig()
        self._rng = random.Random(self.config.seed)
        self._pins: dict[int, tuple[str, float]] = {}
        self._pending: dict[str, int] = {}

    def _prefix_key(self, request: RoutingRequest) -> int | None:
        raw = request.tags.get("cache_prefix_blocks") if request.tags else None
        if raw is None or request.prompt_tokens < self.config.min_prompt_tokens:
            return None
        n = int(raw)
        if n <= 0 or n > len(request.keys):
            return None
        return request.keys[n - 1]

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        key = self._prefix_key(request)
        if key is not None:
            if request.request_id:
                self._pending[request.request_id] = key
            pin = self._pins.get(key)
            if pin is not None and pin[1] >= now and pin[0] in candidates:
                return _decision(self.name, request, pin[0], "prompt_cache_pin")
        return _decision(self.name, request, self._rng.choice(list(candidates)), "simple_shuffle")

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        """Pin the prefix to the deployment that served it (written on the request's end, as LiteLLM does)."""
        key = self._pending.pop(request.request_id or "", None)
        if key is not None and outcome.backend is not None:
            self._pins[key] = (outcome.backend, outcome.at + self.config.ttl_s)


# --- SGLang cache_aware ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SGLangCacheAwareConfig:
    """SGLang/SMG ``cache_aware`` with the **CLI** defaults (``smg launch``): threshold 0.3, balance
    abs 64 / rel 1.5, tree 2^26 characters (≈ 2^24 tokens at 4 chars/token), eviction every 120 s."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = (1 << 26) // 4
    eviction_interval_s: float = 120.0


class SGLangCacheAware(Policy):
    """Imbalance switch (``max−min > abs`` and ``max > rel·min`` → least-loaded), else the best prefix
    match if its rate beats ``cache_threshold``, else least-loaded; the chosen worker's tree gets the
    prompt. Load is the router's in-flight count per worker. Tree = per-worker block LRU."""

    name = "sglang_cache_aware"

    def __init__(self, config: SGLangCacheAwareConfig | None = None) -> None:
        self.config = config or SGLangCacheAwareConfig()
        self._own = OwnIndex(lambda bt: self.config.max_tree_tokens)

    def _tree(self, request: RoutingRequest) -> PrefixIndex:
        return self._own.get(request)

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        cfg = self.config
        tree = self._tree(request)
        loads = {b: state.load.inflight(b) for b in candidates}
        least = min(candidates, key=lambda b: loads[b])
        hi, lo = max(loads.values()), min(loads.values())
        matched_blocks = 0
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            backend, reason = least, "imbalanced"
        else:
            matches = tree.match(request.keys, candidates, now)
            best = max(candidates, key=lambda b: (matches.get(b, 0), -loads[b])) if matches else least
            matched_blocks = matches.get(best, 0)
            rate = matched_blocks * request.block_tokens / request.prompt_tokens if request.prompt_tokens else 0
            if rate > cfg.cache_threshold:
                backend, reason = best, "cache_hit"
            else:
                backend, reason, matched_blocks = least, "cache_miss", matches.get(least, 0)
        tree.record(backend, request.keys, now)
        return _decision(self.name, request, backend, reason, matched_blocks)


# --- llm-d approximate prefix + queue + kv-utilisation -----------------------------------------------
@dataclass(frozen=True, slots=True)
class LlmdApproxConfig:
    """llm-d default Helm scorers: prefix-cache 3, queue 2, kv-cache-utilization 2; max-score picker;
    approximate index LRU of 31,250 blocks per pod (not autotuned); ≤ 2048 blocks matched."""

    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    lru_capacity_blocks: int = 31_250
    max_prefix_blocks: int = 2048
    seed: int = 0


class LlmdApprox(Policy):
    """Σ weight·score with prefix = matched/total blocks, queue = min–max normalised waiting queue
    (scraped), kv = 1 − KV usage (scraped); highest total wins, random tie-break; index written at pick."""

    name = "llmd_approx"

    def __init__(self, config: LlmdApproxConfig | None = None) -> None:
        self.config = config or LlmdApproxConfig()
        self._rng = random.Random(self.config.seed)
        self._own = OwnIndex(lambda bt: self.config.lru_capacity_blocks * bt)

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        cfg = self.config
        index = self._own.get(request)
        keys = request.keys[: cfg.max_prefix_blocks]
        matches = index.match(keys, candidates, now)
        total = len(keys)
        queues: dict[str, float] = {}
        kv: dict[str, float] = {}
        for b in candidates:
            sig = state.load.signal(b)
            queues[b] = float(sig.queue_depth or 0.0) if sig is not None else 0.0
            kv[b] = float(sig.kv_usage or 0.0) if sig is not None else 0.0
        qmax, qmin = max(queues.values()), min(queues.values())
        scores: dict[str, float] = {}
        for b in candidates:
            prefix = matches.get(b, 0) / total if total else 0.0
            queue = 1.0 if qmax == qmin else (qmax - queues[b]) / (qmax - qmin)
            scores[b] = cfg.prefix_weight * prefix + cfg.queue_weight * queue + cfg.kv_weight * (1.0 - kv[b])
        top = max(scores.values())
        best = [b for b in candidates if scores[b] >= top - 1e-12]
        backend = best[0] if len(best) == 1 else self._rng.choice(best)
        index.record(backend, keys, now)
        return _decision(self.name, request, backend, "max_score", matches.get(backend, 0), scores)


# --- NVIDIA Dynamo KV router, approximate mode --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DynamoConfig:
    """Dynamo ``--no-router-kv-events``: TTL 120 s, overlap credit 1.0, prefill_load_scale 1.0,
    temperature 0 (argmin; ties → smaller tree, then random); tree pruned at 2^20 blocks."""

    prefill_load_scale: float = 1.0
    overlap_credit: float = 1.0
    ttl_s: float = 120.0
    max_tree_blocks: int = 1 << 20
    seed: int = 0


class DynamoApprox(Policy):
    """cost = scale·max(active_prefill_blocks + prompt_blocks − overlap_blocks, 0) + active_decode_blocks.

    Active prefill is the router's predicted prefill charged until first token; active decode blocks
    are the prompt blocks of every request in flight on the worker, released at completion.
    """

    name = "dynamo"

    def __init__(self, config: DynamoConfig | None = None) -> None:
        self.config = config or DynamoConfig()
        self._rng = random.Random(self.config.seed)
        self._own = OwnIndex(lambda bt: self.config.max_tree_blocks * bt, ttl_s=self.config.ttl_s)
        self._active: dict[str, tuple[str, int]] = {}
        self._decode_blocks: dict[str, int] = {}

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        cfg = self.config
        bt = max(1.0, float(request.block_tokens))
        index = self._own.get(request)
        matches = index.match(request.keys, candidates, now)
        prompt_blocks = math.ceil(request.prompt_tokens / bt)
        active = {b: state.load.prefill_tokens(b) / bt for b in candidates}
        credit = self.credit(active, prompt_blocks)
        costs: dict[str, float] = {}
        for b in candidates:
            adjusted = max(active[b] + prompt_blocks - credit[b] * matches.get(b, 0), 0.0)
            costs[b] = cfg.prefill_load_scale * adjusted + self._decode_blocks.get(b, 0)
        low = min(costs.values())
        tied = [b for b in candidates if costs[b] <= low + 1e-9]
        if len(tied) > 1:
            smallest = min(index.blocks(b) for b in tied)
            tied = [b for b in tied if index.blocks(b) == smallest]
        backend = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        index.record(backend, request.keys, now)
        if request.request_id:
            self._active[request.request_id] = (backend, prompt_blocks)
            self._decode_blocks[backend] = self._decode_blocks.get(backend, 0) + prompt_blocks
        return _decision(self.name, request, backend, "min_cost", matches.get(backend, 0), costs)

    def credit(self, active_prefill_blocks: Mapping[str, float], prompt_blocks: int) -> dict[str, float]:
        """Device-overlap credit per matched block, per worker (constant in this form)."""
        return dict.fromkeys(active_prefill_blocks, self.config.overlap_credit)

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        """The request's decode blocks leave its worker."""
        got = self._active.pop(request.request_id or "", None)
        if got is not None:
            b, blocks = got
            self._decode_blocks[b] = max(0, self._decode_blocks.get(b, 0) - blocks)


# --- oracle: exact engine state (the precise-events upper reference) ----------------------------------
@dataclass(frozen=True, slots=True)
class OracleConfig:
    """llm-d *precise* scorer weights from the 73%-capacity benchmark: prefix 3, kv-util 2, queue 2."""

    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0


class Oracle(Policy):
    """llm-d's precise profile fed with *exact, instant* engine state instead of KV events: prefix score
    from each replica's real cache plus the prompts already queued there (what precise routing's
    speculative entries predict), queue and KV usage read at the moment of the pick. Simulator only."""

    name = "oracle"

    def __init__(self, config: OracleConfig | None = None) -> None:
        self.config = config or OracleConfig()
        self._replicas: Mapping[str, Any] = {}

    def bind(self, fleet: FleetView) -> None:
        """Read the simulated replicas (and have them track what is scheduled on them)."""
        if fleet.replicas:
            self._replicas = fleet.replicas
            for rep in self._replicas.values():
                rep.track_scheduled()

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        if not self._replicas:
            raise RuntimeError("oracle needs bind() with the simulated replicas (simulator only)")
        cfg = self.config
        total = len(request.keys)
        hits = {b: self._replicas[b].known_blocks(request.keys) for b in candidates}
        queues = {b: float(len(self._replicas[b].waiting)) for b in candidates}
        qmax, qmin = max(queues.values()), min(queues.values())
        scores: dict[str, float] = {}
        for b in candidates:
            prefix = hits[b] / total if total else 0.0
            queue = 1.0 if qmax == qmin else (qmax - queues[b]) / (qmax - qmin)
            kv = self._replicas[b].kv_usage()
            scores[b] = cfg.prefix_weight * prefix + cfg.queue_weight * queue + cfg.kv_weight * (1.0 - kv)
        backend = max(candidates, key=lambda b: (scores[b], -self._replicas[b].used_blocks(), b))
        return _decision(self.name, request, backend, "exact_state", hits[backend], scores)


# --- oracle_ttft: exact cache and exact queues, lowest predicted TTFT (the honest upper reference) ----
@dataclass(frozen=True, slots=True)
class OracleTTFTConfig:
    """The engine's own cost model prices every candidate; ``evict_weight`` prices the cache a copy evicts and
    ``duplicate_weight`` the recompute of a prefix another replica holds (kvroute's fleet terms, here from
    exact state; both 0 = pure greedy lowest TTFT, which thrashes caches under load). ``duplicate_weight`` is
    off by default: on the capped llm-d ladder it helps (p90 75 → 17 s) but on kv-cache-tester 60 sessions it
    hurts (1.8 → 3.0 s) — exact state with a greedy objective is no upper bound on either."""

    evict_weight: float = 0.5
    duplicate_weight: float = 0.0


class OracleTTFT(Policy):
    """Reads each simulated replica at the pick: the exact prefix it holds (computed or being computed by
    a queued request), the exact prefill work queued ahead, free slots and running decoders, and picks
    the lowest TTFT the engine's cost model predicts plus the fleet terms kvroute uses (recompute seconds of
    the cache the copy evicts; duplicate prefill of a held prefix, once plus once per request queued behind),
    all exact here. Greedy per request (no look-ahead).
    Simulator only."""

    name = "oracle_ttft"

    def __init__(self, config: OracleTTFTConfig | None = None) -> None:
        self.config = config or OracleTTFTConfig()
        self._replicas: Mapping[str, Any] = {}

    def bind(self, fleet: FleetView) -> None:
        """Read the simulated replicas (and have them track what is scheduled on them)."""
        if fleet.replicas:
            self._replicas = fleet.replicas
            for rep in self._replicas.values():
                rep.track_scheduled()

    def predict(self, rep: Any, request: RoutingRequest) -> tuple[float, int, float]:
        """(predicted TTFT + eviction price, exact cached blocks, own prefill seconds) on ``rep``."""
        cost, bt = rep.cost, rep.block_tokens
        hit_blocks = rep.known_blocks(request.keys)
        hit = min(hit_blocks * bt, request.prompt_tokens - 1)
        new = request.prompt_tokens - hit
        steps = math.ceil(new / cost.chunk_tokens)
        own = new / cost.prefill_tok_s + cost.chunk_attention(hit, new) + steps * (
            cost.step_overhead_s + cost.decode_s_per_seq * rep.dec_n)
        wait = rep.queued_prefill_s()
        ahead = len(rep.admitted) + len(rep.waiting) - cost.max_running
        if ahead >= 0 and rep.admitted:  # every slot taken: wait for the (ahead+1)-th running request to end
            left = sorted(r.output - rep.generated(r) for r in rep.admitted.values())
            step = cost.step_overhead_s + cost.decode_s_per_seq * rep.dec_n
            wait += left[min(ahead, len(left) - 1)] * step
        w = self.config.evict_weight
        if w > 0:
            empty = rep.capacity - rep.used_blocks() - len(rep.evictable)
            evicted = (math.ceil(new / bt) - empty) * bt
            if evicted > 0:
                wait += w * (evicted / cost.prefill_tok_s + cost.chunk_attention(0, evicted))
        return wait + own, hit_blocks, own

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        if not self._replicas:
            raise RuntimeError("oracle_ttft needs bind() with the simulated replicas (simulator only)")
        preds = {b: self.predict(self._replicas[b], request) for b in candidates}
        w = self.config.duplicate_weight
        if w > 0:  # recomputing a prefix another replica holds: once, plus once per request queued behind it
            best = max(preds.values(), key=lambda v: v[1])
            for b, (t, hit, own) in list(preds.items()):
                extra = own - best[2] if hit < best[1] else 0.0
                if extra > 0:
                    t += w * (1 + len(self._replicas[b].waiting)) * extra
                preds[b] = (t, hit, own)
        backend = min(candidates, key=lambda b: (preds[b][0], -preds[b][1], b))
        return _decision(self.name, request, backend, "exact_ttft", preds[backend][1],
                         {b: v[0] for b, v in preds.items()})


# --- kvroute precise: the default policy on kvroute's PreciseIndex fed by simulated KV events -----------
@dataclass(frozen=True, slots=True)
class KvroutePreciseConfig(CacheAwareConfig):
    """``cache_aware``'s knobs plus ``event_delay_s``: how late each replica's KV events reach the index."""

    event_delay_s: float = 0.05

    def __post_init__(self) -> None:
        CacheAwareConfig.__post_init__(self)
        if self.event_delay_s < 0:
            raise ValueError("event_delay_s must be >= 0")


class KvroutePrecise(CacheAware):
    """kvroute's default policy, unchanged, reading ``PreciseIndex`` (engine events, speculative entries at
    pick) instead of the approximate index: the difference to ``cache_aware`` is what events are worth."""

    name = "kvroute_precise"

    def __init__(self, config: KvroutePreciseConfig | None = None) -> None:
        super().__init__(config or KvroutePreciseConfig())
        self.event_delay_s = self.config.event_delay_s


BASELINES: dict[str, tuple[type, type]] = {
    "random": (RandomPolicy, RandomConfig),
    "litellm_prompt_caching": (LiteLLMPromptCaching, LiteLLMPromptCachingConfig),
    "sglang_cache_aware": (SGLangCacheAware, SGLangCacheAwareConfig),
    "llmd_approx": (LlmdApprox, LlmdApproxConfig),
    "dynamo": (DynamoApprox, DynamoConfig),
    "oracle": (Oracle, OracleConfig),
    "oracle_ttft": (OracleTTFT, OracleTTFTConfig),
    "kvroute_precise": (KvroutePrecise, KvroutePreciseConfig),
}
for _name, (_cls, _cfg) in BASELINES.items():
    register_policy(_name, _cls, _cfg)
