"""Approximate prefix index: which backend probably holds which chained block keys.

Learned from the router's own picks and corrected by the cached-token counts that responses report.
Per-backend LRU at block granularity (an ``OrderedDict`` per backend: C-speed ``move_to_end``/``popitem``
on the request path), optional TTL, purge of removed backends, bounded memory.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_NEVER = math.inf


class PrefixLocator(Protocol):
    """What a policy needs from any prefix index (approximate here, event-driven in precise mode)."""

    def match(self, keys: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        """Number of leading blocks of ``keys`` each backend holds; backends holding none are omitted."""
        ...

    def record(self, backend: str, keys: Sequence[int], now: float) -> None:
        """Note that ``backend`` was just given these blocks (it will hold them after prefill)."""
        ...

    def confirm(self, backend: str, keys: Sequence[int], cached_blocks: int, now: float,
                predicted_blocks: int | None = None) -> None:
        """Correct the index with what the backend reported as cached for a finished request."""
        ...

    def forget(self, backend: str, keys: Sequence[int], computed_blocks: int = 0) -> None:
        """The request for ``keys`` failed before ``backend`` computed them: take back out what the index recorded
        for it past the first ``computed_blocks`` (what the backend already held)."""
        ...

    def remove_backend(self, backend: str) -> None: ...

    def blocks(self, backend: str | None = None) -> int: ...


class LocatorParts:
    """The optional parts of a prefix index, each None where the index has no such part (an index that has
    one defines it as a method or attribute of the same name); the router and the policies read these
    instead of probing.

    ``tail_block_tokens``: the engine's block grain of a session's tail (None: blocks only); ``fallback``: the
    index answering for backends without events; ``capacity_blocks(backend)``; ``holdings(backends)``;
    ``evictions(backend, keys, now)``: held tokens a new prompt pushes out; ``set_capacity(backend, tokens)``;
    ``learn_size(backend, keys, engine_tokens)`` and ``set_token_ratio(ratio)``: entries sized in the
    engine's tokens; ``live_tokens(backend, now)``: held tokens weighed by how likely their conversations are to
    come back (what a new prompt placed beside them puts at risk); ``forget_before(backend, t)``: the engine
    restarted after ``t``, drop what it was last given or answered by then."""

    tail_block_tokens: float | None = None
    fallback: Any = None
    capacity_blocks: Callable[[str], int] | None = None
    holdings: Callable[[Sequence[str]], tuple[list[int], list[int]]] | None = None
    evictions: Callable[[str, Sequence[int], float], float] | None = None
    set_capacity: Callable[[str, int], None] | None = None
    learn_size: Callable[[str, Sequence[int], int], None] | None = None
    set_token_ratio: Callable[[float], None] | None = None
    live_tokens: Callable[[str, float], float] | None = None
    forget_before: Callable[[str, float], None] | None = None


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    """Default capacity: 500k tokens of KV per backend in 64-token blocks; no TTL.

    ``learn_capacity`` lets over-predicted cached counts shrink a backend's capacity. It is off by
    default: in the simulator (llm-d 73%-capacity ladder, client-capped) misses caused by queueing churn
    shrank the index until it forgot hot prefixes (hit 50% with learning, 94% without). Prediction
    accuracy is tracked either way (``PrefixIndex.accuracy``).
    """

    capacity_tokens: int = 500_000
    block_tokens: float = 64.0
    ttl_s: float | None = None
    max_blocks_per_backend: int = 1 << 20
    max_backends: int = 4096
    learn_capacity: bool = False
    min_capacity_fraction: float = 0.25
    #: the engine's own cache block in tokens, where known (vLLM's ``block_size``): a session's home holds the
    #: tail of its conversation in whole engine blocks, finer than the index's; None: unknown, not credited
    engine_block_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_tokens <= 0:
            raise ValueError("capacity_tokens must be positive")
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive or None")


class _BackendBlocks:
    __slots__ = ("capacity", "configured", "entries", "hits", "mispredicted_blocks", "predicted_blocks")

    def __init__(self, capacity: int) -> None:
        self.entries: OrderedDict[int, float] = OrderedDict()
        self.capacity = capacity
        self.configured = capacity
        self.predicted_blocks = 0
        self.mispredicted_blocks = 0
        self.hits = 0


class PrefixIndex(LocatorParts):
    """Approximate per-backend LRU of chained block keys; ``match`` costs O(backends + holders·log n)."""

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config or PrefixIndexConfig()
        self._backends: dict[str, _BackendBlocks] = {}
        self.tail_block_tokens = self.config.engine_block_tokens

    # --- capacity -------------------------------------------------------------------------------
    def _capacity_blocks(self, capacity_tokens: int) -> int:
        blocks = int(capacity_tokens // self.config.block_tokens)
        return max(1, min(blocks, self.config.max_blocks_per_backend))

    def set_capacity(self, backend: str, capacity_tokens: int) -> None:
        """Set a backend's KV capacity in tokens (from config or engine metrics); evicts down to it."""
        state = self._state(backend)
        state.configured = state.capacity = self._capacity_blocks(capacity_tokens)
        self._evict(state)

    def capacity_blocks(self, backend: str) -> int:
        return self._state(backend).capacity

    def _state(self, backend: str) -> _BackendBlocks:
        state = self._backends.get(backend)
        if state is None:
            if len(self._backends) >= self.config.max_backends:
                # Bounded memory: forget the backend with the fewest blocks (likely gone).
                victim = min(self._backends, key=lambda b: len(self._backends[b].entries))
                del self._backends[victim]
            state = self._backends[backend] = _BackendBlocks(self._capacity_blocks(self.config.capacity_tokens))
        return state

    @staticmethod
    def _evict(state: _BackendBlocks) -> None:
        entries = state.entries
        while len(entries) > state.capacity:
            entries.popitem(last=False)

    # --- queries --------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        """Leading blocks held per backend, by binary search: a chained key at k implies blocks 0..k."""
        result: dict[str, int] = {}
        n = len(keys)
        if n == 0:
            return result
        first = keys[0]
        for backend in backends:
            state = self._backends.get(backend)
            if state is None:
                continue
            entries = state.entries
            exp = entries.get(first)
            if exp is None or exp < now:
                continue
            lo, hi = 1, n  # invariant: keys[lo-1] held; answer in [lo, hi]
            last = entries.get(keys[n - 1])
            if last is not None and last >= now:
                result[backend] = n
                continue
            hi = n - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                e = entries.get(keys[mid - 1])
                if e is not None and e >= now:
                    lo = mid
                else:
                    hi = mid - 1
            result[backend] = lo
        return result

    def holdings(self, backends: Sequence[str]) -> tuple[list[int], list[int]]:
        """``([blocks(b) ...], [capacity_blocks(b) ...])`` in one pass, with the same effects as asking
        ``capacity_blocks(b)`` then ``blocks(b)`` for each backend in order (a backend not seen yet gets a state)."""
        blocks: list[int] = []
        caps: list[int] = []
        get = self._backends.get
        for b in backends:
            state = get(b)
            if state is None:
                state = self._state(b)
            caps.append(state.capacity)
            blocks.append(len(state.entries))
        return blocks, caps

    def blocks(self, backend: str | None = None) -> int:
        if backend is not None:
            state = self._backends.get(backend)
            return len(state.entries) if state else 0
        return sum(len(s.entries) for s in self._backends.values())

    def backends(self) -> list[str]:
        return list(self._backends)

    def accuracy(self, backend: str) -> float | None:
        """Share of predicted cached blocks the backend confirmed (None before any prediction)."""
        state = self._backends.get(backend)
        if state is None or state.predicted_blocks == 0:
            return None
        return 1.0 - state.mispredicted_blocks / state.predicted_blocks

    # --- updates --------------------------------------------------------------------------------
    def record(self, backend: str, keys: Sequence[int], now: float) -> None:
        """Insert/refresh ``keys`` for ``backend``; deepest first so the LRU evicts tails before roots."""
        if not keys:
            return
        state = self._state(backend)
        entries = state.entries
        move = entries.move_to_end
        if self.config.ttl_s:
            expiry = now + self.config.ttl_s
            for key in reversed(keys):
                entries[key] = expiry
                move(key)
        else:
            # C-speed refresh of the keys already held; a missing key stops map(), is inserted, and the
            # same reversed iterator goes on (so the final order is the same as one key at a time)
            pending = reversed(keys)
            while True:
                try:
                    deque(map(move, pending), 0)
                    break
                except KeyError as missing:
                    entries[missing.args[0]] = _NEVER
        if len(entries) > state.capacity:
            self._evict(state)

    def confirm(self, backend: str, keys: Sequence[int], cached_blocks: int, now: float,
                predicted_blocks: int | None = None) -> None:
        """Correct with a reported cached count; tracks prediction accuracy per backend.

        After a request the engine holds its whole prompt, so the keys are refreshed (re-inserted if our
        LRU dropped them meanwhile). With ``learn_capacity``, predicting more cached blocks than the engine
        reported shrinks the backend's learned capacity (never below ``min_capacity_fraction`` of the
        configured one), and it grows back slowly while predictions hold.
        """
        state = self._state(backend)
        if predicted_blocks is not None and predicted_blocks > 0:
            state.predicted_blocks += predicted_blocks
            missing = max(0, predicted_blocks - max(0, cached_blocks))
            state.mispredicted_blocks += missing
            floor = max(1, int(state.configured * self.config.min_capacity_fraction))
            learn = self.config.learn_capacity
            if learn and missing > 0:  # shrink in proportion to how wrong the prediction was
                shrink = 1.0 - 0.1 * missing / predicted_blocks
                state.capacity = max(floor, min(state.capacity - 1, int(state.capacity * shrink)))
            elif learn and state.capacity < state.configured:
                state.capacity = min(state.configured, state.capacity + max(1, state.configured // 100))
            if cached_blocks > 0:
                state.hits += 1
        last = state.entries.get(keys[-1]) if keys else None
        if last is None or last < now or self.config.ttl_s:
            self.record(backend, keys, now)  # evicted meanwhile (or TTL to extend): the engine holds it now

    def forget(self, backend: str, keys: Sequence[int], computed_blocks: int = 0) -> None:
        """Drop ``keys`` past the first ``computed_blocks`` for a backend (a request that failed before prefill,
        or an engine removal)."""
        state = self._backends.get(backend)
        if state is None:
            return
        for key in keys[computed_blocks:]:
            state.entries.pop(key, None)

    def remove_backend(self, backend: str) -> None:
        self._backends.pop(backend, None)

    def retain(self, live: Iterable[str]) -> list[str]:
        """Purge every backend not in ``live``; returns the purged ids."""
        keep = set(live)
        gone = [b for b in self._backends if b not in keep]
        for b in gone:
            del self._backends[b]
        return gone
