"""Both simulators drive a policy through the same contract as the plugin: a ``Policy`` with only ``select``
runs, and every routed request ends in exactly one ``observe`` (through ``Router.finish``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies import Decision, Policy, RequestOutcome, RoutingRequest, RoutingState
from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.mixed_fleet import Strategy, Tier, replica_names, simulate_mixed
from kvroute.sim.presets import get_preset
from kvroute.sim.spend import replica_rate_card
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

BT = 64
QWEN = get_preset("qwen3-32b-h100-tp2")


class Turns(Policy):
    """Round robin in a dozen lines: ``name`` and ``select`` only."""

    name = "turns"

    def __init__(self) -> None:
        self.n = 0

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        self.n += 1
        return Decision(candidates[self.n % len(candidates)], self.name, "turn", prompt_tokens=request.prompt_tokens,
                        request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens)


class Counting(Turns):
    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple[str | None, RequestOutcome]] = []

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        self.heard.append((request.request_id, outcome))


def burst(n: int) -> Workload:
    kb = SegmentKeys(BT)
    return Workload("burst", BT, [SimRequest(20 * BT, 20, kb.keys([(i % 3 + 1, 20 * BT)]), i * 0.05)
                                  for i in range(n)])


def test_a_select_only_policy_runs_in_the_simulator() -> None:
    result = simulate(burst(30), Turns(), FleetConfig(3, QWEN))
    assert result.policy == "turns" and result.router_errors == 0 and result.reasons["turn"] == 30
    assert all(r.done_at < float("inf") for r in result.requests)


def test_the_simulator_ends_every_routed_request_in_one_observe() -> None:
    policy = Counting()
    simulate(burst(30), policy, FleetConfig(3, QWEN))
    assert sorted(rid for rid, _ in policy.heard) == sorted(f"r{i}" for i in range(30))
    assert all(o.ok and o.backend is not None and o.cached_tokens is not None for _, o in policy.heard)


def test_the_mixed_simulator_ends_every_attempt_in_one_observe() -> None:
    fleet = FleetConfig(2, QWEN)
    policy = Counting()
    strategy = Strategy("turns", (Tier(tuple(replica_names(fleet)), policy),))
    result = simulate_mixed(burst(20), strategy, fleet, [], replica_rate_card(QWEN).cost_rate("self"))
    assert sorted(rid for rid, _ in policy.heard) == sorted(f"r{i}" for i in range(20))
    assert all(o.ok and o.health == "success" for _, o in policy.heard)
    assert all(t.done_at < float("inf") for t in result.tracks)
