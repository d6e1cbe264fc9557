"""``cache_aware`` (the default): the backend with the lowest predicted time to first token.

- routes on: predicted TTFT in seconds (queue, own prefill, KV, evictions, duplicate work)
- use it when: self-hosted replicas with prefix reuse (chat, RAG, agents, long contexts)
- cost: one index match; six scorers per class of backends with equal load (the eviction term per backend);
  in fleets over ``max_scored``, backends holding nothing of the prompt go unscored when even an idle one
  could not reach the tie band (always scored for a session's first request, below)

Shape: reduce → filter → score → pick. Where the cache tells backends apart by nothing (a short prompt, or every
backend holding the same prefix) the pick is the pure load balancer of ``policies/balance.py`` (least queued
prefill, equal loads in rotation, an idle fleet's ties to the prefix's rendezvous home; a session's first
request to the backend that started fewest sessions). Otherwise: filter (the hot-spot bound in busy seconds, off
by default: ``epsilon`` inf; when on, a holder of the prefix is over it only while it is working now) → score
(weighted scorers, ``policies/scorers.py``, each in seconds; a session's first request that some backend holds a
prefix of also pays each backend's recent busy seconds, the work its sessions keep bringing, and the live
sessions' context its growth would push out there, since the session's later turns stay where it starts) → pick
(lowest; near-ties go to the longer match, among equal matches to the cheapest, exact ties to the prefix's
rendezvous order for warm requests, or for cold ones the backend whose held conversations they put least at risk
where the index weighs them, then the least busy, then least recently used, exact ties again by the prefix's
rendezvous order); the decision reports the prefill it wastes (tokens another backend held). A holder is thus
kept or left by predicted TTFT: its queue plus the prefill of what it lacks against another's queue plus the
full recompute. Seconds come from an ``EngineSpeed`` prior (knobs) times a factor the load tracker learns per
backend from observed TTFT, so a session stays on its replica until the wait there costs more than recomputing
its whole context elsewhere — load is weighed as work; request counts only break ties of equal work (and count
the sessions started where the cache tells backends apart by nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from kvroute.policies.balance import Rotation, is_idle, least_waiting
from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.class_scores import ClassScores
from kvroute.policies.decision import Decision
from kvroute.policies.filters import hot_limit, hot_load
from kvroute.policies.hashing import Rendezvous
from kvroute.policies.load import SCORING_FIELDS, BackendLoad
from kvroute.policies.request import RoutingRequest
from kvroute.policies.scorers import FLEET_SCORERS, RESIDENT_SCORERS, SCORERS, Candidate, own_prefill, slot_wait
from kvroute.policies.sessions import SessionStarts
from kvroute.policies.speed import EngineSpeed
from kvroute.policies.tiers import TieredMatch

_PRIOR = EngineSpeed()

_IDLE = BackendLoad(0, 0, 0.0, 0, 0.0, float("-inf"))
_INFLIGHT, _QTOKENS, _WORK = (SCORING_FIELDS.index(n) for n in ("inflight", "queue_tokens", "work_s"))
_VALUE = itemgetter(1)  # a (backend, score) item's score
_MEMO_MAX = 4096  # entries per memo of pure functions (cleared when full)


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
    #: the hot-spot bound's slack over the mean busy seconds; off (inf) by default: a holder is kept or left by
    #: predicted TTFT alone (queue + remaining prefill there vs queue + full recompute elsewhere, from the
    #: work in flight), never by the seconds it served lately
    epsilon: float = math.inf
    busy_floor_s: float = 0.05
    bound_cost_s: float = 0.5
    tie_s: float = 0.005
    tie_fraction: float = 0.05
    max_scores: int = 8
    max_scored: int = 8
    #: session keys remembered to tell a session's first request from its later ones (0: none told apart)
    sessions_remembered: int = 65536
    #: a prefix still being prefilled where it is held is reserved there until its first token: a copy elsewhere
    #: is priced as work done twice (``scorers.duplicate_work``), so concurrent first turns follow it unless the
    #: wait there costs more than computing it twice
    reserve_in_flight: bool = True
    #: weights by scorer name (``scorers.SCORERS``, a registered one included), over the ``*_weight`` knobs
    scorers: Mapping[str, float] = field(default_factory=dict)
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
        for name, weight in dict(self.scorers).items():
            if name not in SCORERS:
                raise ValueError(f"scorers: unknown scorer {name!r} (known: {', '.join(SCORERS)})")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                raise ValueError(f"scorers: the weight of {name!r} must be a number >= 0, got {weight!r}")
        if self.sessions_remembered < 0:
            raise ValueError("sessions_remembered must be >= 0")
        if self.max_scored < 1:
            raise ValueError("max_scored must be >= 1")
        self.speed  # validates the speed knobs  # noqa: B018

    @property
    def weights(self) -> dict[str, float]:
        """Every registered scorer's weight, in summing order: ``scorers`` over the ``*_weight`` knobs (a
        registered scorer no knob names weighs 0)."""
        knobs = {"queue": self.queue_weight, "slot": self.slot_weight, "prefill": self.prefill_weight,
                 "kv": self.kv_weight, "evict": self.evict_weight, "others": self.others_weight}
        given = dict(self.scorers)
        return {n: float(given.get(n, knobs.get(n, 0.0))) for n in SCORERS}

    @property
    def speed(self) -> EngineSpeed:
        return EngineSpeed(self.prefill_tok_s, self.attn_s, self.step_s, self.decode_s_per_seq,
                           self.chunk_tokens, self.slots)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = cfg = config or CacheAwareConfig()
        self.speed = cfg.speed
        weights = cfg.weights
        self.scorers = [(SCORERS[n], w) for n, w in weights.items() if w > 0 and n not in FLEET_SCORERS]
        self.fleet_scorers = [(SCORERS[n], w) for n, w in weights.items() if w > 0 and n in FLEET_SCORERS]
        names = [n for n, w in weights.items() if w > 0 and n not in FLEET_SCORERS]
        names += [n for n, w in weights.items() if w > 0 and n in FLEET_SCORERS]
        terms = [(SCORERS[n], weights[n]) for n in names]  # the order TTFT and cost are summed in
        k = len(self.scorers)
        r = next((i for i, n in enumerate(names) if n in RESIDENT_SCORERS), len(names))
        # (per class: TTFT terms, more cost terms; per backend: TTFT terms, more cost terms)
        self._terms = (terms[:k], terms[k:r], [], terms[r:]) if r >= k else (terms[:r], [], terms[r:k], terms[k:])
        # of the per-backend cost terms, those that read no ``resident_tokens`` are computed once per class
        # (their weighted value is added per backend in the same place of the sum: the same floats)
        self._member_resident = tuple(n in RESIDENT_SCORERS for n in names[max(r, k):])
        self._evict_weight = weights["evict"]
        self._idle_memo: dict[tuple[int, float, int, float], tuple[float, float]] = {}
        self._first_memo: dict[tuple[object, ...], str] = {}
        self._sessions = SessionStarts(cfg.sessions_remembered)
        self._rotation = Rotation()  # every pick
        self._starts = Rotation()  # sessions' first requests where every backend holds the same prefix

    def _cold_cannot_win(self, holders: Sequence[str], hot_of: dict[str, float], limit: float | None,
                         ttft_of: dict[str, float], cost_of: dict[str, float], prompt: int, factor: float,
                         best_matched: int, best_own: float, own_by_match: dict[int, float],
                         reserved: bool = False) -> bool:
        """True when no backend that holds nothing of this prompt can change the pick, so they go unscored.

        Proof. Let U be the lowest cost of a scored holder within the hot-spot bound (there must be one) and
        L_cost, L_ttft the cost and TTFT of a backend with no match, no load, no queue, no cache and unknown
        capacity. Every scorer is lowest there for a given match (tests/policies/test_scorer_properties.py checks it)
        and weights are >= 0, so each non-holder x has cost(x) >= L_cost and ttft(x) >= L_ttft. If L_ttft >=
        the least TTFT of the holders within the bound, x changes neither least TTFT the hot-spot rule
        compares, so that rule keeps or drops the same holders; the best cost after it is at most U, so with
        L_cost > U + band(U) no x is the best or within the tie band of it, and the picker (which reads only
        that band) picks the same. Only the reported ``scores`` lack these backends.
        """
        cfg = self.config
        within = holders if limit is None else [b for b in holders if hot_of[b] <= limit]
        if not within:
            return False
        best = min(map(cost_of.__getitem__, within))
        least_ttft = min(map(ttft_of.__getitem__, within))
        if best != best or least_ttft != least_ttft:  # a NaN first: the least of the others, as compared alone
            best = least_ttft = math.inf
            for b in within:
                cost, t = cost_of[b], ttft_of[b]
                best = cost if cost < best else best
                least_ttft = t if t < least_ttft else least_ttft
        if best == math.inf:
            return False
        memo_key = (prompt, factor, best_matched, best_own, reserved)
        idle = self._idle_memo.get(memo_key)
        if idle is None:
            idle = self._idle_memo[memo_key] = self._idle_scores(prompt, factor, best_matched, best_own, own_by_match,
                                                                 reserved)
            if len(self._idle_memo) > _MEMO_MAX:
                self._idle_memo.clear()
        if not idle[0] >= least_ttft:
            return False
        return idle[1] > best + max(cfg.tie_s, cfg.tie_fraction * best)

    def _idle_scores(self, prompt: int, factor: float, best_matched: int, best_own: float,
                     own_by_match: dict[int, float], reserved: bool = False) -> tuple[float, float]:
        """(TTFT, cost) of a backend with no match, no load, no queue, no cache and unknown capacity: a pure
        function of these arguments (the scorers and speed are fixed per policy), so ``_idle_memo`` keeps it."""
        own0 = own_by_match.get(0)
        if own0 is None:
            own0 = own_by_match[0] = self.speed.prefill_s(prompt, 0)
        speed = self.speed
        c = Candidate("", prompt, 0, _IDLE, factor, 0.0, 0, 0.0, 0.0, 0.0, best_matched, own0, best_own,
                      reserved=reserved)
        t = 0.0
        for f, w in self.scorers:
            t += w * f(c, speed)
        u = t
        for f, w in self.fleet_scorers:
            u += w * f(c, speed)
        return t, u

    @staticmethod
    def _still_computing(request: RoutingRequest, matches: dict[str, int], matched: dict[str, int], best: int,
                         state: RoutingState) -> bool:
        """True when every backend holding the longest match holds it only as work in flight (a request there is
        still prefilling those blocks): the prefix is reserved there until that first token."""
        computed = state.computed
        if computed is None:
            return False
        keys = request.keys
        for b, m in matched.items():
            if m == best and m > 0:
                blocks = matches.get(b, 0)
                if computed(b, keys, blocks) >= blocks:
                    return False
        return True

    def _first_in_order(self, rendezvous: Rendezvous, key: int, holders: list[str]) -> str:
        """``rendezvous.order(key, holders)[0]``, remembered per (key, holders): the order is a pure function
        of them for the stock ``Rendezvous`` (a subclass is always asked)."""
        if type(rendezvous) is not Rendezvous:
            return rendezvous.order(key, holders)[0]
        memo_key = (key, *holders)
        first = self._first_memo.get(memo_key)
        if first is None:
            first = self._first_memo[memo_key] = rendezvous.order(key, holders)[0]
            if len(self._first_memo) > _MEMO_MAX:
                self._first_memo.clear()
        return first

    def _pick_by_cost(self, request: RoutingRequest, costs: dict[str, float], matched: dict[str, int],
                      top_holder: int, state: RoutingState, now: float) -> tuple[str, str]:
        """(backend, reason): the lowest cost; near-ties go to the longer match, among equal matches to the
        cheapest, exact ties to the prefix's rendezvous order for warm requests, or for cold ones the backend
        whose held conversations it puts least at risk (``live_tokens``, where the index weighs them), then the
        least busy, then least recently used (exact ties again by the prefix's rendezvous order)."""
        cfg = self.config
        load = state.load
        best_cost = min(costs.values())
        band = max(cfg.tie_s, cfg.tie_fraction * best_cost)
        threshold = best_cost + band
        near = [b for b, cost in costs.items() if cost <= threshold]
        best_match = max(map(matched.__getitem__, near))
        if best_match > 0:
            holders = [b for b in near if matched[b] == best_match]
            if len(holders) > 1:  # the band prefers longer matches; among equal ones the cheapest wins
                cheapest = min(map(costs.__getitem__, holders))
                holders = [b for b in holders if costs[b] == cheapest]
            # several: the first in the prefix's rendezvous order (highest weight, then name)
            backend = (holders[0] if len(holders) == 1
                       else self._first_in_order(state.rendezvous, request.keys[0], holders))
            return backend, "prefix_match" if best_match >= top_holder else "prefix_spill"
        if len(near) == 1:
            return near[0], "cold" if top_holder == 0 else "prefix_spill"
        # a new prompt goes where it puts the fewest live tokens at risk (whole blocks: a stale prompt counts
        # nothing), then to the least busy, then least recently used backend
        index = state.index
        live_of = index.live_tokens or (index.fallback.live_tokens if index.fallback else None)
        bt = request.block_tokens
        rank = {b: (int(live_of(b, now) // bt) if live_of is not None and bt > 0 else 0, load.busy(b, now),
                    load.last_pick(b), costs[b]) for b in near}
        least = min(rank.values())
        tied = [b for b in near if rank[b] == least]
        # Exact ties (an idle fleet, or several routers that have not yet seen each other's picks) go to
        # the prefix's rendezvous order: routers agree without talking, and different prefixes spread.
        if len(tied) == 1:
            backend = tied[0]
        elif request.keys:
            backend = self._first_in_order(state.rendezvous, request.keys[0], tied)
        else:
            backend = min(tied)
        return backend, "cold" if top_holder == 0 else "prefix_spill"

    def _short_prompt(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
                      now: float) -> Decision:
        """Too short a prompt to route on: the pure load balancer picks (least waiting, then the rotation)."""
        backend = self._rotation.next_of(least_waiting(candidates, state.load, now, self.speed.chunk_tokens),
                                          state.load)
        self._rotation.record(backend)
        return Decision(backend=backend, policy=self.name, reason="least_load", prompt_tokens=request.prompt_tokens,
                        skipped="short_prompt", request_id=request.request_id,
                        predicted_prefill_tokens=request.prompt_tokens)

    def _hot_bound(self, candidates: Sequence[str], busy: list[float], states: list[tuple[object, ...]],
                   matches: dict[str, int]) -> tuple[float | None, dict[str, float]]:
        """(the hot-spot bound, each backend's hot load): None, {} when the bound is off or no backend is within it
        (then every backend passes)."""
        cfg = self.config
        if cfg.epsilon == math.inf:  # off by default: an infinite limit passes every backend, so skip it
            return None, {}
        hot = [hot_load(v, st[_INFLIGHT] > 0 or st[_QTOKENS] > 0, b in matches)
               for b, v, st in zip(candidates, busy, states, strict=True)]
        limit: float | None = hot_limit(busy, cfg.epsilon, cfg.busy_floor_s)
        hot_of = dict(zip(candidates, hot, strict=True))
        if not min(hot) <= limit:  # none within (NaN too, as in ``within_hot_bound``): all pass (None)
            limit = None
        return limit, hot_of

    @staticmethod
    def _matched_tokens(request: RoutingRequest, candidates: Sequence[str], matches: Any,
                        credited: dict[str, float] | None, index: Any, state: RoutingState) -> dict[str, int]:
        """Each candidate's matched prompt tokens (a slower tier's blocks at their credit; never the last token),
        the session's home raised to the tail it holds."""
        matched = dict.fromkeys(candidates, 0)
        prompt = request.prompt_tokens
        if prompt <= 0:
            return matched
        bt = request.block_tokens
        top = prompt - 1
        for b, blocks in matches.items():
            m = int((credited.get(b, blocks) if credited else blocks) * bt)
            m = top if m > top else m
            matched[b] = m if m > 0 else 0
        grain = index.tail_block_tokens
        home = (state.homes.home(request.session_key, request.keys)
                if request.session_key and grain else None)
        if home is not None and home.backend in matches and matches[home.backend] >= home.blocks:
            # the session's home holds its tail too (the last partial block and the answer, in the engine's
            # own blocks), which the index's blocks cannot show: every holder of the shared system prompt
            # would tie with it
            held = home.tokens // grain * grain
            held = held if held < top else top
            if held > matched[home.backend]:
                matched[home.backend] = held
        return matched

    def _session_costs(self, request: RoutingRequest, costs: dict[str, float], matched: dict[str, int],
                       busy_of: dict[str, float], capacity_of: Any, factor: float, state: RoutingState,
                       now: float) -> dict[str, float]:
        """``costs`` of a session's first request that some backend holds a prefix of (a shared system prompt or
        tools), with what the session brings where it starts (its later turns stay there):

        - the work the sessions already there keep bringing: the backend's recent busy seconds weighed by its
          utilization (the chance a later turn finds it working). A busy holder sends new sessions elsewhere
          (they spread before queues form); a lightly used one keeps them with their prefix.
        - where the backend's cache has a capacity, the context of live sessions there that the session's growth
          pushes out, priced as ``scorers.eviction`` prices evicted tokens: the session grows to what later turns
          of sessions with its first block reach (``LiveSessions.growth``, at least its prompt), beside what the
          live sessions hold beyond the prefix they share with it (``LiveSessions.at_risk``). Two growing
          conversations that one cache cannot hold evict each other's context turn after turn; beside nothing
          live, or where both fit, this adds nothing."""
        load, live, weight = state.load, state.live, self._evict_weight
        grown = max(float(request.prompt_tokens), live.growth(request.keys[0]))
        bt = request.block_tokens
        out: dict[str, float] = {}
        for b, cost in costs.items():
            busy = busy_of[b]
            cost += busy * min(1.0, load.utilization(busy))
            if weight > 0 and capacity_of is not None:
                cap = capacity_of(b) * bt
                risk = live.at_risk(b, matched[b], now) if cap > 0 else 0.0
                evicted = min(risk, risk + grown - cap)
                if evicted > 0:
                    cost += weight * factor * self.speed.prefill_s(evicted)
            out[b] = cost
        return out

    def _balance(self, request: RoutingRequest, costs: dict[str, float], weigh_sessions: bool, state: RoutingState,
                 now: float) -> str:
        """Every backend holds the same prefix: the cache tells them apart by nothing, so the pure load balancer
        picks (``policies/balance.py``: least prefill queued). Equal waits of idle backends go to the prefix's
        rendezvous order (an idle fleet keeps the prefix on one home, routers agree without talking); of working
        ones, to the rotation (equal loads spread like round robin). A session's first request goes to the
        backend that started fewest sessions: its later turns stay where it starts, so sessions, not the queue
        of the moment, are the load it brings."""
        load = state.load
        if weigh_sessions:
            tied = [self._starts.next_of(list(costs), load)]
            self._starts.record(tied[0])
        else:
            tied = least_waiting(list(costs), load, now)
        if len(tied) == 1:
            return tied[0]
        if is_idle(tied[0], load, now):
            return self._first_in_order(state.rendezvous, request.keys[0], tied)
        return self._rotation.next_of(tied, load)

    def _decision(self, request: RoutingRequest, backend: str, reason: str, costs: dict[str, float],
                  chosen: Candidate, matches: Any, credited: dict[str, float] | None, best_matched: int) -> Decision:
        """The decision for ``chosen``: its predicted work, TTFT and fixed wait, the reported scores, the prefill
        it wastes."""
        cfg, speed = self.config, self.speed
        prompt = request.prompt_tokens
        work = chosen.own_s
        fixed = slot_wait(chosen, speed) * cfg.slot_weight
        factor = chosen.factor or 1.0
        scores = (
            costs if len(costs) <= cfg.max_scores
            else dict(sorted(costs.items(), key=_VALUE)[: cfg.max_scores])
        )
        own = own_prefill(chosen, speed) / factor
        queued = max(chosen.work_s, chosen.view.queue_tokens / speed.prefill_tok_s)
        return Decision(
            backend=backend,
            policy=self.name,
            reason=reason,
            # tokens held in any tier (what the engine will report cached); the cost above read them credited
            matched_tokens=(chosen.matched if not credited
                            else min(int(matches[backend] * request.block_tokens), max(prompt - 1, 0))),
            matched_blocks=matches.get(backend, 0),
            prompt_tokens=prompt,
            scores=scores,
            request_id=request.request_id,
            predicted_prefill_tokens=chosen.uncached,
            work_s=work,
            predicted_ttft_s=queued + own,
            fixed_wait_s=fixed,
            wasted_prefill_tokens=best_matched - chosen.matched,
        )

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        cfg = self.config
        if request.routable_tokens < cfg.min_prefix_tokens:
            return self._short_prompt(request, candidates, state, now)
        load = state.load
        speed = self.speed
        index = state.index
        matches = index.match(request.keys, candidates, now)
        # blocks a slower cache tier holds count at their credit: GPU-equivalent blocks (policies/tiers.py)
        credited = matches.credited if type(matches) is TieredMatch else None
        prompt = request.prompt_tokens
        capacity_of = index.capacity_blocks or (index.fallback.capacity_blocks if index.fallback else None)
        factor = load.factor(candidates[0])  # fleet-wide (see LoadTracker.factor)
        output = load.output_tokens()  # fleet-wide mean, for the KV a request holds by its end
        # every candidate's scorer inputs in one pass (the hot-spot bound reads which holders are working now)
        all_states, all_picks = load.scoring_inputs(candidates, now)
        state_of = dict(zip(candidates, all_states, strict=True))
        busy = load.busy_many(candidates, now)
        busy_of = dict(zip(candidates, busy, strict=True))
        session_start = self._sessions.first(request.session_key)
        limit, hot_of = self._hot_bound(candidates, busy, all_states, matches)
        holders = [b for b in candidates if b in matches]
        matched = self._matched_tokens(request, candidates, matches, credited, index, state)
        best_matched = max(map(matched.__getitem__, holders)) if holders else 0
        best_own = speed.prefill_s(prompt - best_matched, best_matched)
        reserved = cfg.reserve_in_flight and best_matched > 0 and self._still_computing(request, matches, matched,
                                                                                        best_matched, state)
        weigh_sessions = session_start and best_matched > 0
        own_by_match: dict[int, float] = {best_matched: best_own}
        scored = ClassScores(keys=request.keys, now=now, index=index, capacity_of=capacity_of, matched=matched,
                             block_tokens=request.block_tokens, prompt=prompt, own_by_match=own_by_match,
                             speed=speed, view_of=load.view, factor=factor, best_matched=best_matched,
                             best_own=best_own, output=output, reserved=reserved, terms=self._terms,
                             member_resident=self._member_resident)
        score, ttft_of, cost_of = scored.score, scored.ttft, scored.cost

        if holders and len(holders) < len(candidates) and len(candidates) > cfg.max_scored:
            # large fleets only (smaller ones report a score for every backend, as they always did)
            score(holders, [state_of[b] for b in holders])
            # (a session's first request adds busy seconds to the costs below, which the proof does not cover)
            if not weigh_sessions and self._cold_cannot_win(holders, hot_of, limit, ttft_of, cost_of, prompt, factor,
                                                            best_matched, best_own, own_by_match, reserved):
                candidates = holders
        if len(candidates) > len(cost_of):
            rest_of = [b for b in candidates if b not in matches]
            if len(rest_of) == len(candidates):
                states, picks = all_states, all_picks
            else:
                pick_of = dict(zip(candidates, all_picks, strict=True))
                states, picks = [state_of[b] for b in rest_of], [pick_of[b] for b in rest_of]
            if len(candidates) > cfg.max_scored:
                # Large fleets: every holder of a prefix, plus the least loaded of the rest (backends holding
                # nothing of this prompt differ only by load, so the cheapest few stand for all of them).
                keep = max(4, cfg.max_scored - len(matches))
                if len(rest_of) > keep:
                    # by (work, busy, last pick, name); the position last orders equal keys as a stable sort
                    ranked = sorted(zip([s[_WORK] for s in states], load.busy_many(rest_of, now), picks, rest_of,
                                        range(len(rest_of)), strict=True))
                    order = [r[4] for r in ranked[:keep]]
                    rest_of = [rest_of[i] for i in order]
                    states = [states[i] for i in order]
                    candidates = holders + rest_of
            if holders and not cost_of:
                score(holders, [state_of[b] for b in holders])
            score(rest_of, states)
        ttft = {b: ttft_of[b] for b in candidates}
        costs = {b: cost_of[b] for b in candidates}
        # Hot-spot bound (``filters.hot_load``): working backends over the bound are left out unless that
        # costs this request more than ``bound_cost_s`` of predicted TTFT (a session whose long context is
        # cached there stays: moving it would recompute that whole context; new or short work spreads).
        allowed = list(costs) if limit is None else [b for b in costs if hot_of[b] <= limit]
        if (allowed and len(allowed) < len(costs)
                and min(map(ttft.__getitem__, allowed)) - min(ttft.values()) <= cfg.bound_cost_s):
            costs = {b: costs[b] for b in allowed}
        if weigh_sessions:
            costs = self._session_costs(request, costs, matched, busy_of, capacity_of, factor, state, now)
        if best_matched > 0 and len(set(matched.values())) == 1:
            backend, reason = self._balance(request, costs, weigh_sessions, state, now), "prefix_match"
        else:
            backend, reason = self._pick_by_cost(request, costs, matched, best_matched, state, now)
        self._rotation.record(backend)
        chosen = scored.candidate[backend]
        chosen.resident_tokens = scored.resident[backend]
        chosen.evicts = scored.evicts[backend]
        return self._decision(request, backend, reason, costs, chosen, matches, credited, best_matched)
