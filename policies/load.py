"""Load tracking: router-side in-flight work per backend plus aged external signals.

Router-side counts react within a burst (updated at pick); external signals (engine queue depth, KV
usage) come with their age and weigh less as they get stale (exponential decay, ``half_life_s``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class ExternalSignal:
    """Engine-reported load at time ``at``: waiting requests, running requests, KV usage in [0, 1]."""

    at: float
    queue_depth: float | None = None
    running: float | None = None
    kv_usage: float | None = None


@dataclass(slots=True)
class _Inflight:
    backend: str
    prefill_tokens: int
    started: float
    prefill_done: bool = False


@dataclass(slots=True)
class BackendLoad:
    """A backend's load as a policy sees it at one instant."""

    inflight: int
    prefill_tokens: int
    queue_tokens: float
    running: int
    kv_usage: float
    last_pick: float


class LoadTracker:
    """In-flight requests and prefill tokens per backend; ``release`` is idempotent."""

    def __init__(self, half_life_s: float = 2.0, mean_prompt_tokens: float = 1024.0) -> None:
        self.half_life_s = half_life_s
        self._requests: dict[str, _Inflight] = {}
        self._inflight: dict[str, int] = {}
        self._prefill: dict[str, int] = {}
        self._last_pick: dict[str, float] = {}
        self._signals: dict[str, ExternalSignal] = {}
        self._mean_prompt = mean_prompt_tokens

    # --- request lifecycle ----------------------------------------------------------------------
    def start(self, request_id: str, backend: str, prefill_tokens: int, now: float) -> None:
        """Charge a picked request to its backend (called at pick time, before the call is made)."""
        if request_id in self._requests:
            self.release(request_id)
        prefill_tokens = max(0, int(prefill_tokens))
        self._requests[request_id] = _Inflight(backend, prefill_tokens, now)
        self._inflight[backend] = self._inflight.get(backend, 0) + 1
        self._prefill[backend] = self._prefill.get(backend, 0) + prefill_tokens
        self._last_pick[backend] = now
        self._mean_prompt = 0.98 * self._mean_prompt + 0.02 * max(prefill_tokens, 1)

    def move(self, request_id: str, backend: str, now: float) -> None:
        """The request went to another backend than picked (LiteLLM retry): move its charge."""
        req = self._requests.get(request_id)
        if req is None or req.backend == backend:
            return
        tokens = req.prefill_tokens
        self.release(request_id)
        self.start(request_id, backend, tokens, now)

    def first_token(self, request_id: str) -> None:
        """Prefill finished: the request no longer holds prefill work, only a decode slot."""
        req = self._requests.get(request_id)
        if req is None or req.prefill_done:
            return
        req.prefill_done = True
        self._prefill[req.backend] = max(0, self._prefill.get(req.backend, 0) - req.prefill_tokens)

    def release(self, request_id: str) -> str | None:
        """Completion, failure or cancellation; returns the backend it was charged to (or None)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._inflight[req.backend] = max(0, self._inflight.get(req.backend, 0) - 1)
        if not req.prefill_done:
            self._prefill[req.backend] = max(0, self._prefill.get(req.backend, 0) - req.prefill_tokens)
        return req.backend

    def backend_of(self, request_id: str) -> str | None:
        req = self._requests.get(request_id)
        return req.backend if req else None

    def expire(self, now: float, max_age_s: float) -> int:
        """Release requests older than ``max_age_s`` (lost callbacks must not leak load forever)."""
        old = [rid for rid, r in self._requests.items() if now - r.started > max_age_s]
        for rid in old:
            self.release(rid)
        return len(old)

    # --- external signals -----------------------------------------------------------------------
    def observe(self, backend: str, signal: ExternalSignal) -> None:
        self._signals[backend] = signal

    def signal(self, backend: str) -> ExternalSignal | None:
        return self._signals.get(backend)

    def freshness(self, age_s: float) -> float:
        """Weight of a signal of this age: 1 when fresh, halving every ``half_life_s``."""
        if age_s <= 0:
            return 1.0
        return math.pow(0.5, age_s / self.half_life_s)

    def remove_backend(self, backend: str) -> None:
        for rid in [rid for rid, r in self._requests.items() if r.backend == backend]:
            self.release(rid)
        self._inflight.pop(backend, None)
        self._prefill.pop(backend, None)
        self._last_pick.pop(backend, None)
        self._signals.pop(backend, None)

    # --- views ----------------------------------------------------------------------------------
    def inflight(self, backend: str) -> int:
        return self._inflight.get(backend, 0)

    def prefill_tokens(self, backend: str) -> int:
        return self._prefill.get(backend, 0)

    def last_pick(self, backend: str) -> float:
        return self._last_pick.get(backend, -math.inf)

    def total_inflight(self, backends: Iterable[str]) -> int:
        return sum(self._inflight.get(b, 0) for b in backends)

    def view(self, backend: str, now: float) -> BackendLoad:
        """Router-side load, raised to what a fresh engine signal shows (other routers' traffic)."""
        inflight = self._inflight.get(backend, 0)
        prefill = self._prefill.get(backend, 0)
        sig = self._signals.get(backend)
        last_pick = self._last_pick.get(backend, -math.inf)
        if sig is None:
            return BackendLoad(inflight, prefill, float(prefill), inflight, 0.0, last_pick)
        queue_tokens = float(prefill)
        running = inflight
        kv_usage = 0.0
        w = self.freshness(now - sig.at)
        if sig.queue_depth is not None:
            queue_tokens = max(queue_tokens, w * sig.queue_depth * self._mean_prompt)
        if sig.running is not None:
            running = max(running, int(w * sig.running))
        if sig.kv_usage is not None:
            kv_usage = w * min(1.0, max(0.0, sig.kv_usage))
        return BackendLoad(inflight, prefill, queue_tokens, running, kv_usage, last_pick)
