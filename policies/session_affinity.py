"""``session_affinity``: a session sticks to its rendezvous-hash backend, within a load bound."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import Policy, RoutingState, least_load_decision
from kvroute.policies.decision import Decision
from kvroute.policies.filters import sticky_within_bound
from kvroute.policies.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class SessionAffinityConfig:
    """``epsilon``: a backend may hold (1+ε)× the mean in-flight load (never capped below ``min_cap``)."""

    epsilon: float = 0.5
    min_cap: int = 4

    def __post_init__(self) -> None:
        if self.epsilon < 0:
            raise ValueError("epsilon must be >= 0")
        if self.min_cap < 1:
            raise ValueError("min_cap must be >= 1")


class SessionAffinity(Policy):
    name = "session_affinity"

    def __init__(self, config: SessionAffinityConfig | None = None) -> None:
        self.config = config or SessionAffinityConfig()

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        if not request.session_key:
            return least_load_decision(request, candidates, state, now, self.name, skipped="no_session_key")
        order = state.rendezvous.order(request.session_key, candidates)
        backend, home, cap = sticky_within_bound(order, state.load, self.config.epsilon, self.config.min_cap)
        reason = "session" if home else "session_overflow"
        return Decision(backend, self.name, reason, prompt_tokens=request.prompt_tokens,
                        request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens,
                        scores={"load_cap": float(cap)})
