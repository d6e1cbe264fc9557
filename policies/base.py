"""The policy contract and the shared state every policy reads.

A policy is small: ``select`` looks at one request and the candidate backends and returns a
``Decision``; ``on_complete`` lets it learn. State (index, load, clock) is owned by the ``Router``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvroute.policies.decision import Decision
from kvroute.policies.hashing import Rendezvous
from kvroute.policies.load import LoadTracker
from kvroute.policies.prefix_index import PrefixLocator
from kvroute.policies.request import RoutingRequest


@dataclass(slots=True)
class RoutingState:
    """Shared, mutable routing state handed to policies (one per Router)."""

    index: PrefixLocator
    load: LoadTracker
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    rng: random.Random = field(default_factory=lambda: random.Random(0))


class Policy(Protocol):
    """Picks one backend among ``candidates`` (non-empty, healthy) for ``request`` at time ``now``."""

    name: str

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision: ...


def least_loaded(candidates: Sequence[str], state: RoutingState, now: float) -> str:
    """Fewest in-flight requests, then least queued prefill, then least recently picked, then name."""
    load = state.load
    best = None
    best_key: tuple[float, float, float, str] | None = None
    for b in candidates:
        v = load.view(b, now)
        key = (float(max(v.inflight, v.running)), v.queue_tokens, v.last_pick, b)
        if best_key is None or key < best_key:
            best, best_key = b, key
    assert best is not None
    return best


def least_load_decision(
    request: RoutingRequest,
    candidates: Sequence[str],
    state: RoutingState,
    now: float,
    policy: str,
    reason: str = "least_load",
    skipped: str | None = None,
) -> Decision:
    backend = least_loaded(candidates, state, now)
    return Decision(
        backend=backend,
        policy=policy,
        reason=reason,
        prompt_tokens=request.prompt_tokens,
        skipped=skipped,
        request_id=request.request_id,
        predicted_prefill_tokens=request.prompt_tokens,
    )
