"""``round_robin``: cycle through the candidates in a stable order (the baseline that scatters prefixes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.decision import Decision
from kvroute.policies.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class RoundRobinConfig:
    """No knobs."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, config: RoundRobinConfig | None = None) -> None:
        self.config = config or RoundRobinConfig()
        self._counter = 0

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        ordered = sorted(candidates)
        backend = ordered[self._counter % len(ordered)]
        self._counter += 1
        return Decision(backend, self.name, "round_robin", prompt_tokens=request.prompt_tokens,
                        request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens)
