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
from kvroute.sim.engine import FleetConfig, max_request_tokens, successors_of
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
    bt = workload.block_tokens
    capacity = fleet.capacity_tokens
    names = _names(fleet.replicas)
    replicas = [Replica(n, fleet.preset.cost, capacity // bt, bt) for n in names]
    loop = ReplicaLoop(replicas, fleet.metrics_interval_s)
    health = health if health is not None else HealthBoard()
    router = Router(RouterConfig(index=PrefixIndexConfig(capacity_tokens=capacity, block_tokens=float(bt))),
                    clock=lambda: loop.now, health=health)
    by_replica = {r.name: i for i, r in enumerate(replicas)}
    routes = {s.name: HostedBackend(s, bt, seed) for s in hosted}
    known = set(by_replica) | set(routes)
    for tier in strategy.tiers:
        for b in tier.backends:
            if b not in known:
                raise ValueError(f"strategy {strategy.name}: unknown backend {b!r}")
    view = FleetView(health=health, replicas=dict(zip(names, replicas, strict=True)), preset=fleet.preset)
    for tier in strategy.tiers:
        tier.policy.bind(view)
    all_backends = [b for tier in strategy.tiers for b in tier.backends]
    reqs = workload.requests
    tracks: list[Track] = []
    requests: list[RoutingRequest | None] = [None] * len(reqs)
    tracks.extend(Track(i, spec.arrival, spec.prompt_tokens, max(1, spec.output_tokens))
                  for i, spec in enumerate(reqs))
    successors = successors_of(workload, loop, _ARRIVE)
    max_tokens = max_request_tokens(replicas[0], fleet.preset.max_model_len)
    reasons: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    pending_attempt: dict[int, tuple[str, object]] = {}
    schedule = loop.schedule

    def finish(tr: Track, at: float) -> None:
        for j in successors.pop(tr.idx, ()):
            tracks[j].arrival = at + reqs[j].delay
            schedule(tracks[j].arrival, _ARRIVE, j)

    def succeeded(tr: Track, backend: str, at: float) -> None:
        """The attempt answered: one ``finish`` for load, index, the tier's policy and the breaker."""
        request = requests[tr.idx]
        assert request is not None
        router.finish(request, RequestOutcome(SUCCESS, backend, at, cached_tokens=tr.cached_tokens,
                                              ttft_s=tr.attempt_ttft, output_tokens=tr.output,
                                              duration_s=tr.done_at - tr.sent_at, prompt_tokens=tr.prompt,
                                              health=Outcome.SUCCESS), policy=strategy.tiers[tr.tier].policy)

    def failed(tr: Track, backend: str, at: float, health_word: str, retry_after: float | None) -> None:
        request = requests[tr.idx]
        assert request is not None
        router.finish(request, RequestOutcome(FAILURE, backend, at, health=health_word, retry_after_s=retry_after),
                      policy=strategy.tiers[tr.tier].policy)

    def fail_attempt(tr: Track, backend: str, at: float, kind: str, retry_after: float | None) -> None:
        failed(tr, backend, at, Outcome.CAPACITY if kind != "error" else Outcome.PROVIDER_FAILURE, retry_after)
        failures[f"{backend}:{kind}"] += 1
        tr.failures += 1
        tr.tried.add(backend)
        if retry_after is not None:
            tr.retry_after = retry_after if tr.retry_after is None else min(tr.retry_after, retry_after)
        route(tr, at)

    def route(tr: Track, at: float) -> None:
        """Pick a backend for the request's next attempt and send it there (or give up)."""
        request = requests[tr.idx]
        assert request is not None
        rid = request.request_id or ""
        while True:
            if tr.attempts >= strategy.max_attempts:
                failures["gave_up"] += 1
                tr.done_at = at
                finish(tr, at)
                return
            backend = None
            while tr.tier < len(strategy.tiers):
                tier = strategy.tiers[tr.tier]
                cands = health.filter([b for b in tier.backends if b not in tr.tried], at)
                if cands:
                    decision = router.pick(request, cands, policy=tier.policy)
                    reasons[f"{tier.policy.name}:{decision.reason}"] += 1
                    if decision.backend is not None:
                        backend = decision.backend
                        break
                tr.tier += 1
            if backend is None:  # every tier tried: wait for the soonest Retry-After, then start over
                if tr.retry_after is None:  # nothing answered 429 but breakers are open (LiteLLM's 429 "no
                    tripped = [b for b in all_backends if not health.available(b, at)]  # deployments": Retry-After =
                    _, wait = health.soonest(tripped, at)  # the soonest cooldown of an open breaker)
                    tr.retry_after = wait if 0 < wait < math.inf else None
                if tr.retry_after is None:
                    failures["no_backend"] += 1
                    tr.done_at = at
                    finish(tr, at)
                    return
                wait, tr.retry_after = tr.retry_after, None
                tr.tried.clear()
                tr.tier = 0
                schedule(at + wait, _ARRIVE, tr.idx, 1)
                return
            tr.attempts += 1
            tr.sent_at = at
            if backend in routes:
                att = routes[backend].attempt(at, tr.prompt, tr.output, request.keys)
                if att.kind != "ok":
                    pending_attempt[tr.idx] = (backend, att)
                    schedule(att.answered_at, _FAILED, tr.idx)
                    return
                tr.backend, tr.hosted = backend, True
                tr.first_token_at, tr.done_at = att.first_token_at, att.done_at
                tr.cached_tokens, tr.cost = att.cached_tokens, att.cost
                schedule(att.first_token_at, _HOSTED_FIRST, tr.idx)
                schedule(att.done_at, _HOSTED_DONE, tr.idx)
                return
            ri = by_replica[backend]
            rep = replicas[ri]
            if strategy.queue_limit is not None and len(rep.waiting) >= strategy.queue_limit:
                failed(tr, backend, at, Outcome.CAPACITY, 1.0)
                failures[f"{backend}:queue_full"] += 1
                tr.failures += 1
                tr.tried.add(backend)
                tr.retry_after = 1.0 if tr.retry_after is None else min(tr.retry_after, 1.0)
                continue
            live = Live(tr.idx, rid, tr.prompt, tr.output, request.keys, tr.arrival)
            tr.live, tr.backend, tr.hosted = live, backend, False
            loop.admit(ri, live, at)
            return

    def on_event(kind: int, x: int, ver: int, now: float) -> None:
        if kind == _ARRIVE:
            tr = tracks[x]
            spec = reqs[x]
            if ver == 0:
                loop.scrape(router, now)
                if spec.prompt_tokens + spec.output_tokens > max_tokens:
                    failures["too_long"] += 1
                    tr.done_at = now
                    finish(tr, now)
                    return
                tags = {} if spec.cache_prefix_blocks is None else {
                    "cache_prefix_blocks": str(spec.cache_prefix_blocks)}
                requests[x] = RoutingRequest(model="sim", keys=spec.keys, block_tokens=bt,
                                             prompt_tokens=spec.prompt_tokens, session_key=spec.session,
                                             app=spec.app, request_id=f"r{x}", tags=tags, kind="completion",
                                             key_space="tokens")
            route(tr, now)
        elif kind == _FAILED:
            backend, att = pending_attempt.pop(x)
            fail_attempt(tracks[x], backend, now, att.kind, att.retry_after_s)  # type: ignore[attr-defined]
        elif kind == _HOSTED_FIRST:
            router.on_first_token(f"r{x}")
        else:  # _HOSTED_DONE
            tr = tracks[x]
            assert tr.backend is not None
            succeeded(tr, tr.backend, now)
            finish(tr, now)

    def on_step(rep: Replica, first: list[Live], done: list[Live], now: float) -> None:
        for r in first:
            router.on_first_token(r.rid)
            tracks[r.idx].first_token_at = now
        for r in done:
            tr = tracks[r.idx]
            tr.done_at = now
            tr.cached_tokens = max(0, r.hit_tokens)
            tr.cost = token_cost(replica_rate, input_uncached=r.prompt - tr.cached_tokens,
                                 cache_read=tr.cached_tokens, output=r.output)
            succeeded(tr, rep.name, now)
            finish(tr, now)

    now = loop.run(on_event, on_step)
    return MixedResult(strategy.name, workload.name, tracks, fleet.replicas, now, reasons, failures,
                       [r.busy_time for r in replicas], list(workload.notes))
