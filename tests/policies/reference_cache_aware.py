"""``cache_aware``'s picker as of e9da8e7 (one ``Candidate`` and every scorer per backend), kept as the oracle the
faster ``CacheAware.select`` must agree with (tests/policies/test_cache_aware_equivalence.py), with the changes
since marked: equal holders go to the cheapest; the hot-spot bound never counts a holder of the prefix that is
idle now as hot (``filters.hot_load``); the decision reports its wasted prefill; a session's first request
that a backend holds a prefix of adds each backend's recent busy seconds and the live sessions its growth would
evict to its cost (``CacheAware._session_costs``); the outstanding work is the
load tracker's at the pick's instant (``work_s(b, now)``, drained in queue order)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.balance import is_idle, least_waiting
from kvroute.policies.base import RoutingState
from kvroute.policies.cache_aware import CacheAware
from kvroute.policies.decision import Decision
from kvroute.policies.filters import hot_limit, hot_load, within_hot_bound
from kvroute.policies.request import RoutingRequest
from kvroute.policies.scorers import Candidate, own_prefill, slot_wait


class ReferenceCacheAware(CacheAware):
    """The same config, scorers and weights as ``CacheAware``; only ``select`` is the old one."""

    def select(
        self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState, now: float
    ) -> Decision:
        cfg = self.config
        if request.routable_tokens < cfg.min_prefix_tokens:
            # changed: short prompts go to the pure load balancer (``policies/balance.py``), in whole chunks
            backend = self._rotation.next_of(least_waiting(candidates, state.load, now, self.speed.chunk_tokens),
                                              state.load)
            self._rotation.record(backend)
            return Decision(backend=backend, policy=self.name, reason="least_load", prompt_tokens=request.prompt_tokens,
                            skipped="short_prompt", request_id=request.request_id,
                            predicted_prefill_tokens=request.prompt_tokens)
        load = state.load
        speed = self.speed
        index = state.index
        matches = index.match(request.keys, candidates, now)
        prompt = request.prompt_tokens
        bt = request.block_tokens
        capacity_of = getattr(index, "capacity_blocks", None) or getattr(getattr(index, "fallback", None),
                                                                           "capacity_blocks", None)
        costs: dict[str, float] = {}
        cands: dict[str, Candidate] = {}
        scorers, fleet = self.scorers, self.fleet_scorers
        ttft: dict[str, float] = {}
        matched: dict[str, int] = {}
        factor = load.factor(candidates[0])  # fleet-wide (see LoadTracker.factor)
        # changed: the hot-spot bound (below) never counts an idle holder of the prefix as hot
        busy = [load.busy(b, now) for b in candidates]
        busy_of = dict(zip(candidates, busy, strict=True))
        session_start = self._sessions.first(request.session_key)  # changed: a session's first request, below
        hot = [hot_load(busy_s, (v := load.view(b, now)).inflight > 0 or v.queue_tokens > 0, b in matches)
               for b, busy_s in zip(candidates, busy, strict=True)]
        within = within_hot_bound(candidates, hot, hot_limit(busy, cfg.epsilon, cfg.busy_floor_s))
        if len(candidates) > cfg.max_scored:
            # Large fleets: every holder of a prefix, plus the least loaded of the rest (backends holding
            # nothing of this prompt differ only by load, so the cheapest few stand for all of them).
            rest = [b for b in candidates if b not in matches]
            keep = max(4, cfg.max_scored - len(matches))
            if len(rest) > keep:
                rest.sort(key=lambda b: (load.work_s(b, now), load.busy(b, now), load.last_pick(b), b))
                candidates = [b for b in candidates if b in matches] + rest[:keep]
        for b in candidates:
            m = min(prompt - 1, int(matches.get(b, 0) * bt)) if prompt > 0 else 0
            matched[b] = max(0, m)
        grain = getattr(index, "tail_block_tokens", None)
        home = (state.homes.home(request.session_key, request.keys)
                if request.session_key and prompt > 0 and grain else None)
        if home is not None and home.backend in matches and home.backend in matched \
                and matches[home.backend] >= home.blocks:  # changed: a session's home holds its tail too
            matched[home.backend] = max(matched[home.backend], min(home.tokens // grain * grain, prompt - 1))
        best_matched = max(matched.values())
        best_own = speed.prefill_s(prompt - best_matched, best_matched)
        own_by_match: dict[int, float] = {best_matched: best_own}
        # changed: the longest match only in flight where it is held reserves it (a copy elsewhere is priced)
        reserved = cfg.reserve_in_flight and best_matched > 0 and state.computed is not None and all(
            state.computed(b, request.keys, matches[b]) < matches[b]
            for b in matched if matched[b] == best_matched)
        prefill_s = speed.prefill_s
        for b in candidates:
            m = matched[b]
            own_s = own_by_match.get(m)
            if own_s is None:
                own_s = own_by_match[m] = prefill_s(prompt - m, m)
            c = Candidate(b, prompt, m, load.view(b, now), factor, load.work_s(b, now), load.queued(b),
                          load.decode_s(b), index.blocks(b) * bt,
                          capacity_of(b) * bt if capacity_of is not None else 0.0, best_matched, own_s, best_own,
                          load.output_tokens(), reserved)
            cands[b] = c
            t = 0.0
            for f, w in scorers:
                t += w * f(c, speed)
            ttft[b] = t
            for f, w in fleet:
                t += w * f(c, speed)
            costs[b] = t
        top_holder = best_matched
        # Hot-spot bound (load now): over-bound backends are left out unless that costs this request
        # more than ``bound_cost_s`` of predicted TTFT (a session whose long context is cached there stays:
        # moving it would recompute that whole context; new or short work spreads).
        allowed = [b for b in within if b in costs]
        if (allowed and len(allowed) < len(costs)
                and min(ttft[b] for b in allowed) - min(ttft.values()) <= cfg.bound_cost_s):
            costs = {b: costs[b] for b in allowed}
        allowed = list(costs)
        if session_start and best_matched > 0:  # changed: the work already there, the live sessions it evicts
            costs = self._session_costs(request, costs, matched, busy_of, capacity_of, factor, state, now)
        best_cost = min(costs.values())
        band = max(cfg.tie_s, cfg.tie_fraction * best_cost)
        near = [b for b in allowed if costs[b] <= best_cost + band]
        best_match = max(cands[b].matched for b in near)
        if best_matched > 0 and len(set(matched.values())) == 1:
            # changed: every backend holds the same prefix: the pure load balancer (``policies/balance.py``)
            if session_start:  # a session's first request: the backend that started fewest sessions
                tied = [self._starts.next_of(list(costs), load)]
                self._starts.record(tied[0])
            else:
                tied = least_waiting(list(costs), load, now)
            anchor = request.keys[0]
            if len(tied) == 1:
                backend = tied[0]
            elif is_idle(tied[0], load, now):  # equal idle backends: the prefix's home; working ones: the rotation
                backend = min(tied, key=lambda b: (-state.rendezvous.weight(anchor, b), b))
            else:
                backend = self._rotation.next_of(tied, load)
            reason = "prefix_match"
        elif best_match > 0:
            holders = [b for b in near if cands[b].matched == best_match]
            cheapest = min(costs[b] for b in holders)  # the one change since e9da8e7: equal holders, cheapest
            holders = [b for b in holders if costs[b] == cheapest]
            if len(holders) == 1:
                backend = holders[0]
            else:
                anchor = request.keys[0]
                backend = min(holders, key=lambda b: (-state.rendezvous.weight(anchor, b), b))
            reason = "prefix_match" if best_match >= top_holder else "prefix_spill"
        else:
            anchor = request.keys[0] if request.keys else None  # exact ties: the prefix's rendezvous order
            backend = min(near, key=lambda b: (load.busy(b, now), load.last_pick(b), costs[b],
                                               0 if anchor is None else -state.rendezvous.weight(anchor, b), b))
            reason = "cold" if top_holder == 0 else "prefix_spill"
        self._rotation.record(backend)  # changed: the balancer's rotation counts every pick
        chosen = cands[backend]
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
            wasted_prefill_tokens=best_matched - chosen.matched,  # changed: the decision reports it
        )
