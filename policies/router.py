"""The ``Router``: one façade over fingerprinting, the prefix index, load tracking and policies.

Used identically by the LiteLLM plugin and the simulators. A request's life is ``pick`` (charge load, insert
its blocks), optionally ``on_attempt`` / ``on_first_token`` / ``on_answered``, then ``finish`` once per attempt:
load, index, the policy (``observe``) and health, in that order, in one place. ``pick`` never raises: any
internal error falls back to least-load and is recorded on the decision; lifecycle calls are idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.policies.attempts import Attempts, RoutedAttempt
from kvroute.policies.base import Policy, RoutingState, least_loaded
from kvroute.policies.decision import Decision
from kvroute.policies.fingerprint import FingerprintConfig, Fingerprinter
from kvroute.policies.lifecycle import CANCELLED, SUCCESS, FleetView, HealthSink, RequestOutcome
from kvroute.policies.load import ExternalSignal, LoadTracker
from kvroute.policies.prefix_index import PrefixIndex, PrefixIndexConfig, PrefixLocator
from kvroute.policies.registry import DEFAULT_POLICY, build_policy
from kvroute.policies.request import RoutingRequest

_RATIO_RATE = 0.05  # weight of one answered request in the engine-token ratio's decayed sums


@dataclass(slots=True)
class RouterConfig:
    """Router-wide settings; per-group policies are set with ``Router.set_policy``."""

    default_policy: str = DEFAULT_POLICY
    default_knobs: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: FingerprintConfig = field(default_factory=FingerprintConfig)
    index: PrefixIndexConfig | None = None
    max_request_age_s: float = 900.0
    max_pending: int = 100_000
    load_half_life_s: float = 2.0


class Router:
    """Routing brain for many model groups; pass ``clock`` (seconds) to run on simulated time.

    ``index`` and ``load`` may be replaced (precise event-fed index, Redis-shared state) as long as
    they keep the ``PrefixLocator`` / ``LoadTracker`` contracts.
    """

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        index: PrefixLocator | None = None,
        load: LoadTracker | None = None,
        health: HealthSink | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self.health = health
        self.group_state: dict[str, Any] = {}  # shared by the policies this router serves (``FleetView.group_state``)
        self.clock = clock
        fp = self.config.fingerprint
        self.fingerprinter = Fingerprinter(fp)
        index_config = self.config.index or PrefixIndexConfig(block_tokens=fp.block_bytes / fp.bytes_per_token)
        self.index: PrefixLocator = index if index is not None else PrefixIndex(index_config)
        # an index that sizes entries in the engine's tokens (the llama.cpp prompt index) takes them from answers;
        # bound once here, not looked up per request
        self._learn_size: Callable[[str, Sequence[int], int], None] | None = self.index.learn_size
        self._set_token_ratio: Callable[[float], None] | None = self.index.set_token_ratio
        tracker = load if load is not None else LoadTracker(self.config.load_half_life_s)
        self.state = RoutingState(index=self.index, load=tracker, computed=self._confirmed_prefix)
        self._policies: dict[str, Policy] = {}
        self._default = build_policy(self.config.default_policy, self.config.default_knobs, "default_policy")
        #: one record per open attempt, shared with the load tracker (which charges it), bounded by ``max_pending``
        self.attempts: Attempts = tracker.attempts
        self._provisional: dict[str, dict[int, int]] = {}  # backend -> key -> pending picks computing it
        self.errors = 0
        #: fill ``Decision.inputs`` with what the pick saw (``trace_inputs``): off on the hot path by default
        self.tracing = False
        #: engine tokens per estimated token (the engines' reported prompt tokens over the fingerprint's count,
        #: learned): engine-reported cached tokens and KV capacities are converted into the index's tokens
        self.token_ratio = 1.0
        self._engine_tokens = 0.0  # decayed sums of the engines' prompt tokens and the estimates of them
        self._estimated_tokens = 0.0
        self._capacity_tokens: dict[str, int] = {}  # per backend, in engine tokens (config or engine metrics)
        # what the feeds heard on their own threads, applied by the next pick on the router's (``_settle_feeds``)
        self._emptied: dict[str, float | None] = {}  # restarted engines: backend -> ``before``
        self._capacity_heard: dict[str, int] = {}  # reported KV capacities: backend -> engine tokens
        self._capacity_ratio = 1.0  # the ratio the index's capacities were last set with

    @property
    def load(self) -> LoadTracker:
        return self.state.load

    # --- configuration --------------------------------------------------------------------------
    def set_policy(self, group: str, name: str, knobs: Mapping[str, Any] | None = None) -> Policy:
        """Use policy ``name`` (with ``knobs``) for model group ``group``; raises ``ConfigError``."""
        policy = build_policy(name, knobs, where=f"groups.{group}")
        self._policies[group] = policy
        return policy

    def set_policy_object(self, group: str, policy: Policy) -> None:
        """Install a ready-made policy object (baselines, tests)."""
        self._policies[group] = policy

    def policy_for(self, group: str | None) -> Policy:
        if group is None:
            return self._default
        return self._policies.get(group, self._default)

    # --- the request path -----------------------------------------------------------------------
    def fingerprint(self, kwargs: Mapping[str, Any], **fields: Any) -> RoutingRequest:
        return self.fingerprinter.from_kwargs(kwargs, **fields)

    def pick(
        self,
        request: RoutingRequest,
        candidates: Sequence[str],
        *,
        group: str | None = None,
        policy: Policy | None = None,
        record: bool = True,
    ) -> Decision:
        """Choose a backend among ``candidates`` and charge it; never raises."""
        if self._emptied or self._capacity_heard:
            self._settle_feeds()
        now = self.clock()
        chosen = policy or self.policy_for(group if group is not None else request.model)
        inputs = self.trace_inputs(request, candidates, now) if self.tracing else None
        try:
            if not candidates:
                return Decision(None, chosen.name, "no_candidates", prompt_tokens=request.prompt_tokens,
                                request_id=request.request_id)
            decision = chosen.select(request, candidates, self.state, now)
            if decision.backend is not None and decision.backend not in candidates:
                raise ValueError("policy chose a backend outside the candidates")
        except Exception as exc:
            self.errors += 1
            try:
                backend = least_loaded(candidates, self.state, now)
            except Exception:
                backend = candidates[0] if candidates else None
            decision = Decision(backend, chosen.name, "fallback", prompt_tokens=request.prompt_tokens,
                                fallback=f"{type(exc).__name__}: {exc}"[:200], request_id=request.request_id,
                                predicted_prefill_tokens=request.prompt_tokens)
        if decision.wasted_prefill_tokens is None and decision.backend is not None:
            decision.wasted_prefill_tokens = self._wasted_prefill(request, candidates, decision.backend, now)
        if record and decision.backend is not None:
            self._record(request, decision, now)
        decision.inputs = inputs
        return decision

    def trace_inputs(self, request: RoutingRequest, candidates: Sequence[str], now: float) -> dict[str, object]:
        """What a pick sees, per candidate, before it records anything: matched tokens (the index's belief),
        of them still being prefilled by another pending request, and the load (numbers only, no prompt text)."""
        load = self.state.load
        bt = request.block_tokens
        try:
            matches = self.index.match(request.keys, candidates, now) if request.keys else {}
        except Exception:
            matches = {}
        per: dict[str, object] = {}
        evictions = self.index.evictions
        capacity = self.index.capacity_blocks
        for b in candidates:
            blocks = matches.get(b, 0)
            view = load.view(b, now)
            per[b] = {"matched": int(blocks * bt),
                      "evicts": None if evictions is None else round(evictions(b, request.keys, now), 1),
                      "capacity": None if capacity is None else int(capacity(b) * bt),
                      "computed": int(self._confirmed_prefix(b, request.keys, blocks) * bt),
                      "inflight": view.inflight, "queue_tokens": round(view.queue_tokens, 1),
                      "running": view.running, "kv_usage": round(view.kv_usage, 4),
                      "work_s": round(load.work_s(b, now), 6), "busy_s": round(load.busy(b, now), 6),
                      "live_sessions": round(self.state.live.at_risk(b, 0, now), 1),
                      "factor": round(load.backend_factor(b), 4)}
        grown = self.state.live.growth(request.keys[0]) if request.keys else 0.0
        return {"t": round(now, 6), "prompt_tokens": request.prompt_tokens, "session": request.session_key is not None,
                "session_growth": round(grown, 1),
                "index": type(self.index).__name__, "token_ratio": round(self.token_ratio, 3), "candidates": per}

    def _wasted_prefill(self, request: RoutingRequest, candidates: Sequence[str], backend: str, now: float) -> int:
        """``Decision.wasted_prefill_tokens`` from the index, for policies that match nothing themselves:
        the longest other candidate's matched tokens minus ``backend``'s (both capped at ``prompt_tokens - 1``,
        as ``cache_aware`` counts them), floored at 0; 0 if the index cannot tell."""
        keys = request.keys
        if not keys or len(candidates) < 2:
            return 0
        try:
            matches = self.index.match(keys, candidates, now)
        except Exception:
            self.errors += 1
            return 0
        if not matches:
            return 0
        other = max((n for b, n in matches.items() if b != backend), default=0)
        if other == 0:
            return 0
        top = request.prompt_tokens - 1
        bt = request.block_tokens
        best = min(top, int(other * bt))
        own = min(top, int(matches.get(backend, 0) * bt))
        return best - own if best > own else 0

    def route(self, kwargs: Mapping[str, Any], candidates: Sequence[str], *, group: str | None = None,
              **fields: Any) -> tuple[RoutingRequest, Decision]:
        """Fingerprint and pick in one call."""
        request = self.fingerprint(kwargs, **fields)
        return request, self.pick(request, candidates, group=group)

    def _record(self, request: RoutingRequest, decision: Decision, now: float) -> None:
        """Charge load and insert the blocks at once, so siblings of a burst see them immediately."""
        assert decision.backend is not None
        rid = request.request_id or ""
        try:
            backend = decision.backend
            keys = request.keys
            load = self.state.load
            load.start(rid, backend, decision.predicted_prefill_tokens, now, work_s=decision.work_s,
                       ttft_s=decision.predicted_ttft_s, fixed_s=decision.fixed_wait_s)
            self.index.record(backend, keys, now)
            if request.session_key is not None:
                self.state.live.sent(request.session_key, keys[0] if keys else 0, backend, request.prompt_tokens, now)
            matched = decision.matched_blocks
            confirmed = self._confirmed_prefix(backend, keys, matched)
            self._mark_provisional(backend, keys, matched)
            attempts = self.attempts
            record = attempts.get(rid)
            if record is None:  # a load tracker that keeps no record of it: the router holds one of its own
                record = RoutedAttempt(rid, backend, now, charged=False)
                attempts.put(record)
            record.request, record.matched_blocks, record.confirmed_blocks = request, matched, confirmed
            while len(attempts) > self.config.max_pending:
                old = attempts.oldest()
                assert old is not None
                load.release(old.request_id)
                attempts.pop(old.request_id)
                self._settle(old)
        except Exception:
            self.errors += 1

    # --- provisional blocks: inserted at pick, computed only once that request's prefill is done ---
    def _confirmed_prefix(self, backend: str, keys: Sequence[int], matched: int) -> int:
        """Leading matched blocks not still being prefilled by another pending request on ``backend``."""
        prov = self._provisional.get(backend)
        if not prov or matched == 0:
            return matched
        if keys[0] in prov:
            return 0
        if keys[matched - 1] not in prov:
            return matched
        lo, hi = 1, matched - 1  # keys[lo-1] computed, keys[hi] provisional: find the first provisional
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] in prov:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _mark_provisional(self, backend: str, keys: Sequence[int], start: int) -> None:
        if start >= len(keys):  # every block already held: nothing of this request is being computed
            return
        prov = self._provisional.setdefault(backend, {})
        get = prov.get
        for key in keys[start:]:
            prov[key] = get(key, 0) + 1

    def _settle(self, pending: RoutedAttempt) -> None:
        """The request's own new blocks are computed (or never will be): they stop being provisional."""
        if pending.settled or pending.request is None:
            return
        pending.settled = True
        prov = self._provisional.get(pending.backend)
        if prov is None:
            return
        for key in pending.request.keys[pending.matched_blocks:]:
            count = prov.get(key)
            if count is None:
                continue
            if count <= 1:
                del prov[key]
            else:
                prov[key] = count - 1
        if not prov:
            del self._provisional[pending.backend]

    # --- lifecycle ------------------------------------------------------------------------------
    def finish(self, request: RoutingRequest, outcome: RequestOutcome, *, policy: Policy | None = None) -> None:
        """One routed attempt of ``request`` ended: release its load and settle the index (``on_complete``,
        ``on_failure`` or ``on_cancel`` by ``outcome.kind``), let the policy that picked it (``policy``, else the
        request's group's) ``observe`` it, then tell ``health`` (when the outcome names a breaker word)."""
        rid = request.request_id or ""
        if outcome.kind == SUCCESS:
            backend = outcome.backend or self.pending_backend(rid)
            if outcome.prompt_tokens and request.prompt_tokens > 0:
                self.learn_token_ratio(outcome.prompt_tokens, request.prompt_tokens)
            ratio = self.token_ratio
            cached = outcome.cached_tokens
            self.on_complete(rid, cached_tokens=None if cached is None else int(cached / ratio),
                             backend=outcome.backend)
            if self._learn_size is not None and backend is not None and outcome.prompt_tokens:
                self._learn_size(backend, request.keys, outcome.prompt_tokens + (outcome.output_tokens or 0))
            if outcome.output_tokens:
                self.state.load.learn_output(outcome.output_tokens)
            if backend is not None:  # the conversation so far now sits there, answer included
                held = request.prompt_tokens + int((outcome.output_tokens or 0) / ratio)
                self.state.homes.answered(request.session_key, backend, request.keys, held)
                self.state.live.answered(request.session_key, backend, held)  # ended in on_complete; its size
        elif outcome.kind == CANCELLED:
            self.on_cancel(rid)
        else:
            self.on_failure(rid, before_prefill=outcome.before_prefill)
        (policy or self.policy_for(request.model)).observe(request, outcome)
        if self.health is not None and outcome.backend is not None and outcome.health is not None:
            self.health.record(outcome.backend, outcome.health, outcome.at, retry_after_s=outcome.retry_after_s,
                               ttft_s=outcome.ttft_s, started_at=outcome.started_at)

    # --- engine tokens ----------------------------------------------------------------------------
    def learn_token_ratio(self, engine_tokens: int, estimated_tokens: int) -> None:
        """One answered request's prompt tokens as its engine counted them and as the fingerprint estimated them:
        the ratio of their decayed sums (long prompts weigh more than a short one, whose chat template dominates);
        the index's capacities follow once it moved by more than 5 %."""
        if estimated_tokens < 64 or not 0.05 <= engine_tokens / estimated_tokens <= 20.0:
            return  # too short to tell, or a report no tokenizer gives
        keep = 1.0 - _RATIO_RATE
        self._engine_tokens = keep * self._engine_tokens + engine_tokens
        self._estimated_tokens = keep * self._estimated_tokens + estimated_tokens
        self.token_ratio = self._engine_tokens / self._estimated_tokens
        if self._set_token_ratio is not None:
            self._set_token_ratio(self.token_ratio)
        if abs(self.token_ratio / self._capacity_ratio - 1.0) > 0.05:
            self._capacity_ratio = self.token_ratio
            for backend, tokens in self._capacity_tokens.items():
                self._apply_capacity(backend, tokens)

    def set_capacity(self, backend: str, engine_tokens: int) -> None:
        """A backend's KV capacity in the engine's tokens (from configuration), applied now."""
        self._capacity_tokens[backend] = engine_tokens
        self._apply_capacity(backend, engine_tokens)

    def capacity_heard(self, backend: str, engine_tokens: int) -> None:
        """A backend's KV capacity as its engine reports it. Safe from any thread: the next pick applies it (a
        smaller capacity evicts in the index, which only the router's own thread changes)."""
        self._capacity_heard[backend] = engine_tokens

    def _apply_capacity(self, backend: str, engine_tokens: int) -> None:
        setter = self.index.set_capacity
        if setter is not None:
            setter(backend, max(1, int(engine_tokens / self._capacity_ratio)))

    def bind(self, policy: Policy, fleet: FleetView) -> None:
        """Hand ``policy`` its fleet, with this router's group state (one per model group)."""
        policy.bind(replace(fleet, group_state=self.group_state))

    def on_attempt(self, request_id: str, backend: str) -> None:
        """LiteLLM sent the request to ``backend`` (a retry may differ from the pick): follow it."""
        pending = self._routed(request_id)
        if pending is None or pending.request is None or pending.backend == backend:
            return
        now = self.clock()
        self._settle(pending)
        keys = pending.request.keys
        self.index.forget(pending.backend, keys, pending.matched_blocks)
        matched = self.index.match(keys, [backend], now).get(backend, 0)
        self.state.load.move(request_id, backend, now)  # the charge follows (on the same record)
        pending.backend, pending.matched_blocks, pending.settled = backend, matched, False
        pending.confirmed_blocks = self._confirmed_prefix(backend, keys, matched)
        self._mark_provisional(backend, keys, matched)
        self.index.record(backend, keys, now)

    def on_first_token(self, request_id: str) -> None:
        """Prefill done: release prefill load; the request's blocks are now really on the backend."""
        self.state.load.first_token(request_id, self.clock())
        pending = self._routed(request_id)
        if pending is not None:
            self._settle(pending)

    def on_answered(self, request_id: str) -> None:
        """The backend's answer is back (its outcome may be reported later): release the request's load now, so
        the next request does not see a replica that has finished as still busy. ``on_complete`` still
        confirms the index (its own release is then a no-op)."""
        now = self.clock()
        self.state.load.release(request_id, now)
        pending = self._routed(request_id)
        if pending is not None and pending.answered_at is None:
            pending.answered_at = now

    def on_complete(self, request_id: str, cached_tokens: int | None = None,
                    backend: str | None = None) -> None:
        """Release load and confirm the index with the reported cached-token count (if any).

        Only blocks that were already computed at pick time count as predictions, so a sibling that
        raced its burst's first request does not teach the index that the backend evicts early.
        """
        pending = self._end(request_id, self.clock())
        if pending is None:
            return
        self._settle(pending)
        if cached_tokens is not None:
            bt = pending.request.block_tokens
            cached_blocks = int(cached_tokens // bt) if bt > 0 else 0
            self.index.confirm(backend or pending.backend, pending.request.keys, cached_blocks, self.clock(),
                               predicted_blocks=pending.confirmed_blocks)

    def on_failure(self, request_id: str, *, before_prefill: bool = True) -> None:
        """Release load; blocks the backend never computed are taken back out of the index."""
        pending = self._end(request_id)
        if pending is None:
            return
        self._settle(pending)
        if before_prefill:
            self.index.forget(pending.backend, pending.request.keys, pending.matched_blocks)

    def on_cancel(self, request_id: str) -> None:
        """A cancelled request releases its load; what it prefilled may stay cached."""
        pending = self._end(request_id)
        if pending is not None:
            self._settle(pending)

    def _routed(self, request_id: str) -> RoutedAttempt | None:
        """The open attempt this router picked under ``request_id`` (None: none, or charged by the tracker alone)."""
        record = self.attempts.get(request_id)
        return record if record is not None and record.request is not None else None

    def _end(self, request_id: str, now: float | None = None) -> RoutedAttempt | None:
        """The attempt ended: release its load (``now``: learn its decode time) and stop holding its record,
        which is returned (None when this router held none)."""
        pending = self._routed(request_id)
        self.state.load.release(request_id, now)
        if pending is not None:
            self.attempts.pop(request_id)
            if pending.request.session_key is not None:
                self.state.live.ended(pending.request.session_key, pending.backend,
                                      self.clock() if now is None else now)
        return pending

    def pending_backend(self, request_id: str) -> str | None:
        pending = self._routed(request_id)
        return pending.backend if pending else None

    def expire(self) -> int:
        """Release requests older than ``max_request_age_s`` (callbacks that never came)."""
        now = self.clock()
        max_age = self.config.max_request_age_s
        released = self.state.load.expire(now, max_age)
        for p in [p for p in self.attempts if p.request is not None and not p.charged
                  and (p.answered_at is None or now - p.answered_at > max_age)]:
            self.attempts.pop(p.request_id)
            self._settle(p)
        return released

    # --- fleet changes and signals --------------------------------------------------------------
    def observe(self, backend: str, signal: ExternalSignal) -> None:
        self.state.load.observe(backend, signal)

    def engine_emptied(self, backend: str, before: float | None = None) -> None:
        """``backend``'s engine restarted, after ``before`` (None: at an unknown time) and before now. Safe from
        any thread: the next pick, on the router's own, applies it (``_settle_feeds``) before it reads the
        index."""
        self._emptied[backend] = before

    def _settle_feeds(self) -> None:
        """Apply what the feeds heard since the last pick: reported capacities, then restarts. A restarted
        engine's part of the index forgets what the old engine held and keeps what the new one was given since
        ``before`` where it knows when (the restart is seen a scrape late); an index without ``forget_before`` is
        emptied whole, and its own ``confirm`` puts back what the requests then in flight computed. The backend,
        its capacity and its load stay."""
        while self._capacity_heard:
            backend, tokens = self._capacity_heard.popitem()
            self.set_capacity(backend, tokens)
        while self._emptied:
            backend, before = self._emptied.popitem()
            forget_before = self.index.forget_before
            if forget_before is not None and before is not None:
                forget_before(backend, before)
                continue
            self.index.remove_backend(backend)
            tokens = self._capacity_tokens.get(backend)
            if tokens is not None:
                self._apply_capacity(backend, tokens)

    def remove_backend(self, backend: str) -> None:
        self._emptied.pop(backend, None)
        self._capacity_heard.pop(backend, None)
        self.index.remove_backend(backend)
        self._capacity_tokens.pop(backend, None)
        self.state.homes.forget(backend)
        self.state.live.forget(backend)
        self.state.load.remove_backend(backend)
        for p in [p for p in self.attempts if p.backend == backend and p.request is not None]:
            self.attempts.pop(p.request_id)
        self._provisional.pop(backend, None)
