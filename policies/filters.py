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


def hot_limit(busy_s: Sequence[float], epsilon: float, floor_s: float) -> float:
    """The hot-spot bound's limit: ``(1+ε)·mean + floor_s`` of the candidates' recent busy seconds
    (``LoadTracker.busy``: work assigned lately, decayed; where new work should not pile up)."""
    return (1.0 + epsilon) * sum(busy_s) / len(busy_s) + floor_s


def hot_load(busy_s: float, working: bool, holds_prefix: bool) -> float:
    """What the hot-spot bound compares with ``hot_limit`` for one backend: its busy seconds, except for a backend
    that holds a prefix of the request and is idle now (``working``: requests in flight or a prefill queue,
    charged or reported), which counts 0.

    So a prefix is taken away from its holder only while the holder is working: the same prompt repeated one
    request at a time on an idle fleet stays on its first replica, however much it served lately; new content
    (no holder, or away from a working hot holder) still goes where work has not been piling up.
    """
    return 0.0 if holds_prefix and not working else busy_s


def within_hot_bound(candidates: Sequence[str], load_s: Sequence[float], limit: float) -> list[str]:
    """Backends whose ``hot_load`` (``load_s[i]`` is ``candidates[i]``'s) is within ``limit``; every candidate
    when none is (or the limit is NaN), so never empty."""
    allowed = [b for b, v in zip(candidates, load_s, strict=True) if v <= limit]
    return allowed or list(candidates)


def sticky_within_bound(
    order: Sequence[str], load: LoadTracker, epsilon: float, min_cap: int
) -> tuple[str, bool, int]:
    """First backend in a key's rendezvous ``order`` that passes the load bound: (backend, is_home, cap)."""
    allowed, cap = bounded_load(order, load, epsilon, min_cap)
    fits = set(allowed)
    backend = next((b for b in order if b in fits), order[0])
    return backend, backend == order[0], cap
