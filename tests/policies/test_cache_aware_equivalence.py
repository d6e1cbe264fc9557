"""The fast ``CacheAware.select`` picks exactly what the old one-Candidate-per-backend picker picks.

Every pick of a simulated run is made by both pickers on the same state at the same instant (the old one,
``reference_cache_aware.py``, is e9da8e7's code verbatim); the backend, reason, match and every prediction
must be equal, and so must the scores (fleets over ``max_scored`` may report fewer: backends that provably
could not win go unscored).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from reference_cache_aware import ReferenceCacheAware

from kvroute.policies import ExternalSignal, Router, RoutingRequest
from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.cache_aware import CacheAware, CacheAwareConfig
from kvroute.policies.decision import Decision
from kvroute.sim.engine import FleetConfig, simulate
from kvroute.sim.presets import get_preset
from kvroute.sim.workloads import GENERATORS

FIELDS = ("backend", "reason", "matched_tokens", "matched_blocks", "prompt_tokens", "predicted_prefill_tokens",
          "work_s", "predicted_ttft_s", "fixed_wait_s", "skipped", "wasted_prefill_tokens")


@dataclass
class Dual(Policy):
    """A policy that asks both pickers and fails on the first disagreement."""

    config: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    picks: int = 0
    name: str = "cache_aware"

    def __post_init__(self) -> None:
        self.new = CacheAware(self.config)
        self.old = ReferenceCacheAware(self.config)

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        old = self.old.select(request, candidates, state, now)
        new = self.new.select(request, candidates, state, now)
        for name in FIELDS:
            a, b = getattr(old, name), getattr(new, name)
            assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (
                f"pick {self.picks}: {name} {a!r} != {b!r}")
        if len(candidates) <= self.config.max_scored:
            assert new.scores == old.scores, self.picks
        for b, cost in new.scores.items():
            if b in old.scores:
                assert cost == old.scores[b], (self.picks, b)
        assert set(old.scores) - set(new.scores) <= set(candidates)
        self.picks += 1
        return new


WORKLOADS = [
    ("chat", {"users": 60, "turns": 6}),
    ("agent", {"tasks": 40, "steps": 8}),
    ("rag", {"requests": 600, "docs": 300}),
    ("gsp", {"groups": 16, "prompts_per_group": 8}),
]


@pytest.mark.parametrize(("workload", "params"), WORKLOADS, ids=[w for w, _ in WORKLOADS])
@pytest.mark.parametrize("replicas", [8, 16])
def test_simulated_runs_pick_identically(workload: str, params: dict, replicas: int) -> None:
    preset = get_preset("qwen3-32b-h100-tp2")
    wl = GENERATORS[workload](preset.block_tokens, **params)
    dual = Dual()
    simulate(wl, dual, FleetConfig(replicas, preset))
    assert dual.picks >= min(200, len(wl.requests) // 2)


@pytest.mark.parametrize("seed", range(6))
def test_random_fleets_with_signals_and_load_pick_identically(seed: int) -> None:
    """Large fleets (the capped path), engine signals, work in flight, full caches, learned factors."""
    rng = random.Random(seed)
    now = [0.0]
    router = Router(clock=lambda: now[0])
    dual = Dual(CacheAwareConfig(max_scored=rng.choice([4, 8, 12])))
    backends = [f"b{i}" for i in range(rng.choice([3, 16, 40]))]
    prefixes = [[rng.getrandbits(63) for _ in range(rng.randrange(4, 80))] for _ in range(12)]
    for b in backends:  # caches that fill up: the eviction term is priced (and computed inline) there
        if rng.random() < 0.5:
            router.index.set_capacity(b, 64 * rng.randrange(20, 200))
    open_ids: list[str] = []
    for i in range(600):
        now[0] += rng.expovariate(20.0)
        if rng.random() < 0.05:
            for b in backends:
                if rng.random() < 0.7:
                    router.observe(b, ExternalSignal(at=now[0] - rng.random(), queue_depth=rng.randrange(6),
                                                     running=rng.randrange(300), kv_usage=rng.random()))
        base = rng.choice(prefixes)
        keys = base[: rng.randrange(1, len(base) + 1)] + [rng.getrandbits(63) for _ in range(rng.randrange(3))]
        session = f"s{rng.randrange(60)}" if rng.random() < 0.5 else None  # first requests weigh busy seconds
        req = RoutingRequest("m", keys, 64.0, len(keys) * 64 + rng.randrange(64), session_key=session,
                             request_id=f"r{i}")
        router.pick(req, backends, policy=dual)
        open_ids.append(req.request_id)
        while open_ids and rng.random() < 0.6:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            router.on_first_token(rid)
            if rng.random() < 0.8:
                now[0] += rng.random() * 0.01
                router.on_complete(rid, cached_tokens=rng.randrange(0, 64 * 80))
    assert dual.picks == 600


def _old_least(holders, busy_of, limit, ttft_of, cost_of):  # e9da8e7..394715d: the loop the min() calls replace
    best = least = math.inf
    for b in holders:
        if limit is None or busy_of[b] <= limit:
            best = cost_of[b] if cost_of[b] < best else best
            least = ttft_of[b] if ttft_of[b] < least else least
    return best, least


@pytest.mark.parametrize("costs", [(0.2, 0.1, 0.3), (math.nan, 0.1, 0.3), (0.2, math.nan, 0.05), (math.nan,) * 3,
                                   (math.inf, math.inf, math.inf), (0.2, math.inf, math.nan)])
@pytest.mark.parametrize("limit", [None, 1.5, 0.5, -1.0])
def test_cold_cannot_win_reads_the_least_holder_as_the_loop_did(costs: tuple[float, ...], limit: float | None) -> None:
    from kvroute.policies.cache_aware import CacheAware

    policy = CacheAware()
    holders = ["a", "b", "c"]
    busy_of = {"a": 0.0, "b": 1.0, "c": 2.0}
    cost_of = dict(zip(holders, costs, strict=True))
    ttft_of = {b: v / 2 for b, v in cost_of.items()}
    got = policy._cold_cannot_win(holders, busy_of, limit, ttft_of, cost_of, 8000, 1.0, 7936, 0.01, {})
    best, least = _old_least(holders, busy_of, limit, ttft_of, cost_of)
    if best == math.inf:
        assert got is False
    else:  # the same comparison the method ends with, on the loop's figures
        cold = CacheAware()
        c_ttft = sum(w * f(_idle_candidate(cold), cold.speed) for f, w in cold.scorers)
        c_cost = c_ttft + sum(w * f(_idle_candidate(cold), cold.speed) for f, w in cold.fleet_scorers)
        want = c_ttft >= least and c_cost > best + max(cold.config.tie_s, cold.config.tie_fraction * best)
        assert got is want


def _idle_candidate(policy):
    from kvroute.policies.cache_aware import _IDLE
    from kvroute.policies.scorers import Candidate

    return Candidate("", 8000, 0, _IDLE, 1.0, 0.0, 0, 0.0, 0.0, 0.0, 7936, policy.speed.prefill_s(8000, 0), 0.01)


def test_remembered_rendezvous_first_equals_a_fresh_order() -> None:
    from kvroute.policies import cache_aware
    from kvroute.policies.hashing import Rendezvous

    class Reversed(Rendezvous):  # a subclass is always asked (its order may not be a pure function)
        def order(self, key: int | str, backends: Sequence[str]) -> list[str]:
            return super().order(key, backends)[::-1]

    policy = CacheAware()
    rng = random.Random(5)
    names = [f"replica-{i}" for i in range(12)]
    stock, other = Rendezvous(), Reversed()
    for i in range(3 * cache_aware._MEMO_MAX):  # past the bound: the memo is cleared and refilled
        key = rng.randrange(40) if i % 3 else rng.getrandbits(64)
        holders = rng.sample(names, rng.randrange(2, 6))
        assert policy._first_in_order(stock, key, holders) == Rendezvous().order(key, holders)[0]
        assert policy._first_in_order(other, key, holders) == Reversed().order(key, holders)[0]
    assert 0 < len(policy._first_memo) <= cache_aware._MEMO_MAX + 1
