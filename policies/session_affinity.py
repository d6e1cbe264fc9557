"""``session_affinity``: a session sticks to its rendezvous-hash backend, within a load bound."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import RoutingState, least_load_decision
from kvroute.policies.decision import Decision
from kvroute.policies.hashing import bounded_load_cap
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


class SessionAffinity:
    name = "session_affinity"

    def __init__(self, config: SessionAffinityConfig | None = None) -> None:
        self.config = config or SessionAffinityConfig()

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        if not request.session_key:
            return least_load_decision(request, candidates, state, now, self.name, skipped="no_session_key")
        load = state.load
        cap = bounded_load_cap(load.total_inflight(candidates), len(candidates), self.config.epsilon,
                               self.config.min_cap)
        ordered = state.rendezvous.order(request.session_key, candidates)
        backend = next((b for b in ordered if load.inflight(b) + 1 <= cap), ordered[0])
        reason = "session" if backend == ordered[0] else "session_overflow"
        return Decision(backend, self.name, reason, prompt_tokens=request.prompt_tokens,
                        request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens,
                        scores={"load_cap": float(cap)})
