"""The pure load balancer ``cache_aware`` reduces to when the cache cannot tell backends apart.

When every backend holds the same prefix of a prompt, or the prompt is too short to route on, the best pick
is the backend where the request waits least, with no cache term:

- a long prompt waits for every prefill token queued ahead of it: the least queued prefill (prompt tokens
  charged and not yet at first token, or an engine's reported queue where larger), then the fewest
  requests in flight;
- a short prompt (one that fits the engine step it joins) waits only for whole chunks queued ahead: the
  fewest full chunks ahead.

``least_waiting`` returns every backend with the least wait; the caller breaks the tie. ``Rotation`` is the
tie-break that spreads equal loads like round robin (the backend this router picked fewest times, then the
one picked least recently, then the name), where the lowest name first would pile them on one backend.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.load import LoadTracker


class Rotation:
    """How many times this router picked each backend: the tie-break that spreads equal loads evenly."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def count(self, backend: str) -> int:
        """Picks of ``backend`` recorded so far (0 for one never picked)."""
        return self._count.get(backend, 0)

    def record(self, backend: str) -> None:
        """Count one pick of ``backend``."""
        self._count[backend] = self._count.get(backend, 0) + 1

    def next_of(self, tied: Sequence[str], load: LoadTracker) -> str:
        """Of ``tied`` (non-empty), the backend picked fewest times, then least recently, then by name."""
        return min(tied, key=lambda b: (self.count(b), load.last_pick(b), b))


def wait_key(backend: str, load: LoadTracker, now: float, chunk_tokens: int = 0) -> tuple[float, int]:
    """How long a request would wait on ``backend``, as a key (lower waits less): ``(queued prefill tokens,
    in flight)``; with ``chunk_tokens`` > 0 (a short prompt) ``(whole chunks queued, 0)``."""
    v = load.view(backend, now)
    if chunk_tokens > 0:
        return (v.queue_tokens // chunk_tokens, 0)
    return (v.queue_tokens, max(v.inflight, v.running))


def is_idle(backend: str, load: LoadTracker, now: float) -> bool:
    """Nothing queued or in flight on ``backend`` (router-side or engine-reported)."""
    v = load.view(backend, now)
    return v.queue_tokens <= 0 and max(v.inflight, v.running) == 0


def least_waiting(candidates: Sequence[str], load: LoadTracker, now: float, chunk_tokens: int = 0) -> list[str]:
    """The candidates (non-empty) with the least ``wait_key``, in their order."""
    keys = [wait_key(b, load, now, chunk_tokens) for b in candidates]
    least = min(keys)
    return [b for b, k in zip(candidates, keys, strict=True) if k == least]
