"""``ClassScores``: ``cache_aware``'s predicted TTFT and cost per backend, scored once per class of backends.

Backends whose scorer inputs are equal but for the cache they hold form a class: one ``Candidate`` and one pass of
the scorers before the first that reads ``resident_tokens`` (``RESIDENT_SCORERS``) per class, the rest per backend;
every sum adds the same terms in the same order as scoring each backend alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvroute.policies.load import SCORING_FIELDS
from kvroute.policies.scorers import Candidate, eviction
from kvroute.policies.speed import EngineSpeed

_WORK, _QUEUED, _DECODE = (SCORING_FIELDS.index(n) for n in ("work_s", "queued", "decode_s"))

Term = tuple[Callable[[Candidate, EngineSpeed], float], float]


class ClassScores:
    """TTFT (``ttft``) and cost (``cost``) per scored backend, with its ``candidate``, ``resident`` tokens and
    ``evicts`` (the index's eviction estimate, -1 without one); ``score`` adds backends, several calls allowed."""

    def __init__(self, *, keys: Sequence[int], now: float, index: Any, capacity_of: Callable[[str], int] | None,
                 matched: dict[str, int], block_tokens: float, prompt: int, own_by_match: dict[int, float],
                 speed: EngineSpeed, view_of: Callable[[str, float], Any], factor: float, best_matched: int,
                 best_own: float, output: float, reserved: bool,
                 terms: tuple[list[Term], list[Term], list[Term], list[Term]],
                 member_resident: tuple[bool, ...]) -> None:
        self.keys, self.now, self.index, self.capacity_of = keys, now, index, capacity_of
        self.matched, self.block_tokens, self.prompt, self.own_by_match = matched, block_tokens, prompt, own_by_match
        self.speed, self.view_of, self.factor, self.output = speed, view_of, factor, output
        self.best_matched, self.best_own, self.reserved = best_matched, best_own, reserved
        self.terms, self.member_resident = terms, member_resident
        # one pass over the index for every scored backend's residency and capacity where it offers one
        self.holdings = index.holdings if capacity_of is not None else None
        self.evictions_of = index.evictions
        self.blocks_of = index.blocks
        self.classes: dict[tuple[object, ...], tuple[Any, ...]] = {}
        self.ttft: dict[str, float] = {}
        self.cost: dict[str, float] = {}
        self.candidate: dict[str, Candidate] = {}
        self.resident: dict[str, float] = {}
        self.evicts: dict[str, float] = {}

    def score(self, backends: Sequence[str], states: Sequence[tuple[object, ...]]) -> None:
        """Score ``backends`` (``states``: their scorer inputs from ``LoadTracker.scoring_inputs``)."""
        capacity_of, holdings, evictions_of = self.capacity_of, self.holdings, self.evictions_of
        matched, resident, evicts, classes = self.matched, self.resident, self.evicts, self.classes
        ttft_of, cost_of, cand_of, own_by_match = self.ttft, self.cost, self.candidate, self.own_by_match
        bt, prompt, keys, now, speed = self.block_tokens, self.prompt, self.keys, self.now, self.speed
        prefill_s, view_of, factor, output = speed.prefill_s, self.view_of, self.factor, self.output
        best_matched, best_own, reserved = self.best_matched, self.best_own, self.reserved
        class_ttft, class_more, member_ttft, member_more = self.terms
        member_resident = self.member_resident
        if holdings is not None:
            blocks, caps = holdings(backends)
        else:
            blocks, caps = [], []
            blocks_of = self.blocks_of
            for b in backends:  # capacity first, then blocks, per backend (as the index is asked alone)
                caps.append(capacity_of(b) if capacity_of is not None else 0)
                blocks.append(blocks_of(b))
        last_key: tuple[object, ...] | None = None
        got = None
        for b, st, nblocks, cap_blocks in zip(backends, states, blocks, caps, strict=True):
            m = matched[b]
            res = resident[b] = nblocks * bt
            ev = evicts[b] = evictions_of(b, keys, now) if evictions_of is not None else -1.0
            key = (m, cap_blocks, st)
            # neighbours are mostly of one class: an equality test is cheaper than hashing the key
            if last_key is None or key != last_key:
                got = classes.get(key)
                last_key = key
            if got is None:
                own_s = own_by_match.get(m)
                if own_s is None:
                    own_s = own_by_match[m] = prefill_s(prompt - m, m)
                c = Candidate(b, prompt, m, view_of(b, now), factor, st[_WORK], st[_QUEUED], st[_DECODE],
                              res, cap_blocks * bt, best_matched, own_s, best_own, output, reserved, ev)
                t = 0.0
                for f, w in class_ttft:
                    t += w * f(c, speed)
                u = t
                for f, w in class_more:
                    u += w * f(c, speed)
                # per-backend cost terms: (scorer, weight) where it reads the residency, else (None, value)
                tail = tuple((f, w) if per_backend else (None, w * f(c, speed))
                             for (f, w), per_backend in zip(member_more, member_resident, strict=True))
                # the class's cost where the eviction term is 0 (new blocks fit): the same sum, once
                u0 = None
                if not member_ttft and all(f is None or f is eviction for f, _ in tail):
                    u0 = u
                    for f, w in tail:
                        u0 += w if f is None else w * 0.0
                cap_t = cap_blocks * bt
                unc = prompt - m
                classes[key] = got = (c, t, u, tail, u0, cap_t, unc)
            else:
                c, t, u, tail, u0, cap_t, unc = got
                c.resident_tokens = res
                c.evicts = ev
            if u0 is not None:
                free = cap_t - res
                if ev == 0.0 if ev >= 0 else cap_t <= 0 or (free if free > 0.0 else 0.0) >= unc:  # eviction() 0
                    ttft_of[b] = t
                    cost_of[b] = u0
                    cand_of[b] = c
                    continue
            if member_ttft:
                for f, w in member_ttft:
                    t += w * f(c, speed)
                u = t
            for f, w in tail:
                if f is None:
                    u += w
                elif f is eviction:  # eviction(c, speed) inline, the same arithmetic (tests/policies check it)
                    cap_t = c.capacity_tokens
                    if ev >= 0:
                        u += w * (0.0 if ev <= 0 else c.factor * prefill_s(ev))
                    elif cap_t <= 0:
                        u += w * 0.0
                    else:
                        free = cap_t - res
                        evicted = c.uncached - (free if free > 0.0 else 0.0)
                        u += w * (0.0 if evicted <= 0 else c.factor * prefill_s(evicted))
                else:
                    u += w * f(c, speed)
            ttft_of[b] = t
            cost_of[b] = u
            cand_of[b] = c
