"""``least_load``: fewest in-flight requests, ties to the least recently used backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import Policy, RoutingState, least_load_decision
from kvroute.policies.decision import Decision
from kvroute.policies.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class LeastLoadConfig:
    """No knobs: in-flight count, then queued prefill tokens, then least recently picked."""


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self, config: LeastLoadConfig | None = None) -> None:
        self.config = config or LeastLoadConfig()

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        return least_load_decision(request, candidates, state, now, self.name)
