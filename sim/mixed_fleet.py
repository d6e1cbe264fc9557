"""Replay a workload on self-hosted replicas *and* hosted routes under one routing strategy.

A ``Strategy`` is an ordered list of tiers, each a set of backends and the real policy object that picks among
them, through one ``Router`` (as LiteLLM's model groups with ``fallbacks`` do). A failed attempt — a replica
answering 429 because ``queue_limit`` requests already wait there (an admission cap), a hosted 429 or 5xx —
goes back to the router (``finish``: load, index, the tier's policy, the health board) and the request is
retried on an untried backend of the same tier, then on the next tier; when every backend was tried (or every
breaker is open) it waits for the shortest Retry-After it was given (or the soonest breaker cooldown) and
starts over, up to ``max_attempts``; then it fails (TTFT = ∞).

Replicas are ``sim.replica.Replica`` (queueing, chunked prefill, decode, prefix cache), stepped by the same
``sim.event_loop.ReplicaLoop`` as in ``sim.engine.simulate``; hosted routes are ``sim.hosted.HostedBackend``.
Each request's cost comes from ``billing.pricing.token_cost`` on the backend's rate card (replicas: the
GPU-hour card). Every attempt ends in ``Router.finish``, as in the plugin, so policies that learn from outcomes
(hybrid, marketplace) hear them through ``observe``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal

from kvroute.billing.pricing import CostRate, token_cost
from kvroute.policies import (
    FleetView,
    HealthBoard,
    Outcome,
    Policy,
    PrefixIndexConfig,
    RequestOutcome,
    Router,
    RouterConfig,
    RoutingRequest,
)
from kvroute.policies.lifecycle import FAILURE, SUCCESS
from kvroute.sim.engine import FleetConfig, max_request_tokens, routing_request, successors_of
from kvroute.sim.event_loop import CALLER_KINDS, ReplicaLoop
from kvroute.sim.hosted import HostedBackend, HostedSpec
from kvroute.sim.replica import Live, Replica
from kvroute.sim.workload import Workload

_ARRIVE, _HOSTED_FIRST, _HOSTED_DONE, _FAILED = range(CALLER_KINDS, CALLER_KINDS + 4)


@dataclass(frozen=True, slots=True)
class Tier:
    """Backends tried together (one LiteLLM model group) and the policy that picks among them."""

    backends: tuple[str, ...]
    policy: Policy


@dataclass(slots=True)
class Strategy:
    """A named routing strategy: tiers in fallback order, the replicas' admission cap, retries."""

    name: str
    tiers: tuple[Tier, ...]
    queue_limit: int | None = None
    max_attempts: int = 4


@dataclass(slots=True)
class Track:
    """One request's path: attempts, where it was served, when, what it cost."""

    idx: int
    arrival: float
    prompt: int
    output: int
    backend: str | None = None
    hosted: bool = False
    first_token_at: float = math.inf
    done_at: float = math.inf
    cached_tokens: int = 0
    cost: Decimal = Decimal(0)
    sent_at: float = math.nan
    attempts: int = 0
    failures: int = 0
    tier: int = 0
    tried: set[str] = field(default_factory=set)
    retry_after: float | None = None
    live: Live | None = None

    @property
    def ttft(self) -> float:
        """From the client's first send to the first token (retries and waits included)."""
        return self.first_token_at - self.arrival

    @property
    def attempt_ttft(self) -> float:
        """The serving attempt's own TTFT (what a router observes of that backend)."""
        return self.first_token_at - self.sent_at


@dataclass(slots=True)
class MixedResult:
    """Everything one run measured (per request), plus counters."""

    strategy: str
    workload: str
    tracks: list[Track]
    replicas: int
    sim_end: float
    reasons: Counter[str]
    failures: Counter[str]
    replica_busy: list[float]
    notes: list[str] = field(default_factory=list)


def _names(n: int) -> list[str]:
    width = len(str(n - 1))
    return [f"replica-{i:0{width}d}" for i in range(n)]


def replica_names(fleet: FleetConfig) -> list[str]:
    return _names(fleet.replicas)


def simulate_mixed(workload: Workload, strategy: Strategy, fleet: FleetConfig, hosted: Sequence[HostedSpec],
                   replica_rate: CostRate, *, seed: int = 0, health: HealthBoard | None = None) -> MixedResult:
    """Replay ``workload`` under ``strategy`` on ``fleet`` plus the ``hosted`` routes (see the module doc)."""
    return MixedRun(workload, strategy, fleet, hosted, replica_rate, seed=seed, health=health).run()


class MixedRun:
    """One ``simulate_mixed`` run: the fleet, the router and every request's ``Track``, stepped by events."""

    def __init__(self, workload: Workload, strategy: Strategy, fleet: FleetConfig, hosted: Sequence[HostedSpec],
                 replica_rate: CostRate, *, seed: int = 0, health: HealthBoard | None = None) -> None:
        bt = workload.block_tokens
        capacity = fleet.capacity_tokens
        names = _names(fleet.replicas)
        self.workload, self.strategy, self.fleet, self.replica_rate = workload, strategy, fleet, replica_rate
        self.replicas = [Replica(n, fleet.preset.cost, capacity // bt, bt) for n in names]
        self.loop = ReplicaLoop(self.replicas, fleet.metrics_interval_s)
        self.health = health if health is not None else HealthBoard()
        self.router = Router(RouterConfig(index=PrefixIndexConfig(capacity_tokens=capacity, block_tokens=float(bt))),
                             clock=lambda: self.loop.now, health=self.health)
        self.by_replica = {r.name: i for i, r in enumerate(self.replicas)}
        self.routes = {s.name: HostedBackend(s, bt, seed) for s in hosted}
        known = set(self.by_replica) | set(self.routes)
        for tier in strategy.tiers:
            for b in tier.backends:
                if b not in known:
                    raise ValueError(f"strategy {strategy.name}: unknown backend {b!r}")
        view = FleetView(health=self.health, replicas=dict(zip(names, self.replicas, strict=True)),
                         preset=fleet.preset)
        for tier in strategy.tiers:
            tier.policy.bind(view)
        self.all_backends = [b for tier in strategy.tiers for b in tier.backends]
        self.reqs = workload.requests
        self.tracks = [Track(i, spec.arrival, spec.prompt_tokens, max(1, spec.output_tokens))
                       for i, spec in enumerate(self.reqs)]
        self.requests: list[RoutingRequest | None] = [None] * len(self.reqs)
        self.successors = successors_of(workload, self.loop, _ARRIVE)
        self.max_tokens = max_request_tokens(self.replicas[0], fleet.preset.max_model_len)
        self.reasons: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.pending_attempt: dict[int, tuple[str, object]] = {}
        self.schedule = self.loop.schedule

    def run(self) -> MixedResult:
        """Run every event; what each request went through, and the counters."""
        now = self.loop.run(self.on_event, self.on_step)
        return MixedResult(self.strategy.name, self.workload.name, self.tracks, self.fleet.replicas, now,
                           self.reasons, self.failures, [r.busy_time for r in self.replicas],
                           list(self.workload.notes))

    def finish(self, tr: Track, at: float) -> None:
        """The request is over: the requests that follow it arrive."""
        for j in self.successors.pop(tr.idx, ()):
            self.tracks[j].arrival = at + self.reqs[j].delay
            self.schedule(self.tracks[j].arrival, _ARRIVE, j)

    def succeeded(self, tr: Track, backend: str, at: float) -> None:
        """The attempt answered: one ``finish`` for load, index, the tier's policy and the breaker."""
        request = self.requests[tr.idx]
        assert request is not None
        self.router.finish(request, RequestOutcome(SUCCESS, backend, at, cached_tokens=tr.cached_tokens,
                                                   ttft_s=tr.attempt_ttft, output_tokens=tr.output,
                                                   duration_s=tr.done_at - tr.sent_at, prompt_tokens=tr.prompt,
                                                   health=Outcome.SUCCESS),
                           policy=self.strategy.tiers[tr.tier].policy)

    def failed(self, tr: Track, backend: str, at: float, health_word: str, retry_after: float | None) -> None:
        request = self.requests[tr.idx]
        assert request is not None
        self.router.finish(request, RequestOutcome(FAILURE, backend, at, health=health_word,
                                                   retry_after_s=retry_after),
                           policy=self.strategy.tiers[tr.tier].policy)

    def fail_attempt(self, tr: Track, backend: str, at: float, kind: str, retry_after: float | None) -> None:
        """A hosted attempt failed (``kind``: rate limited or an error): count it, then route the next one."""
        self.failed(tr, backend, at, Outcome.CAPACITY if kind != "error" else Outcome.PROVIDER_FAILURE, retry_after)
        self.failures[f"{backend}:{kind}"] += 1
        tr.failures += 1
        tr.tried.add(backend)
        if retry_after is not None:
            tr.retry_after = retry_after if tr.retry_after is None else min(tr.retry_after, retry_after)
        self.route(tr, at)

    def pick(self, tr: Track, request: RoutingRequest, at: float) -> str | None:
        """The backend of the request's next attempt: an untried, available one of its tier, else of the tiers
        after it (None: every tier tried)."""
        strategy = self.strategy
        while tr.tier < len(strategy.tiers):
            tier = strategy.tiers[tr.tier]
            cands = self.health.filter([b for b in tier.backends if b not in tr.tried], at)
            if cands:
                decision = self.router.pick(request, cands, policy=tier.policy)
                self.reasons[f"{tier.policy.name}:{decision.reason}"] += 1
                if decision.backend is not None:
                    return decision.backend
            tr.tier += 1
        return None

    def start_over(self, tr: Track, at: float) -> None:
        """Every tier tried: wait for the soonest Retry-After, then start over (or give up without one)."""
        health = self.health
        if tr.retry_after is None:  # nothing answered 429 but breakers are open (LiteLLM's 429 "no
            tripped = [b for b in self.all_backends if not health.available(b, at)]  # deployments": Retry-After =
            _, wait = health.soonest(tripped, at)  # the soonest cooldown of an open breaker)
            tr.retry_after = wait if 0 < wait < math.inf else None
        if tr.retry_after is None:
            self.failures["no_backend"] += 1
            tr.done_at = at
            self.finish(tr, at)
            return
        wait, tr.retry_after = tr.retry_after, None
        tr.tried.clear()
        tr.tier = 0
        self.schedule(at + wait, _ARRIVE, tr.idx, 1)

    def send_hosted(self, tr: Track, backend: str, request: RoutingRequest, at: float) -> None:
        """Send the attempt to hosted route ``backend``: its answer, or its failure, is scheduled."""
        att = self.routes[backend].attempt(at, tr.prompt, tr.output, request.keys)
        if att.kind != "ok":
            self.pending_attempt[tr.idx] = (backend, att)
            self.schedule(att.answered_at, _FAILED, tr.idx)
            return
        tr.backend, tr.hosted = backend, True
        tr.first_token_at, tr.done_at = att.first_token_at, att.done_at
        tr.cached_tokens, tr.cost = att.cached_tokens, att.cost
        self.schedule(att.first_token_at, _HOSTED_FIRST, tr.idx)
        self.schedule(att.done_at, _HOSTED_DONE, tr.idx)

    def route(self, tr: Track, at: float) -> None:
        """Pick a backend for the request's next attempt and send it there (or give up)."""
        request = self.requests[tr.idx]
        assert request is not None
        rid = request.request_id or ""
        strategy = self.strategy
        while True:
            if tr.attempts >= strategy.max_attempts:
                self.failures["gave_up"] += 1
                tr.done_at = at
                self.finish(tr, at)
                return
            backend = self.pick(tr, request, at)
            if backend is None:
                self.start_over(tr, at)
                return
            tr.attempts += 1
            tr.sent_at = at
            if backend in self.routes:
                self.send_hosted(tr, backend, request, at)
                return
            ri = self.by_replica[backend]
            rep = self.replicas[ri]
            if strategy.queue_limit is not None and len(rep.waiting) >= strategy.queue_limit:
                self.failed(tr, backend, at, Outcome.CAPACITY, 1.0)
                self.failures[f"{backend}:queue_full"] += 1
                tr.failures += 1
                tr.tried.add(backend)
                tr.retry_after = 1.0 if tr.retry_after is None else min(tr.retry_after, 1.0)
                continue
            live = Live(tr.idx, rid, tr.prompt, tr.output, request.keys, tr.arrival)
            tr.live, tr.backend, tr.hosted = live, backend, False
            self.loop.admit(ri, live, at)
            return

    def on_event(self, kind: int, x: int, ver: int, now: float) -> None:
        """An arrival (first or after a wait), a hosted failure, first token or answer."""
        if kind == _ARRIVE:
            tr = self.tracks[x]
            spec = self.reqs[x]
            if ver == 0:
                self.loop.scrape(self.router, now)
                if spec.prompt_tokens + spec.output_tokens > self.max_tokens:
                    self.failures["too_long"] += 1
                    tr.done_at = now
                    self.finish(tr, now)
                    return
                self.requests[x] = routing_request(spec, x, self.workload.block_tokens)
            self.route(tr, now)
        elif kind == _FAILED:
            backend, att = self.pending_attempt.pop(x)
            self.fail_attempt(self.tracks[x], backend, now, att.kind, att.retry_after_s)  # type: ignore[attr-defined]
        elif kind == _HOSTED_FIRST:
            self.router.on_first_token(f"r{x}")
        else:  # _HOSTED_DONE
            tr = self.tracks[x]
            assert tr.backend is not None
            self.succeeded(tr, tr.backend, now)
            self.finish(tr, now)

    def on_step(self, rep: Replica, first: list[Live], done: list[Live], now: float) -> None:
        """A replica's step ended: first tokens, and the answers it finished (priced on the replica's card)."""
        for r in first:
            self.router.on_first_token(r.rid)
            self.tracks[r.idx].first_token_at = now
        for r in done:
            tr = self.tracks[r.idx]
            tr.done_at = now
            tr.cached_tokens = max(0, r.hit_tokens)
            tr.cost = token_cost(self.replica_rate, input_uncached=r.prompt - tr.cached_tokens,
                                 cache_read=tr.cached_tokens, output=r.output)
            self.succeeded(tr, rep.name, now)
            self.finish(tr, now)
