"""``cache_aware`` (the default): longest cached prefix, weighed against load in one cost in tokens.

Shape: filter (bounded load) → score (cost per backend) → pick (cheapest; near-ties go to the longer
match, then to the prefix's rendezvous order for warm requests or the least recently used backend for
cold ones). Cost of sending the request to backend *b*::

    cost_b = uncached_prefill_b + queue_weight · queued_prefill_b
             + decode_weight_tokens · running_b + kv_weight · kv_usage_b · prompt_tokens
             + replication_weight · kv_usage_b · (best_match − match_b)

(near-ties, within ``max(tie_tokens, tie_fraction·prompt)``, go to the longer match) so a holder of the
prefix wins unless its expected wait costs more than the prefill it saves. A hot
prefix spills to a second backend once its holder's queue outweighs the saving (hot-prefix
replication), and concentrates again when demand falls, because near-ties follow a stable
per-prefix order and idle copies age out of the LRU. The last term prices that copy: on a backend
whose KV cache is full it evicts about as much reusable cache as it duplicates (free when caches are empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import RoutingState, least_load_decision
from kvroute.policies.decision import Decision
from kvroute.policies.filters import bounded_load
from kvroute.policies.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """Knobs of the cost model; every weight is in prompt-token equivalents."""

    min_prefix_tokens: int = 256
    queue_weight: float = 0.5
    decode_weight_tokens: float = 16.0
    kv_weight: float = 0.25
    epsilon: float = 0.5
    min_cap: int = 4
    tie_tokens: float = 64.0
    tie_fraction: float = 0.05
    max_scores: int = 8
    replication_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("min_prefix_tokens", "queue_weight", "decode_weight_tokens", "kv_weight", "epsilon",
                     "tie_tokens", "tie_fraction", "replication_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.min_cap < 1:
            raise ValueError("min_cap must be >= 1")


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        cfg = self.config
        if request.routable_tokens < cfg.min_prefix_tokens:
            return least_load_decision(request, candidates, state, now, self.name, reason="least_load",
                                       skipped="short_prompt")
        load = state.load
        # Filter: bounded load keeps any backend from taking more than (1+ε)× its fair share.
        allowed, _ = bounded_load(candidates, load, cfg.epsilon, cfg.min_cap)
        matches = state.index.match(request.keys, allowed, now)
        prompt = request.prompt_tokens
        block_tokens = request.block_tokens
        costs: dict[str, float] = {}
        matched_tok: dict[str, int] = {}
        best_held = min(prompt, int(max(matches.values(), default=0) * block_tokens))
        for b in allowed:
            view = load.view(b, now)
            m = min(prompt, int(matches.get(b, 0) * block_tokens))
            matched_tok[b] = m
            costs[b] = (
                (prompt - m)
                + cfg.queue_weight * view.queue_tokens
                + cfg.decode_weight_tokens * view.running
                + cfg.kv_weight * view.kv_usage * prompt
                + cfg.replication_weight * view.kv_usage * (best_held - m)
            )
        best_cost = min(costs.values())
        # Near-ties (within a block or a few % of the prompt) go to the longer match: co-locating a
        # burst of siblings costs the same TTFT but computes the shared prefix once.
        band = max(cfg.tie_tokens, cfg.tie_fraction * prompt)
        near = [b for b in allowed if costs[b] <= best_cost + band]
        best_match = max(matched_tok[b] for b in near)
        top_holder = max(matched_tok.values())
        if best_match > 0:
            holders = [b for b in near if matched_tok[b] == best_match]
            if len(holders) == 1:
                backend = holders[0]
            else:
                anchor = request.keys[0]
                backend = min(holders, key=lambda b: (-state.rendezvous.weight(anchor, b), b))
            reason = "prefix_match" if best_match >= top_holder else "prefix_spill"
        else:
            cheapest = [b for b in near if costs[b] <= best_cost + cfg.tie_tokens]
            backend = min(cheapest, key=lambda b: (load.last_pick(b), costs[b], b))  # no-hit LRU
            reason = "cold" if top_holder == 0 else "prefix_spill"
        m_blocks = matches.get(backend, 0)
        scores = (
            costs if len(costs) <= cfg.max_scores
            else dict(sorted(costs.items(), key=lambda kv: kv[1])[: cfg.max_scores])
        )
        return Decision(
            backend=backend,
            policy=self.name,
            reason=reason,
            matched_tokens=matched_tok[backend],
            matched_blocks=m_blocks,
            prompt_tokens=prompt,
            scores=scores,
            request_id=request.request_id,
            predicted_prefill_tokens=prompt - matched_tok[backend],
        )
