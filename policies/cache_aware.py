"""``cache_aware`` (the default): the backend with the lowest predicted time to first token.

- routes on: predicted TTFT in seconds (queue, own prefill, KV, evictions, duplicate work)
- use it when: self-hosted replicas with prefix reuse (chat, RAG, agents, long contexts)
- cost: one index match and six scorers per backend

Shape: filter (hot-spot bound in busy seconds) → score (weighted scorers, ``policies/scorers.py``, each
in seconds) → pick (lowest; near-ties go to the longer match, then the prefix's rendezvous order for
warm requests, or the least busy then least recently used backend for cold ones). Seconds come from
an ``EngineSpeed`` prior (knobs) times a factor the load tracker learns per backend from observed TTFT,
so a session stays on its replica until the wait there costs more than recomputing its whole context
elsewhere — load is weighed as work, never as a request count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import RoutingState, least_load_decision
from kvroute.policies.decision import Decision
from kvroute.policies.filters import within_busy_bound
from kvroute.policies.load import SCORING_FIELDS
from kvroute.policies.request import RoutingRequest
from kvroute.policies.scorers import FLEET_SCORERS, SCORERS, Candidate, own_prefill, slot_wait
from kvroute.policies.speed import EngineSpeed

_PRIOR = EngineSpeed()

_WORK, _QUEUED, _DECODE = (SCORING_FIELDS.index(n) for n in ("work_s", "queued", "decode_s"))


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """Scorer weights (dimensionless; scores are seconds), the hot-spot bound and the speed prior."""

    min_prefix_tokens: int = 256
    queue_weight: float = 1.0
    slot_weight: float = 1.0
    prefill_weight: float = 1.0
    kv_weight: float = 0.25
    evict_weight: float = 0.5
    others_weight: float = 1.0
    epsilon: float = 0.5
    busy_floor_s: float = 0.05
    bound_cost_s: float = 0.5
    tie_s: float = 0.005
    tie_fraction: float = 0.05
    max_scores: int = 8
    max_scored: int = 8
    # the engine-speed prior; defaults are EngineSpeed's (policies/speed.py), repeated nowhere
    prefill_tok_s: float = _PRIOR.prefill_tok_s
    attn_s: float = _PRIOR.attn_s
    step_s: float = _PRIOR.step_s
    decode_s_per_seq: float = _PRIOR.decode_s_per_seq
    chunk_tokens: int = _PRIOR.chunk_tokens
    slots: int = _PRIOR.slots

    def __post_init__(self) -> None:
        for name in ("min_prefix_tokens", "queue_weight", "slot_weight", "prefill_weight", "kv_weight",
                     "evict_weight", "others_weight", "epsilon", "busy_floor_s", "bound_cost_s", "tie_s",
                     "tie_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_scored < 1:
            raise ValueError("max_scored must be >= 1")
        self.speed  # validates the speed knobs  # noqa: B018

    @property
    def speed(self) -> EngineSpeed:
        return EngineSpeed(self.prefill_tok_s, self.attn_s, self.step_s, self.decode_s_per_seq,
                           self.chunk_tokens, self.slots)


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = cfg = config or CacheAwareConfig()
        self.speed = cfg.speed
        weights = {"queue": cfg.queue_weight, "slot": cfg.slot_weight, "prefill": cfg.prefill_weight,
                   "kv": cfg.kv_weight, "evict": cfg.evict_weight, "others": cfg.others_weight}
        self.scorers = [(SCORERS[n], w) for n, w in weights.items() if w > 0 and n not in FLEET_SCORERS]
        self.fleet_scorers = [(SCORERS[n], w) for n, w in weights.items() if w > 0 and n in FLEET_SCORERS]

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        cfg = self.config
        if request.routable_tokens < cfg.min_prefix_tokens:
            return least_load_decision(request, candidates, state, now, self.name, reason="least_load",
                                       skipped="short_prompt")
        load = state.load
        speed = self.speed
        index = state.index
        matches = index.match(request.keys, candidates, now)
        prompt = request.prompt_tokens
        bt = request.block_tokens
        capacity_of = getattr(index, "capacity_blocks", None) or getattr(getattr(index, "fallback", None),
                                                                           "capacity_blocks", None)
        busy = load.busy_many(candidates, now)
        within = within_busy_bound(candidates, busy, cfg.epsilon, cfg.busy_floor_s)  # hot-spot bound, below
        states, picks = load.scoring_inputs(candidates, now)
        if len(candidates) > cfg.max_scored:
            # Large fleets: every holder of a prefix, plus the least loaded of the rest (backends holding
            # nothing of this prompt differ only by load, so the cheapest few stand for all of them).
            rest = [i for i, b in enumerate(candidates) if b not in matches]
            keep = max(4, cfg.max_scored - len(matches))
            if len(rest) > keep:
                rest.sort(key=lambda i: (states[i][_WORK], busy[i], picks[i], candidates[i]))
                order = [i for i, b in enumerate(candidates) if b in matches] + rest[:keep]
                candidates = [candidates[i] for i in order]
                states = [states[i] for i in order]
        matched = dict.fromkeys(candidates, 0)
        if prompt > 0:
            top = prompt - 1
            for b, blocks in matches.items():
                m = int(blocks * bt)
                m = top if m > top else m
                matched[b] = m if m > 0 else 0
        best_matched = max(matched.values())
        best_own = speed.prefill_s(prompt - best_matched, best_matched)
        factor = load.factor(candidates[0])  # fleet-wide (see LoadTracker.factor)
        own_by_match: dict[int, float] = {best_matched: best_own}
        prefill_s = speed.prefill_s
        scorers, fleet = self.scorers, self.fleet_scorers
        blocks_of = index.blocks
        state_of: dict[str, tuple[object, ...]] = {}
        classes: dict[tuple[object, ...], list[tuple[float, str]]] = {}
        for b, st in zip(candidates, states, strict=True):
            state_of[b] = st
            key = (matched[b], capacity_of(b) if capacity_of is not None else 0, st)
            members = classes.get(key)
            res = blocks_of(b) * bt
            if members is None:
                classes[key] = [(res, b)]
            else:
                members.append((res, b))

        def candidate(b: str, res: float) -> Candidate:
            m = matched[b]
            own_s = own_by_match.get(m)
            if own_s is None:
                own_s = own_by_match[m] = prefill_s(prompt - m, m)
            st = state_of[b]
            cap = capacity_of(b) * bt if capacity_of is not None else 0.0
            return Candidate(b, prompt, m, load.view(b, now), factor, st[_WORK], st[_QUEUED], st[_DECODE], res, cap,
                             best_matched, own_s, best_own)

        def score(b: str, res: float) -> tuple[float, float]:
            c = candidate(b, res)
            t = 0.0
            for f, w in scorers:
                t += w * f(c, speed)
            ttft_b = t
            for f, w in fleet:
                t += w * f(c, speed)
            return ttft_b, t

        # One score per class of equal inputs (see ``same_inputs_same_score``): backends that differ only in
        # the cache they hold share a score when its extremes agree, else each is scored.
        scored: dict[str, tuple[float, float]] = {}
        resident: dict[str, float] = {}
        for members in classes.values():
            if len(members) == 1:
                res, b = members[0]
                resident[b] = res
                scored[b] = score(b, res)
                continue
            lo, hi = min(members), max(members)
            low, high = score(lo[1], lo[0]), score(hi[1], hi[0])
            for res, b in members:
                resident[b] = res
            if low == high:
                for _, b in members:
                    scored[b] = low
            else:
                scored[lo[1]], scored[hi[1]] = low, high
                for res, b in members:
                    if b not in scored:
                        scored[b] = score(b, res)
        ttft = {b: scored[b][0] for b in candidates}
        costs = {b: scored[b][1] for b in candidates}
        top_holder = best_matched
        # Hot-spot bound (busy seconds): over-bound backends are left out unless that costs this request
        # more than ``bound_cost_s`` of predicted TTFT (a session whose long context is cached there stays:
        # moving it would recompute that whole context; new or short work spreads).
        allowed = [b for b in within if b in costs]
        if (allowed and len(allowed) < len(costs)
                and min(ttft[b] for b in allowed) - min(ttft.values()) <= cfg.bound_cost_s):
            costs = {b: costs[b] for b in allowed}
        allowed = list(costs)
        best_cost = min(costs.values())
        band = max(cfg.tie_s, cfg.tie_fraction * best_cost)
        near = [b for b in allowed if costs[b] <= best_cost + band]
        best_match = max(matched[b] for b in near)
        if best_match > 0:
            holders = [b for b in near if matched[b] == best_match]
            if len(holders) == 1:
                backend = holders[0]
            else:
                anchor = request.keys[0]
                backend = min(holders, key=lambda b: (-state.rendezvous.weight(anchor, b), b))
            reason = "prefix_match" if best_match >= top_holder else "prefix_spill"
        else:
            backend = min(near, key=lambda b: (load.busy(b, now), load.last_pick(b), costs[b], b))
            reason = "cold" if top_holder == 0 else "prefix_spill"
        chosen = candidate(backend, resident[backend])
        work = chosen.own_s
        fixed = slot_wait(chosen, speed) * cfg.slot_weight
        factor = chosen.factor or 1.0
        scores = (
            costs if len(costs) <= cfg.max_scores
            else dict(sorted(costs.items(), key=lambda kv: kv[1])[: cfg.max_scores])
        )
        own = own_prefill(chosen, speed) / factor
        queued = max(chosen.work_s, chosen.view.queue_tokens / speed.prefill_tok_s)
        return Decision(
            backend=backend,
            policy=self.name,
            reason=reason,
            matched_tokens=chosen.matched,
            matched_blocks=matches.get(backend, 0),
            prompt_tokens=prompt,
            scores=scores,
            request_id=request.request_id,
            predicted_prefill_tokens=chosen.uncached,
            work_s=work,
            predicted_ttft_s=queued + own,
            fixed_wait_s=fixed,
        )
