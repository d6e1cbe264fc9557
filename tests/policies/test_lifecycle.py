"""The policy contract: a ``Policy`` needs only ``name`` and ``select``; ``Router.finish`` ends an attempt in one
place (load, index, the policy's ``observe``, health), once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import kvroute.sim.lineup  # noqa: F401  (registers the simulator baselines)
from kvroute.policies import (
    Decision,
    FleetView,
    Policy,
    PrefixIndexConfig,
    RequestOutcome,
    Router,
    RouterConfig,
    RoutingRequest,
    RoutingState,
    build_policy,
    policy_names,
)

B = ["a", "b"]


class First(Policy):
    """The smallest policy there is: always the first candidate, nothing else overridden."""

    name = "first"

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        return Decision(candidates[0], self.name, "first", prompt_tokens=request.prompt_tokens,
                        request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens)


class Listening(First):
    """``First`` that writes down every outcome it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple[str | None, RequestOutcome]] = []

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        self.heard.append((request.request_id, outcome))


class Board:
    """A health sink that writes down every record."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any, float, dict[str, Any]]] = []

    def record(self, backend: str, outcome: Any, now: float, **fields: Any) -> None:
        self.records.append((backend, outcome, now, fields))


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def req(rid: str, blocks: int = 8) -> RoutingRequest:
    return RoutingRequest("m", list(range(100, 100 + blocks)), 64, 64 * blocks, request_id=rid)


def router(health: Board | None = None) -> Router:
    return Router(RouterConfig(index=PrefixIndexConfig(block_tokens=64)), clock=Clock(), health=health)


def held(r: Router, request: RoutingRequest, backend: str) -> int:
    return r.index.match(request.keys, [backend], 0.0).get(backend, 0)


def test_the_hooks_default_to_nothing() -> None:
    policy = First()
    policy.bind(FleetView())
    policy.observe(req("x"), RequestOutcome("success", "a", 0.0))
    assert policy.snapshot(0.0) == {} and policy.event_delay_s is None
    with pytest.raises(NotImplementedError):
        Policy().select(req("x"), B, router().state, 0.0)


def test_every_registered_policy_is_a_policy() -> None:
    for name in policy_names():
        assert isinstance(build_policy(name), Policy), name


def test_a_minimal_policy_lives_through_the_router_with_no_other_hook() -> None:
    r = router(Board())
    policy = First()
    r.set_policy_object("m", policy)
    for i, kind in enumerate(("success", "failure", "cancelled")):
        request = req(f"r{i}")
        d = r.pick(request, B)
        assert d.backend == "a" and d.reason == "first" and r.load.inflight("a") == 1
        r.finish(request, RequestOutcome(kind, "a", 1.0, cached_tokens=0, health=kind))
        assert r.load.inflight("a") == 0
    assert r.errors == 0


def test_finish_on_success_releases_load_keeps_the_blocks_and_tells_policy_and_health_once() -> None:
    board, policy = Board(), Listening()
    r = router(board)
    request = req("r1")
    r.pick(request, B, policy=policy)
    assert held(r, request, "a") == 8 and r.load.inflight("a") == 1
    outcome = RequestOutcome("success", "a", 2.0, cached_tokens=0, ttft_s=0.5, health="success", started_at=1.0)
    r.finish(request, outcome, policy=policy)
    assert r.load.inflight("a") == 0 and r.pending_backend("r1") is None
    assert held(r, request, "a") == 8
    assert policy.heard == [("r1", outcome)]
    assert board.records == [("a", "success", 2.0, {"retry_after_s": None, "ttft_s": 0.5, "started_at": 1.0})]


def test_finish_on_a_failure_before_prefill_takes_the_blocks_back_out() -> None:
    board, policy = Board(), Listening()
    r = router(board)
    request = req("r1")
    r.pick(request, B, policy=policy)
    outcome = RequestOutcome("failure", "a", 3.0, health="capacity", retry_after_s=2.0)
    r.finish(request, outcome, policy=policy)
    assert r.load.inflight("a") == 0 and held(r, request, "a") == 0
    assert [o.kind for _, o in policy.heard] == ["failure"]
    assert board.records == [("a", "capacity", 3.0, {"retry_after_s": 2.0, "ttft_s": None, "started_at": None})]


def test_finish_without_a_health_word_or_backend_leaves_health_alone_and_uses_the_groups_policy() -> None:
    board, policy = Board(), Listening()
    r = router(board)
    r.set_policy_object("m", policy)
    request = req("r1")
    r.pick(request, B)
    r.finish(request, RequestOutcome("cancelled", "a", 1.0))
    r.finish(req("never-picked"), RequestOutcome("failure", None, 1.0, health="provider_failure"))
    assert board.records == [] and [o.kind for _, o in policy.heard] == ["cancelled", "failure"]
    assert r.load.inflight("a") == 0 and r.errors == 0


def test_bind_shares_one_group_state_between_the_policies_of_one_router() -> None:
    r = router()
    group, rule = build_policy("hybrid"), build_policy("hybrid")
    r.bind(group, FleetView())
    r.bind(rule, FleetView())
    assert rule.guard is group.guard and rule.market is group.market
    other = build_policy("hybrid")
    router().bind(other, FleetView())
    assert other.guard is not group.guard
