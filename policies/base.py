"""The policy contract and the shared state every policy reads.

A policy is small: ``select`` looks at one request and the candidate backends and returns a ``Decision``;
``bind`` hands it the fleet, ``observe`` how each attempt ended, ``snapshot`` shows its state. Every hook but
``select`` defaults to doing nothing. State (index, load, clock) is owned by the ``Router``, which calls
``observe`` from ``Router.finish`` after updating load and index.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.policies.decision import Decision
from kvroute.policies.hashing import Rendezvous
from kvroute.policies.lifecycle import FleetView, RequestOutcome
from kvroute.policies.load import LoadTracker
from kvroute.policies.prefix_index import PrefixLocator
from kvroute.policies.request import RoutingRequest
from kvroute.policies.sessions import LiveSessions, SessionHomes


@dataclass(slots=True)
class RoutingState:
    """Shared, mutable routing state handed to policies (one per Router)."""

    index: PrefixLocator
    load: LoadTracker
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    #: where each session's last answer was left (``Router.finish`` fills it)
    homes: SessionHomes = field(default_factory=SessionHomes)
    #: which backend holds each session's context and how big sessions grow (``Router`` fills it)
    live: LiveSessions = field(default_factory=LiveSessions)
    #: ``computed(backend, keys, matched)``: of the ``matched`` leading blocks, how many are already computed (not
    #: still being prefilled by a request in flight there); None: every matched block counts as computed
    computed: Callable[[str, Sequence[int], int], int] | None = None


class Policy:
    """Base of every policy: subclass it, set ``name``, implement ``select``; override a hook only to use it."""

    name: str = "policy"
    #: simulator only: KV events reach this policy's router that many seconds late (None: approximate index)
    event_delay_s: float | None = None

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        """Pick one backend among ``candidates`` (non-empty, healthy) for ``request`` at time ``now``."""
        raise NotImplementedError

    def bind(self, fleet: FleetView) -> None:
        """Learn the fleet (breakers, rate cards, hosted routes, simulated engines); may be called again."""

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        """Learn how one routed attempt of ``request`` ended (after the router has updated load and index)."""

    def snapshot(self, now: float) -> dict[str, Any]:
        """State worth showing on a status page ({}: nothing to show)."""
        return {}


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
