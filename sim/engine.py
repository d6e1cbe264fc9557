"""Discrete-event fleet simulation driving the real ``kvroute.policies.Router`` on a simulated clock.

Events are arrivals (routed at once through ``Router.pick``) and replica step ends. The router gets the same
lifecycle feedback as in production: ``on_first_token`` when the engine emits the first token and ``finish``
(load, index, the policy's ``observe``) with the prefix the engine really reused; the policy is bound to the
simulated engines first (``FleetView.replicas``: only the oracles read them). Engine metrics (waiting queue,
running, KV usage) are observed every ``metrics_interval_s`` like a scraper would (llm-d scrapes every 50 ms).
KV events (block stored / evicted) reach only a policy that asks for them with an ``event_delay_s``
(``kvroute_precise``; ``Policy.event_delay_s`` is None for the others): its router gets kvroute's
``PreciseIndex`` and every replica's events arrive that many seconds after the step that caused them;
approximate indexes learn only from picks and responses.

The preset's ``engine`` chooses the engine model, as a deployment's ``engine`` does: ``vllm`` (the default) runs
``sim/replica.py``'s block-cache replicas; ``llamacpp`` runs ``sim/replica_llamacpp.py``'s (slots, a host prompt cache
of whole prompts, token-granular reuse of ``SimRequest.tokens``, or of ids made from the block keys), gives
kvroute's router the prompt index (``policies/prompt_index.py``) and ``cache_aware`` the preset's slots, as the
plugin's wiring does for ``engine: llamacpp``; ``FleetConfig.cores`` puts the replicas on one host whose cores
they share.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.policies import (
    FleetView,
    Policy,
    PrefixIndexConfig,
    RequestOutcome,
    Router,
    RouterConfig,
    RoutingRequest,
    build_policy,
)
from kvroute.policies.lifecycle import FAILURE, SUCCESS
from kvroute.policies.precise_index import PreciseIndex, PreciseIndexConfig
from kvroute.policies.prompt_index import PromptIndex, PromptIndexConfig
from kvroute.sim.event_loop import CALLER_KINDS, ReplicaLoop
from kvroute.sim.presets import Preset
from kvroute.sim.prompt_cache import PromptCacheConfig
from kvroute.sim.replica import Live, Replica
from kvroute.sim.replica_llamacpp import LlamaCppReplica, SharedCores
from kvroute.sim.workload import SimRequest, Workload

_ARRIVE = CALLER_KINDS


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Fleet shape: ``replicas`` of ``preset``; ``kv_tokens`` overrides the preset's capacity; ``cores`` (None: each
    replica has its own) is the host's cores the replicas share while they compute, ``background_cores`` how many of
    them other work keeps busy (``llamacpp`` engines only)."""

    replicas: int
    preset: Preset
    kv_tokens: int | None = None
    metrics_interval_s: float | None = 0.05
    seed: int = 0
    cores: float | None = None
    background_cores: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError("kv_tokens must be >= 1")
        if self.cores is not None and self.preset.engine != "llamacpp":
            raise ValueError("cores: only llamacpp replicas share a host's cores")

    @property
    def capacity_tokens(self) -> int:
        return self.kv_tokens or self.preset.kv_tokens


@dataclass(slots=True)
class RunResult:
    """Everything measured in one run (per request and per replica), before aggregation."""

    policy: str
    workload: str
    replicas: int
    requests: list[Live]
    stages: list[int]
    replica_busy: list[float]
    replica_requests: list[int]
    queue_samples: list[int]
    reasons: Counter[str]
    dropped: int = 0
    preemptions: int = 0
    evictions: int = 0
    wall_s: float = 0.0
    sim_end: float = 0.0
    router_errors: int = 0
    notes: list[str] = field(default_factory=list)
    final_blocks: list[tuple[int, int, int]] = field(default_factory=list)  # (pinned, private, evictable)


def _backend_names(n: int) -> list[str]:
    width = len(str(n - 1))
    return [f"replica-{i:0{width}d}" for i in range(n)]


def make_policy(name: str, knobs: dict | None = None, preset: Preset | None = None) -> Policy:
    """Build ``name`` from the shared registry (importing the lineup registers the baselines), with ``engine_knobs``."""
    import kvroute.sim.lineup  # noqa: F401  (registers the baselines and anchors)

    knobs = {**engine_knobs(name, preset), **(knobs or {})}
    return build_policy(name, knobs, where=f"policies.{name}")


def engine_knobs(name: str, preset: Preset | None) -> dict:
    """The knobs the plugin adds for the deployment's engine: a llama.cpp request waits for a free slot, so
    ``cache_aware`` gets the engine's slots (``--parallel``)."""
    if preset is not None and preset.engine == "llamacpp" and name == "cache_aware":
        return {"slots": preset.cost.max_running}
    return {}


def build_replicas(fleet: FleetConfig, names: list[str], block_tokens: int) -> list[Replica | LlamaCppReplica]:
    """The fleet's replicas: the preset's engine model, ``capacity_tokens`` each (one shared host's cores for a
    llamacpp fleet with ``cores``)."""
    preset, capacity = fleet.preset, fleet.capacity_tokens
    if preset.engine != "llamacpp":
        return [Replica(n, preset.cost, capacity // block_tokens, block_tokens) for n in names]
    spec = preset.llamacpp
    if spec is None:
        raise ValueError(f"preset {preset.name}: engine llamacpp needs its llamacpp spec")
    cache = PromptCacheConfig(budget_bytes=int(capacity * spec.state_bytes_per_token),
                              state_bytes_per_token=spec.state_bytes_per_token)
    cores = None if fleet.cores is None else SharedCores(fleet.cores, fleet.background_cores)
    return [LlamaCppReplica(n, preset.cost, cache, spec.response_s, preset.max_model_len, cores, block_tokens)
            for n in names]


class EventTransit:
    """KV events on their way from the simulated engines to kvroute's precise index, ``delay_s`` after the step
    that caused them."""

    def __init__(self, index: PreciseIndex, delay_s: float) -> None:
        self.index, self.delay_s = index, delay_s
        self.pending: deque[tuple[float, str, list[tuple[bool, int]]]] = deque()

    def ship(self, rep: Replica, at: float) -> None:
        """Take the replica's events of the step that ended ``at`` (its list starts empty again)."""
        if rep.events:
            self.pending.append((at + self.delay_s, rep.name, rep.events))
            rep.events = []

    def deliver(self, at: float) -> None:
        """Apply every event due by ``at`` to the index, oldest first."""
        pending, index = self.pending, self.index
        while pending and pending[0][0] <= at:
            _, source, batch = pending.popleft()
            for stored, key in batch:
                if stored:
                    index.stored_keys(source, [key], [key])
                else:
                    index.removed(source, [key])


def routing_index(policy: Policy, fleet: FleetConfig, replicas: list[Replica | LlamaCppReplica],
                  index_config: PrefixIndexConfig) -> tuple[PreciseIndex | PromptIndex | None, EventTransit | None]:
    """The router's index for ``policy`` (None: the approximate one ``index_config`` builds) and, for a policy that
    reads KV events (``event_delay_s``), the transit that feeds them to it (every replica then records events)."""
    if policy.event_delay_s is not None:  # kvroute's precise index, fed by the simulated engines' KV events
        precise = PreciseIndex(PreciseIndexConfig(fallback=index_config))
        for rep in replicas:
            precise.attach(rep.name, rep.name)
            rep.events = []
        return precise, EventTransit(precise, policy.event_delay_s)
    if fleet.preset.engine == "llamacpp":  # llama.cpp keeps whole prompts, not blocks
        return PromptIndex(PromptIndexConfig(cache_tokens=fleet.capacity_tokens, slots=fleet.preset.cost.max_running,
                                             block_tokens=index_config.block_tokens)), None
    return None, None


def routing_request(spec: SimRequest, idx: int, block_tokens: int) -> RoutingRequest:
    """The ``RoutingRequest`` the plugin would build for workload request ``idx`` (id ``r<idx>``)."""
    tags = {} if spec.cache_prefix_blocks is None else {"cache_prefix_blocks": str(spec.cache_prefix_blocks)}
    return RoutingRequest(model="sim", keys=spec.keys, block_tokens=block_tokens, prompt_tokens=spec.prompt_tokens,
                          session_key=spec.session, app=spec.app, request_id=f"r{idx}", tags=tags,
                          kind="completion", key_space="tokens")


def mark_held(replicas: list[Replica | LlamaCppReplica], live: Live, ri: int) -> None:
    """What the fleet held of this prompt at arrival: another replica's cached prefix (wasted-prefill figure) and
    the floor (prefill of what no replica held, alone on replica ``ri``)."""
    other = held_any = 0
    for j, rep in enumerate(replicas):
        held = rep.held_tokens(live)  # an engine never reuses a prompt's last token
        if j != ri and held > other:
            other = held
        if held > held_any:
            held_any = held
    live.held_elsewhere = other
    cached = held_any
    live.floor_s = replicas[ri].cost.prefill_alone_s(cached, live.prompt - cached)


def simulate(workload: Workload, policy: Policy | str, fleet: FleetConfig,
             progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Replay ``workload`` on ``fleet`` with ``policy`` picking through a fresh ``Router``."""
    t0 = time.perf_counter()
    if isinstance(policy, str):
        policy = make_policy(policy, preset=fleet.preset)
    bt = workload.block_tokens
    names = _backend_names(fleet.replicas)
    replicas = build_replicas(fleet, names, bt)
    loop = ReplicaLoop(replicas, fleet.metrics_interval_s,
                       replicas[0].cores if isinstance(replicas[0], LlamaCppReplica) else None)
    index_config = PrefixIndexConfig(capacity_tokens=fleet.capacity_tokens, block_tokens=float(bt))
    index, transit = routing_index(policy, fleet, replicas, index_config)
    router = Router(RouterConfig(index=index_config), clock=lambda: loop.now, index=index)
    by_name = {r.name: i for i, r in enumerate(replicas)}
    policy.bind(FleetView(replicas=dict(zip(names, replicas, strict=True)), preset=fleet.preset))

    reqs = workload.requests
    n = len(reqs)
    lives: list[Live | None] = [None] * n
    routed_as: list[RoutingRequest | None] = [None] * n
    successors = successors_of(workload, loop, _ARRIVE)
    max_tokens = max_request_tokens(replicas[0], fleet.preset.max_model_len)
    reasons: Counter[str] = Counter()
    queue_samples: list[int] = []
    replica_requests = [0] * len(replicas)
    dropped = 0
    routed = 0
    cap = workload.max_concurrency
    client_queue: deque[int] = deque()
    in_flight = 0
    schedule = loop.schedule

    def release_successors(i: int, at: float) -> None:
        nonlocal in_flight
        in_flight -= 1
        for j in successors.pop(i, ()):
            schedule(at + reqs[j].delay, _ARRIVE, j)
        if client_queue:
            schedule(at, _ARRIVE, client_queue.popleft(), 1)

    def arrive(kind: int, x: int, ver: int, now: float) -> None:
        nonlocal in_flight, dropped, routed
        if cap is not None and in_flight >= cap and ver == 0:
            client_queue.append(x)
            return
        in_flight += 1
        spec = reqs[x]
        if transit is not None and transit.pending:
            transit.deliver(now)
        loop.scrape(router, now)
        live = Live(x, f"r{x}", spec.prompt_tokens, max(1, spec.output_tokens), spec.keys, now, tokens=spec.tokens,
                    answer_tokens=spec.answer_tokens, time_factor=spec.time_factor)
        lives[x] = live
        if spec.prompt_tokens + spec.output_tokens > max_tokens:
            # over the context window: rejected before routing (LiteLLM's pre-call context check), so
            # no policy's index records a prompt no engine will run
            dropped += 1
            live.done_at = now
            release_successors(x, now)
            return
        request = routing_request(spec, x, bt)
        decision = router.pick(request, names, policy=policy)
        reasons[decision.reason] += 1
        routed += 1
        if decision.backend is None:
            dropped += 1
            router.finish(request, RequestOutcome(FAILURE, None, now), policy=policy)
            live.done_at = now
            release_successors(x, now)
            return
        routed_as[x] = request
        ri = by_name[decision.backend]
        mark_held(replicas, live, ri)
        replica_requests[ri] += 1
        queue_samples.append(sum(len(r.waiting) for r in replicas))
        loop.admit(ri, live, now)
        if progress is not None and routed % 2000 == 0:
            progress(routed, n)

    def step_done(rep: Replica, first: list[Live], done: list[Live], now: float) -> None:
        for r in first:
            router.on_first_token(r.rid)
        for r in done:
            request = routed_as[r.idx]
            assert request is not None
            router.finish(request, RequestOutcome(SUCCESS, rep.name, now, cached_tokens=r.hit_tokens,
                                                  output_tokens=r.output), policy=policy)
            release_successors(r.idx, now)

    sim_end = loop.run(arrive, step_done, transit.ship if transit is not None else None)
    if progress is not None:
        progress(n, n)
    finished = [r for r in lives if r is not None]
    return RunResult(
        policy=policy.name,
        workload=workload.name,
        replicas=fleet.replicas,
        requests=finished,
        stages=[reqs[r.idx].stage for r in finished],
        replica_busy=[r.busy_time for r in replicas],
        replica_requests=replica_requests,
        queue_samples=queue_samples,
        reasons=reasons,
        dropped=dropped,
        preemptions=sum(r.preemptions for r in replicas),
        evictions=sum(r.evictions for r in replicas),
        wall_s=time.perf_counter() - t0,
        sim_end=sim_end,
        router_errors=router.errors,
        notes=list(workload.notes),
        final_blocks=[r.block_state() for r in replicas],
    )


def successors_of(workload: Workload, loop: ReplicaLoop, arrive_kind: int) -> dict[int, list[int]]:
    """Schedule the arrivals that follow nothing; the others wait for the request they follow (returned map)."""
    successors: dict[int, list[int]] = {}
    for i, spec in enumerate(workload.requests):
        if spec.follows is None:
            loop.initial(spec.arrival, arrive_kind, i)
        else:
            if not 0 <= spec.follows < i:
                raise ValueError(f"request {i}: follows={spec.follows} must name an earlier request")
            successors.setdefault(spec.follows, []).append(i)
    return successors


def max_request_tokens(replica: Replica | LlamaCppReplica, max_model_len: int) -> int:
    """The longest prompt + output an empty replica can hold (its blocks minus the admission watermark; a llama.cpp
    slot's context)."""
    if isinstance(replica, LlamaCppReplica):
        return min(max_model_len, replica.context_tokens)
    usable_blocks = replica.capacity - replica.watermark - 1
    return min(max_model_len, usable_blocks * replica.block_tokens)
