"""``prefix_hash``: rendezvous hashing of the stable prompt start, within a load bound (CHWBL-style)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import Policy, RoutingState, least_load_decision
from kvroute.policies.decision import Decision
from kvroute.policies.filters import sticky_within_bound
from kvroute.policies.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class PrefixHashConfig:
    """Hash the first ``prefix_tokens`` tokens; prompts shorter than ``min_prefix_tokens`` go by load."""

    prefix_tokens: int = 256
    min_prefix_tokens: int = 256
    epsilon: float = 0.25
    min_cap: int = 4

    def __post_init__(self) -> None:
        if self.prefix_tokens < 1:
            raise ValueError("prefix_tokens must be >= 1")
        if self.epsilon < 0:
            raise ValueError("epsilon must be >= 0")


class PrefixHash(Policy):
    name = "prefix_hash"

    def __init__(self, config: PrefixHashConfig | None = None) -> None:
        self.config = config or PrefixHashConfig()

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        key = request.prefix_key(self.config.prefix_tokens)
        if key is None or request.routable_tokens < self.config.min_prefix_tokens:
            return least_load_decision(request, candidates, state, now, self.name, skipped="short_prompt")
        order = state.rendezvous.order(key, candidates)
        backend, home, cap = sticky_within_bound(order, state.load, self.config.epsilon, self.config.min_cap)
        reason = "prefix_hash" if home else "prefix_hash_overflow"
        return Decision(backend, self.name, reason, prompt_tokens=request.prompt_tokens,
                        request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens,
                        scores={"load_cap": float(cap)})
