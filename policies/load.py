"""Load tracking: router-side in-flight work per backend plus aged external signals.

Router-side counts react within a burst (updated at pick); external signals (engine queue depth, KV
usage) come with their age and weigh less as they get stale (exponential decay, ``half_life_s``). A reading's
waiting requests also shrink by one for each of the router's requests that left that backend since the reading
(each departure frees a slot for one of them), so a reading taken behind the router's own burst does not outlive it.

Work is also kept in seconds: each pick may carry its predicted own-prefill seconds (``work_s``, from the
``EngineSpeed`` prior) and its predicted time to first token; the tracker keeps the outstanding work per
backend as a function of time (``work_s(backend, now)``: the queue drains in order), learns a per-backend
factor *observed TTFT / predicted TTFT* (log-space moving average), the mean decode duration (first token →
completion), and a decayed sum of the busy seconds assigned to each backend (the hot-spot bound's measure).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.policies.attempts import Attempts, RoutedAttempt

_REBASE_HALVINGS = 256.0  # 2**256 of scale stays far from float overflow (2**1024)


@dataclass(slots=True)
class ExternalSignal:
    """Engine-reported load at time ``at``: waiting requests, running requests, KV usage in [0, 1]."""

    at: float
    queue_depth: float | None = None
    running: float | None = None
    kv_usage: float | None = None


@dataclass(slots=True)
class BackendLoad:
    """A backend's load as a policy sees it at one instant."""

    inflight: int
    prefill_tokens: int
    queue_tokens: float
    running: int
    kv_usage: float
    last_pick: float


#: what ``LoadTracker.scoring_inputs`` returns per backend, in order: every ``BackendLoad`` field but
#: ``last_pick`` (the picker's, never a scorer's), then the tracker's own per-backend figures
SCORING_FIELDS = ("inflight", "prefill_tokens", "queue_tokens", "running", "kv_usage", "work_s", "queued", "decode_s")


class LoadTracker:
    """In-flight requests and prefill tokens per backend; ``release`` is idempotent. Each charged request is a
    record in ``attempts`` (the ``Router`` keeps its own part of the attempt on the same record)."""

    #: weight of a new sample in the learned speed factor and decode duration (moving averages)
    learn_rate = 0.1
    #: half-life of the assigned-busy-seconds sum the hot-spot bound reads
    busy_half_life_s = 60.0

    def __init__(self, half_life_s: float = 2.0, mean_prompt_tokens: float = 1024.0) -> None:
        self.half_life_s = half_life_s
        self._work: dict[str, float] = {}
        self._queued: dict[str, int] = {}  # requests not yet at first token
        # per backend: its requests not yet at first token, in the order they were charged, and when the first of
        # them became the first (``work_s`` drains it from then on)
        self._pending: dict[str, dict[str, RoutedAttempt]] = {}
        self._head_since: dict[str, float] = {}
        self._log_factor: dict[str, float] = {}
        self._log_factor_all: float | None = None
        self._decode_s: dict[str, float] = {}
        self._decode_all: float | None = None
        self._output: float | None = None
        # backend -> busy seconds scaled to the epoch ``_busy_ref``: busy(now) = value * 0.5 ** ((now - ref) / half),
        # so a pick decays every backend's busy time with one pow (rebased before the scale could overflow)
        self._busy: dict[str, float] = {}
        self._busy_ref: float | None = None
        self.attempts = Attempts()  # the open attempts, charged or (held by a router) answered
        self._inflight: dict[str, int] = {}
        self._prefill: dict[str, int] = {}
        self._last_pick: dict[str, float] = {}
        self._signals: dict[str, ExternalSignal] = {}
        # per backend: how many requests left it (a slot freed), when the last few left, and how many had left
        # before its current reading was taken
        self._left: dict[str, int] = {}
        self._left_at: dict[str, deque[float]] = {}
        self._left_base: dict[str, int] = {}
        self._fresh_memo: tuple[float, float] = (math.nan, 1.0)
        self._mean_prompt = mean_prompt_tokens
        cls = type(self)
        self._overridden = any(getattr(cls, name) is not getattr(LoadTracker, name)
                               for name in ("view", "work_s", "queued", "decode_s", "last_pick", "freshness"))

    # --- request lifecycle ----------------------------------------------------------------------
    def start(self, request_id: str, backend: str, prefill_tokens: int, now: float, *, work_s: float = 0.0,
              ttft_s: float = 0.0, fixed_s: float = 0.0) -> None:
        """Charge a picked request to its backend (called at pick time, before the call is made).

        ``work_s``: its own prefill in prior seconds; ``ttft_s``/``fixed_s``: its predicted time to first
        token, in prior seconds / already-real seconds (both 0 when the policy predicts nothing).
        """
        old = self.attempts.get(request_id)
        if old is not None and old.charged:
            self.release(request_id)
        prefill_tokens = max(0, int(prefill_tokens))
        work_s = work_s if work_s > 0 and math.isfinite(work_s) else 0.0
        record = RoutedAttempt(request_id, backend, now, prefill_tokens, False, work_s, ttft_s, fixed_s)
        self.attempts.put(record)
        self._charge(record, now)

    def _charge(self, record: RoutedAttempt, now: float) -> None:
        """Add ``record`` to its backend's counts, prefill queue and busy time."""
        backend, prefill_tokens, work_s = record.backend, record.prefill_tokens, record.work_s
        self._inflight[backend] = self._inflight.get(backend, 0) + 1
        self._prefill[backend] = self._prefill.get(backend, 0) + prefill_tokens
        if work_s:
            self._work[backend] = self._work.get(backend, 0.0) + work_s
        self._queued[backend] = self._queued.get(backend, 0) + 1
        pending = self._pending.setdefault(backend, {})
        if not pending:
            self._head_since[backend] = now
        pending[record.request_id] = record
        self._last_pick[backend] = now
        self._mean_prompt = 0.98 * self._mean_prompt + 0.02 * max(prefill_tokens, 1)
        if work_s:
            n = max(1, self._inflight[backend])
            self.add_busy(backend, self.factor(backend) * work_s + self.decode_s(backend) / n, now)

    def move(self, request_id: str, backend: str, now: float) -> None:
        """The request went to another backend than picked (LiteLLM retry): move its charge."""
        req = self.attempts.get(request_id)
        if req is None or not req.charged or req.backend == backend:
            return
        work = req.work_s
        self.release(request_id)
        # charged anew on the same record, the newest; its TTFT prediction was for the other backend
        req.backend, req.started, req.prefill_done, req.work_s, req.charged = backend, now, False, work, True
        req.ttft_s, req.fixed_s, req.first_at = 0.0, 0.0, -1.0
        self.attempts.put(req)
        self._charge(req, now)

    def first_token(self, request_id: str, now: float | None = None) -> None:
        """Prefill finished: the request no longer holds prefill work, only a decode slot.

        With ``now``, the observed time to first token teaches the backend's speed factor.
        """
        req = self.attempts.get(request_id)
        if req is None or not req.charged or req.prefill_done:
            return
        req.prefill_done = True
        self._prefill[req.backend] = max(0, self._prefill.get(req.backend, 0) - req.prefill_tokens)
        self._drop_work(request_id, req, now)
        if now is not None:
            req.first_at = now
            if req.ttft_s > 0:
                observed = now - req.started
                scaled = max(observed - req.fixed_s, 0.25 * observed)
                if scaled > 0:
                    self._learn_factor(req.backend, scaled / req.ttft_s)

    def release(self, request_id: str, now: float | None = None) -> str | None:
        """Completion, failure or cancellation; returns the backend it was charged to (or None).

        With ``now`` and a first token seen, the decode duration is learned.
        """
        req = self.attempts.get(request_id)
        if req is None or not req.charged:
            return None
        req.charged = False
        if req.request is None:  # no router holds it: the attempt ends here
            self.attempts.pop(request_id)
        self._inflight[req.backend] = max(0, self._inflight.get(req.backend, 0) - 1)
        if self._signals:  # departures discount engine readings: none scraped, none to count
            self._note_left(req.backend, now)
        if not req.prefill_done:
            self._prefill[req.backend] = max(0, self._prefill.get(req.backend, 0) - req.prefill_tokens)
            self._drop_work(request_id, req, now)
        elif now is not None and req.first_at >= 0:
            self._learn_decode(req.backend, max(0.0, now - req.first_at))
        return req.backend

    def _drop_work(self, request_id: str, req: RoutedAttempt, now: float | None) -> None:
        """``req`` left its backend's prefill queue; if it was the first, the next one's clock starts at ``now``
        (unknown: at the later of the old start and the next one's charge)."""
        self._queued[req.backend] = max(0, self._queued.get(req.backend, 0) - 1)
        pending = self._pending.get(req.backend)
        if pending:
            was_head = next(iter(pending)) == request_id
            pending.pop(request_id, None)
            if not pending:
                self._head_since.pop(req.backend, None)
            elif was_head:
                if now is None:
                    now = max(self._head_since[req.backend], next(iter(pending.values())).started)
                self._head_since[req.backend] = now
        if req.work_s:
            left = self._work.get(req.backend, 0.0) - req.work_s
            self._work[req.backend] = left if left > 1e-12 else 0.0
            req.work_s = 0.0

    # --- learned speed --------------------------------------------------------------------------
    def _learn_factor(self, backend: str, ratio: float) -> None:
        x = math.log(min(1e3, max(1e-3, ratio)))
        a = self.learn_rate
        old = self._log_factor.get(backend)
        self._log_factor[backend] = x if old is None else old + a * (x - old)
        old_all = self._log_factor_all
        self._log_factor_all = x if old_all is None else old_all + a * (x - old_all)

    def _learn_decode(self, backend: str, seconds: float) -> None:
        a = self.learn_rate
        old = self._decode_s.get(backend)
        self._decode_s[backend] = seconds if old is None else old + a * (seconds - old)
        old_all = self._decode_all
        self._decode_all = seconds if old_all is None else old_all + a * (seconds - old_all)

    def learn_output(self, tokens: int) -> None:
        """A completed request generated ``tokens`` output tokens (moving average; non-positive ones are ignored)."""
        if tokens > 0:
            old = self._output
            self._output = float(tokens) if old is None else old + self.learn_rate * (tokens - old)

    def output_tokens(self) -> float:
        """Learned mean output tokens of a completed request, fleet-wide (0 before any sample)."""
        return 0.0 if self._output is None else self._output

    def factor(self, backend: str) -> float:
        """Learned observed/predicted TTFT ratio (1 before any sample).

        Fleet-wide, not per backend: in the simulator per-backend factors fed back on themselves (a queue
        the model under-predicts raises that backend's factor, which pushes its sessions away, which
        raises it more: capped llm-d ladder 56 % hit with them, 94 % with one factor). ``backend_factor``
        keeps the per-backend estimate for reports.
        """
        x = self._log_factor_all
        return 1.0 if x is None else math.exp(x)

    def backend_factor(self, backend: str) -> float:
        x = self._log_factor.get(backend, self._log_factor_all)
        return 1.0 if x is None else math.exp(x)

    def decode_s(self, backend: str) -> float:
        """Learned mean decode duration of one request on ``backend`` (seconds; 0 before any sample)."""
        v = self._decode_s.get(backend, self._decode_all)
        return 0.0 if v is None else v

    def queued(self, backend: str) -> int:
        """Requests charged to ``backend`` that have not had their first token yet."""
        return self._queued.get(backend, 0)

    def work_s(self, backend: str, now: float) -> float:
        """Prefill work still outstanding on ``backend`` at ``now``, in prior seconds (unscaled). The queue drains
        in order: the first request not yet at first token has been computed since it became the first (elapsed
        time over the learned ``factor``, up to its own predicted prefill); the requests behind it wait whole."""
        work = self._work.get(backend, 0.0)
        if work <= 0.0:
            return work
        pending = self._pending.get(backend)
        if not pending:
            return work
        head = next(iter(pending.values())).work_s
        done = (now - self._head_since[backend]) / self.factor(backend)
        if done > head:
            done = head
        elif done < 0.0:
            done = 0.0
        return work - done if done < work else 0.0

    def add_busy(self, backend: str, seconds: float, now: float) -> None:
        ref = self._busy_ref
        if ref is None:
            ref = self._busy_ref = now
        elif (now - ref) / self.busy_half_life_s > _REBASE_HALVINGS:
            ref = self._rebase(now)
        grow = math.pow(2.0, (now - ref) / self.busy_half_life_s)
        self._busy[backend] = self._busy.get(backend, 0.0) + seconds * grow

    def _rebase(self, now: float) -> float:
        """Move the epoch to ``now`` (every stored value times the decay since the old epoch)."""
        k = self._scale(now)
        self._busy = {b: v * k for b, v in self._busy.items()}
        self._busy_ref = now
        return now

    def _scale(self, now: float) -> float:
        ref = self._busy_ref
        return 1.0 if ref is None or now <= ref else math.pow(0.5, (now - ref) / self.busy_half_life_s)

    def busy(self, backend: str, now: float) -> float:
        """Busy seconds assigned to ``backend`` recently (decayed with ``busy_half_life_s``)."""
        v = self._busy.get(backend)
        return 0.0 if v is None else v * self._scale(now)

    def utilization(self, busy: float) -> float:
        """The share of time a backend with ``busy`` decayed busy seconds has been working: the sum over the
        decay's mean life (``busy_half_life_s`` / ln 2), which a steady load of that share would reach."""
        return busy * math.log(2.0) / self.busy_half_life_s

    def busy_many(self, backends: Sequence[str], now: float) -> list[float]:
        """``[busy(b, now) for b in backends]`` in one call: one decay factor for all of them."""
        k = self._scale(now)
        get = self._busy.get
        return [get(b, 0.0) * k for b in backends]

    def backend_of(self, request_id: str) -> str | None:
        req = self.attempts.get(request_id)
        return req.backend if req is not None and req.charged else None

    def expire(self, now: float, max_age_s: float) -> int:
        """Release requests older than ``max_age_s`` (lost callbacks must not leak load forever)."""
        old = [r.request_id for r in self.attempts if r.charged and now - r.started > max_age_s]
        for rid in old:
            self.release(rid)
        return len(old)

    # --- external signals -----------------------------------------------------------------------
    def _note_left(self, backend: str, now: float | None) -> None:
        """One request left ``backend``; an unknown time counts as before any reading still to come."""
        self._left[backend] = self._left.get(backend, 0) + 1
        if now is not None:
            times = self._left_at.get(backend)
            if times is None:
                times = self._left_at[backend] = deque(maxlen=32)
            times.append(now)

    def observe(self, backend: str, signal: ExternalSignal) -> None:
        """Keep ``signal`` as ``backend``'s reading; departures the router saw after ``signal.at`` count against
        its waiting requests."""
        self._signals[backend] = signal
        after = 0
        # a copy taken in one step: the scraper's thread calls this while the router's thread may append
        for t in reversed(tuple(self._left_at.get(backend, ()))):
            if t <= signal.at:
                break
            after += 1
        self._left_base[backend] = self._left.get(backend, 0) - after

    def signal(self, backend: str) -> ExternalSignal | None:
        return self._signals.get(backend)

    def freshness(self, age_s: float) -> float:
        """Weight of a signal of this age: 1 when fresh, halving every ``half_life_s``."""
        if age_s <= 0:
            return 1.0
        return math.pow(0.5, age_s / self.half_life_s)

    def remove_backend(self, backend: str) -> None:
        for rid in [r.request_id for r in self.attempts if r.charged and r.backend == backend]:
            self.release(rid)
        self._inflight.pop(backend, None)
        self._prefill.pop(backend, None)
        self._last_pick.pop(backend, None)
        self._signals.pop(backend, None)
        for per_backend in (self._left, self._left_at, self._left_base):
            per_backend.pop(backend, None)
        self._work.pop(backend, None)
        self._queued.pop(backend, None)
        self._pending.pop(backend, None)
        self._head_since.pop(backend, None)
        self._busy.pop(backend, None)

    # --- views ----------------------------------------------------------------------------------
    def inflight(self, backend: str) -> int:
        return self._inflight.get(backend, 0)

    def prefill_tokens(self, backend: str) -> int:
        return self._prefill.get(backend, 0)

    def last_pick(self, backend: str) -> float:
        return self._last_pick.get(backend, -math.inf)

    def total_inflight(self, backends: Iterable[str]) -> int:
        return sum(self._inflight.get(b, 0) for b in backends)

    def scoring_inputs(self, backends: Sequence[str], now: float) -> tuple[list[tuple[Any, ...]], list[float]]:
        """What scorers read of each backend, in one pass: ``(inflight, prefill_tokens, queue_tokens, running,
        kv_usage, work_s, queued, decode_s)`` (the view's fields but ``last_pick``, then the three getters'
        values at ``now``) per backend, and each backend's ``last_pick``. Equal to calling ``view(b, now)``,
        ``work_s(b, now)``, ``queued``, ``decode_s`` and ``last_pick``; a subclass that overrides any of them is
        asked through them.
        """
        if self._overridden:
            states = []
            picks = []
            for b in backends:
                v = self.view(b, now)
                states.append((v.inflight, v.prefill_tokens, v.queue_tokens, v.running, v.kv_usage,
                               self.work_s(b, now), self.queued(b), self.decode_s(b)))
                picks.append(self.last_pick(b))
            return states, picks
        inflight_of, prefill_of, signal_of = self._inflight.get, self._prefill.get, self._signals.get
        work_of, queued_of, decode_of = self.work_s, self._queued.get, self._decode_s.get
        pick_of = self._last_pick.get
        decode_all = self._decode_all
        never = -math.inf
        states = []
        append = states.append
        for b in backends:
            inflight = inflight_of(b, 0)
            prefill = prefill_of(b, 0)
            sig = signal_of(b)
            d = decode_of(b, decode_all)
            if sig is None:
                append((inflight, prefill, float(prefill), inflight, 0.0, work_of(b, now), queued_of(b, 0),
                        0.0 if d is None else d))
            else:
                append((inflight, prefill, *self._signal_load(b, sig, inflight, prefill, now), work_of(b, now),
                        queued_of(b, 0), 0.0 if d is None else d))
        return states, [pick_of(b, never) for b in backends]

    def view(self, backend: str, now: float) -> BackendLoad:
        """Router-side load, raised to what a fresh engine signal shows (other routers' traffic)."""
        inflight = self._inflight.get(backend, 0)
        prefill = self._prefill.get(backend, 0)
        sig = self._signals.get(backend)
        last_pick = self._last_pick.get(backend, -math.inf)
        if sig is None:
            return BackendLoad(inflight, prefill, float(prefill), inflight, 0.0, last_pick)
        return BackendLoad(inflight, prefill, *self._signal_load(backend, sig, inflight, prefill, now), last_pick)

    def _signal_load(self, backend: str, sig: ExternalSignal, inflight: int, prefill: int,
                     now: float) -> tuple[float, int, float]:
        """``(queue_tokens, running, kv_usage)``: router-side counts raised to an aged engine signal, its waiting
        requests less the router's departures since it was read."""
        queue_tokens = float(prefill)
        running = inflight
        kv_usage = 0.0
        age = now - sig.at
        memo = self._fresh_memo
        if memo[0] == age:  # signals scraped together share their age: one pow per pick, not per backend
            w = memo[1]
        else:
            w = self.freshness(age)
            self._fresh_memo = (age, w)
        if sig.queue_depth is not None:
            waiting = sig.queue_depth - (self._left.get(backend, 0) - self._left_base.get(backend, 0))
            if waiting > 0:
                queue_tokens = max(queue_tokens, w * waiting * self._mean_prompt)
        if sig.running is not None:
            running = max(running, int(w * sig.running))
        if sig.kv_usage is not None:
            kv_usage = w * min(1.0, max(0.0, sig.kv_usage))
        return queue_tokens, running, kv_usage
