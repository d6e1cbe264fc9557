"""Filters: narrow the candidates before scoring. Each returns a non-empty subset when given one."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.hashing import bounded_load_cap
from kvroute.policies.load import LoadTracker


def bounded_load(candidates: Sequence[str], load: LoadTracker, epsilon: float, min_cap: int) -> tuple[list[str], int]:
    """Backends that can take one more request within ``max(min_cap, ⌈(1+ε)·mean⌉)`` in-flight, and that cap.

    Falls back to every candidate when none fits (all equally full), so a pick is always possible.
    """
    cap = bounded_load_cap(load.total_inflight(candidates), len(candidates), epsilon, min_cap)
    allowed = [b for b in candidates if load.inflight(b) + 1 <= cap]
    return (allowed or list(candidates)), cap


def bounded_busy(candidates: Sequence[str], load: LoadTracker, epsilon: float, floor_s: float,
                 now: float) -> list[str]:
    """Backends whose recent busy seconds stay within ``(1+ε)·mean + floor_s`` (the hot-spot bound).

    Busy seconds are the decayed work assigned at pick (``LoadTracker.busy``); never empty.
    """
    return within_busy_bound(candidates, load.busy_many(candidates, now), epsilon, floor_s)


def busy_limit(busy: Sequence[float], epsilon: float, floor_s: float) -> float:
    """The hot-spot bound's limit: ``(1+ε)·mean + floor_s`` of the candidates' busy seconds."""
    return (1.0 + epsilon) * sum(busy) / len(busy) + floor_s


def within_busy_bound(candidates: Sequence[str], busy: Sequence[float], epsilon: float, floor_s: float) -> list[str]:
    """``bounded_busy`` on busy seconds the caller already read (``busy[i]`` is ``candidates[i]``'s)."""
    limit = busy_limit(busy, epsilon, floor_s)
    allowed = [b for b, v in zip(candidates, busy, strict=True) if v <= limit]
    return allowed or list(candidates)


def sticky_within_bound(
    order: Sequence[str], load: LoadTracker, epsilon: float, min_cap: int
) -> tuple[str, bool, int]:
    """First backend in a key's rendezvous ``order`` that passes the load bound: (backend, is_home, cap)."""
    allowed, cap = bounded_load(order, load, epsilon, min_cap)
    fits = set(allowed)
    backend = next((b for b in order if b in fits), order[0])
    return backend, backend == order[0], cap
