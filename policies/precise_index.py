"""Precise prefix index: which backend holds which blocks, as the engines themselves report it.

Dual-key design: on ``BlockStored`` the index computes its *own* chained keys from the event's token ids
(``token_keys`` seeded by ``chain_seed(model or LoRA name, cache salt)``, continued from the parent
block's own key), so request keys computed from a prompt's token ids in the engine's block size match
directly, whatever hash seed or algorithm the engine uses. The engine hash is kept only to map
``BlockRemoved`` back to an own key. Copies (per source, DP rank, medium, group, ...) are reference
counted; a source's state is dropped as a whole on ``AllBlocksCleared``, a sequence reset or reconnect.

Each copy lives in a cache tier (``policies/tiers.py``: GPU, host memory, disk). A removal withdraws only
the copy it names, so a block offloaded GPU → CPU and then evicted from the GPU is still held, in host
memory. ``match`` counts a block held in any tier; where a backend holds part of its prefix only in slower
tiers, the answer is a ``TieredMatch`` whose ``credited`` figure prices that prefix in GPU-equivalent blocks
(``TierCredit``); with every block in GPU memory it is the plain mapping it always was.

A pick inserts its keys speculatively with a short TTL (the gap until the engine's event arrives).
Backends no event source covers are answered by a fallback approximate ``PrefixIndex``, so one index
serves precise and approximate model groups side by side. Mutations from the event thread hold a lock;
``match`` takes no lock and only does dict look-ups, so it never waits on the feed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvroute.policies.fingerprint import UNKEYED, ChainKey, token_keys
from kvroute.policies.prefix_index import LocatorParts, PrefixIndex, PrefixIndexConfig
from kvroute.policies.tiers import DISK, GPU, HOST, TIER_NAMES, TierCredit, TieredMatch

CopyTag = Hashable


@dataclass(frozen=True, slots=True)
class PreciseIndexConfig:
    """Speculative entries live ``speculative_ttl_s`` (bounded per backend); sources are bounded too;
    ``tier_credit`` prices blocks held only in host memory or on disk."""

    speculative_ttl_s: float = 2.0
    max_speculative_per_backend: int = 65_536
    max_blocks_per_source: int = 4_000_000
    max_blocks_per_event: int = 1 << 16
    fallback: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    chain: ChainKey = UNKEYED
    tier_credit: TierCredit = field(default_factory=TierCredit)

    def __post_init__(self) -> None:
        if self.speculative_ttl_s < 0:
            raise ValueError("speculative_ttl_s must be >= 0")
        if self.max_speculative_per_backend < 0 or self.max_blocks_per_source < 1:
            raise ValueError("bounds must be positive")


@dataclass(slots=True)
class SourceCounters:
    """What the index did with one source's events."""

    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    orphan_blocks: int = 0
    unknown_removals: int = 0
    dropped_blocks: int = 0


class _Source:
    __slots__ = ("backend", "counters", "engine")

    def __init__(self, backend: str) -> None:
        self.backend = backend
        # engine hash -> [own key, {copy tag: count}, {copy tag: tier} for copies outside GPU memory, or None]
        self.engine: dict[int, list] = {}
        self.counters = SourceCounters()


class PreciseIndex(LocatorParts):
    """Event-fed ``PrefixLocator``: own keys → {backend: copies}; engine hash → own key per source."""

    def __init__(self, config: PreciseIndexConfig | None = None, fallback: PrefixIndex | None = None) -> None:
        self.config = config or PreciseIndexConfig()
        self.fallback = fallback if fallback is not None else PrefixIndex(self.config.fallback)
        self._holders: dict[int, dict[str, int]] = {}
        # own key -> backend -> [entries in all, entries per slower tier...] for entries whose best copy is
        # outside GPU memory
        self._slow: dict[int, dict[str, list[int]]] = {}
        self._credit = self.config.tier_credit.by_tier
        self._backend_blocks: dict[str, int] = {}
        self._sources: dict[Hashable, _Source] = {}
        self._covered: dict[str, int] = {}  # backend -> number of sources feeding it
        self._spec: dict[str, OrderedDict[int, float]] = {}
        self._lock = threading.Lock()

    # --- sources --------------------------------------------------------------------------------
    @property
    def chain(self) -> ChainKey:
        """The key chains are keyed with: event keys and request keys must both come from it."""
        return self.config.chain

    def attach(self, source: Hashable, backend: str) -> None:
        """Declare that events from ``source`` describe ``backend``'s cache (it becomes precise)."""
        with self._lock:
            current = self._sources.get(source)
            if current is not None:
                if current.backend == backend:
                    return
                self._drop_source(source, current)
            self._sources[source] = _Source(backend)
            self._covered[backend] = self._covered.get(backend, 0) + 1

    def detach(self, source: Hashable) -> None:
        with self._lock:
            state = self._sources.get(source)
            if state is not None:
                self._drop_source(source, state)

    def covers(self, backend: str) -> bool:
        return backend in self._covered

    def sources(self) -> list[Hashable]:
        return list(self._sources)

    def counters(self, source: Hashable) -> SourceCounters | None:
        state = self._sources.get(source)
        return state.counters if state else None

    def source_blocks(self, source: Hashable) -> int:
        state = self._sources.get(source)
        return len(state.engine) if state else 0

    # --- events ---------------------------------------------------------------------------------
    def stored(self, source: Hashable, engine_hashes: Sequence[int], parent_hash: int | None,
               token_ids: Sequence[int], block_size: int, seed: int, copy: CopyTag = None, tier: int = GPU) -> int:
        """Apply one ``BlockStored`` of a copy in ``tier``; returns the blocks newly held.

        Blocks are keyed from ``token_ids`` continued from the parent's own key; a store without tokens
        ("hash-only", as offloading connectors send them, block size 0 allowed) or with a parent never seen
        only adds copies of blocks already known, and counts the others as orphans. A copy tag keeps the tier
        of its first store."""
        state = self._sources.get(source)
        if state is None or not engine_hashes or (block_size <= 0 and len(token_ids)):
            return 0
        with self._lock:
            return self._stored(state, engine_hashes, parent_hash, token_ids, block_size, seed, copy, tier)

    def _stored(self, state: _Source, engine_hashes: Sequence[int], parent_hash: int | None,
                token_ids: Sequence[int], block_size: int, seed: int, copy: CopyTag, tier: int) -> int:
        engine = state.engine
        n = min(len(engine_hashes), self.config.max_blocks_per_event)
        full = len(token_ids) // block_size if block_size > 0 else 0
        own: Sequence[int] = ()
        if full:
            parent = None if parent_hash is None else engine.get(parent_hash)
            if parent_hash is None or parent is not None:  # else tokens we cannot chain: only known blocks
                start = seed if parent is None else parent[0]
                own = token_keys(token_ids, block_size, start, n, self.config.chain.step)
        return self._store(state, engine_hashes, own, n, copy, tier)

    def stored_keys(self, source: Hashable, engine_hashes: Sequence[int], keys: Sequence[int],
                    copy: CopyTag = None, tier: int = GPU) -> int:
        """A ``BlockStored`` whose blocks the caller already keyed (simulated engines: no token ids)."""
        state = self._sources.get(source)
        if state is None or not engine_hashes:
            return 0
        with self._lock:
            return self._store(state, engine_hashes, keys, min(len(engine_hashes), self.config.max_blocks_per_event),
                               copy, tier)

    def _store(self, state: _Source, engine_hashes: Sequence[int], own: Sequence[int], n: int,
               copy: CopyTag, tier: int) -> int:
        engine = state.engine
        counters = state.counters
        added = 0
        holders = self._holders
        backend = state.backend
        limit = self.config.max_blocks_per_source
        for i in range(n):
            h = engine_hashes[i]
            entry = engine.get(h)
            if entry is not None:
                # Another copy of a known block (other medium, or a repeated announcement).
                copies = entry[1]
                refs = copies.get(copy)
                if refs is not None:
                    copies[copy] = refs + 1
                    continue
                before = _best_tier(copies, entry[2])
                copies[copy] = 1
                if tier != GPU:
                    if entry[2] is None:
                        entry[2] = {copy: tier}
                    else:
                        entry[2][copy] = tier
                if before != GPU and tier < before:
                    self._retier(entry[0], backend, before, tier)
                continue
            if i >= len(own):
                # Tokenless ("hash-only") or short store for a block we never saw: nothing to key it by.
                counters.orphan_blocks += 1
                continue
            if len(engine) >= limit:
                counters.dropped_blocks += 1
                continue
            key = own[i]
            engine[h] = [key, {copy: 1}, None if tier == GPU else {copy: tier}]
            held = holders.get(key)
            if held is None:
                holders[key] = {backend: 1}
                self._backend_blocks[backend] = self._backend_blocks.get(backend, 0) + 1
            else:
                refs = held.get(backend, 0)
                if refs == 0:
                    self._backend_blocks[backend] = self._backend_blocks.get(backend, 0) + 1
                held[backend] = refs + 1
            if tier != GPU:
                self._retier(key, backend, GPU, tier)
            added += 1
        counters.blocks_stored += added
        return added

    def removed(self, source: Hashable, engine_hashes: Sequence[int], copy: CopyTag = None) -> int:
        """Apply one ``BlockRemoved`` of the copy ``copy`` names (a block's other copies, in this tier or
        another, stay); returns the blocks the backend no longer holds in any copy."""
        state = self._sources.get(source)
        if state is None:
            return 0
        with self._lock:
            engine = state.engine
            counters = state.counters
            backend = state.backend
            gone = 0
            for h in engine_hashes:
                entry = engine.get(h)
                if entry is None:
                    counters.unknown_removals += 1
                    continue
                copies = entry[1]
                refs = copies.get(copy)
                if refs is None:
                    if len(copies) != 1:
                        counters.unknown_removals += 1
                        continue
                    # Removal named a copy differently from its store (e.g. medium omitted): the one copy.
                    copy_key = next(iter(copies))
                    refs = copies[copy_key]
                else:
                    copy_key = copy
                if refs > 1:
                    copies[copy_key] = refs - 1
                    continue
                tiers = entry[2]
                before = _best_tier(copies, tiers)
                del copies[copy_key]
                if tiers is not None:
                    tiers.pop(copy_key, None)
                    if not tiers:
                        entry[2] = tiers = None
                if copies:
                    after = _best_tier(copies, tiers)
                    if after != before:
                        self._retier(entry[0], backend, before, after)
                    continue
                del engine[h]
                self._release(entry[0], backend, before)
                gone += 1
            counters.blocks_removed += gone
            return gone

    def cleared(self, source: Hashable) -> int:
        """``AllBlocksCleared``, a sequence reset or a reconnect: drop everything this source reported."""
        state = self._sources.get(source)
        if state is None:
            return 0
        with self._lock:
            n = self._clear(state)
            state.counters.clears += 1
            return n

    def _clear(self, state: _Source) -> int:
        n = len(state.engine)
        for entry in state.engine.values():
            self._release(entry[0], state.backend, _best_tier(entry[1], entry[2]))
        state.engine = {}
        return n

    def _release(self, key: int, backend: str, tier: int) -> None:
        """One entry of ``backend`` (its best copy in ``tier``) no longer holds ``key``."""
        if tier != GPU:
            self._retier(key, backend, tier, GPU)
        held = self._holders.get(key)
        if held is None:
            return
        refs = held.get(backend, 0) - 1
        if refs > 0:
            held[backend] = refs
            return
        held.pop(backend, None)
        if not held:
            del self._holders[key]
        left = self._backend_blocks.get(backend, 0) - 1
        if left > 0:
            self._backend_blocks[backend] = left
        else:
            self._backend_blocks.pop(backend, None)

    def _retier(self, key: int, backend: str, before: int, after: int) -> None:
        """One entry's best copy moved from tier ``before`` to ``after``: only slower-than-GPU ones are counted."""
        slow = self._slow
        if before != GPU:
            per = slow.get(key)
            counts = per.get(backend) if per is not None else None
            if counts is not None:
                counts[before] -= 1
                counts[0] -= 1
                if counts[0] <= 0:
                    del per[backend]
                    if not per:
                        del slow[key]
        if after != GPU:
            per = slow.get(key)
            if per is None:
                per = slow[key] = {}
            counts = per.get(backend)
            if counts is None:
                counts = per[backend] = [0] * len(self._credit)
            counts[after] += 1
            counts[0] += 1

    def _drop_source(self, source: Hashable, state: _Source) -> None:
        self._clear(state)
        del self._sources[source]
        left = self._covered.get(state.backend, 0) - 1
        if left > 0:
            self._covered[state.backend] = left
        else:
            self._covered.pop(state.backend, None)

    # --- PrefixLocator --------------------------------------------------------------------------
    def match(self, keys: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        """Leading blocks held per backend, in any tier: engine-confirmed or speculative; others via the
        fallback. A ``TieredMatch`` when a slower tier holds part of some backend's prefix (its ``credited``
        gives that prefix in GPU-equivalent blocks); else a plain dict."""
        result: dict[str, int] = {}
        precise: list[str] = []
        approximate: list[str] = []
        for b in backends:
            (precise if b in self._covered else approximate).append(b)
        if approximate:
            result.update(self.fallback.match(keys, approximate, now))
        if not precise or not keys:
            return result
        holders = self._holders
        spec = self._spec
        alive = precise
        depth = 0
        for key in keys:
            held = holders.get(key)
            still: list[str] = []
            for b in alive:
                if held is not None and b in held:
                    still.append(b)
                    continue
                s = spec.get(b)
                if s is not None:
                    exp = s.get(key)
                    if exp is not None and exp >= now:
                        still.append(b)
                        continue
                if depth:
                    result[b] = depth
            depth += 1
            alive = still
            if not alive:
                break
        else:
            for b in alive:
                result[b] = depth
        if self._slow or self._credit[GPU] != 1.0:
            return self._credited(keys, precise, result, now)
        return result

    def _credited(self, keys: Sequence[int], precise: list[str], result: dict[str, int],
                  now: float) -> dict[str, int]:
        """``result`` with the GPU-equivalent blocks of each precise backend's held prefix, where they differ.

        A block counts at the credit of the fastest tier any of the backend's copies is in; a speculative entry
        (a pick sent there is computing or loading it into GPU memory now) counts as a GPU block. Only blocks
        some backend holds outside GPU memory are visited per backend."""
        depths = {b: result[b] for b in precise if b in result}
        if not depths:
            return result
        credit = self._credit
        full = credit[GPU]
        try:
            discount = self._discounts(keys, depths, full - credit[HOST], full - credit[DISK], now, copy=False)
        except RuntimeError:  # the event thread resized a dict under us: walk copies instead
            discount = self._discounts(keys, depths, full - credit[HOST], full - credit[DISK], now, copy=True)
        credited = {b: full * d - discount[b] for b, d in depths.items() if discount[b] or full != 1.0}
        return TieredMatch(result, credited) if credited else result

    def _discounts(self, keys: Sequence[int], depths: dict[str, int], host_off: float, disk_off: float,
                   now: float, copy: bool) -> dict[str, float]:
        """Per backend, Σ (GPU credit − credit) over the blocks of its held prefix it holds only in slower tiers."""
        discount = dict.fromkeys(depths, 0.0)
        slow = self._slow
        holders = self._holders
        spec = {b: s for b in depths if (s := self._spec.get(b))}
        for i in range(max(depths.values())):
            key = keys[i]
            low = slow.get(key)
            if low is None:
                continue
            held = holders.get(key)
            if held is None:
                continue
            for b, counts in (tuple(low.items()) if copy else low.items()):
                d = depths.get(b)
                if d is None or i >= d:
                    continue
                refs = held.get(b)
                if refs is None or counts[0] < refs:  # another entry of b holds a GPU copy
                    continue
                if spec:
                    s = spec.get(b)
                    if s is not None:
                        exp = s.get(key)
                        if exp is not None and exp >= now:
                            continue  # a pick sent there is computing or loading it into GPU memory
                discount[b] += host_off if counts[HOST] else disk_off
        return discount

    def record(self, backend: str, keys: Sequence[int], now: float) -> None:
        """A pick: precise backends get short-TTL speculative entries; others go to the fallback."""
        if backend not in self._covered:
            self.fallback.record(backend, keys, now)
            return
        ttl = self.config.speculative_ttl_s
        if not keys or ttl <= 0:
            return
        s = self._spec.get(backend)
        if s is None:
            s = self._spec[backend] = OrderedDict()
        expiry = now + ttl
        move = s.move_to_end
        for key in keys:
            if key in s:
                move(key)
            s[key] = expiry
        cap = self.config.max_speculative_per_backend
        while len(s) > cap:
            s.popitem(last=False)
        # Expired entries sit at the front (insertion order ≈ time order): trim them cheaply.
        while s:
            first = next(iter(s))
            if s[first] >= now:
                break
            del s[first]

    def confirm(self, backend: str, keys: Sequence[int], cached_blocks: int, now: float,
                predicted_blocks: int | None = None) -> None:
        """Engines report their own state through events; only approximate backends learn here."""
        if backend not in self._covered:
            self.fallback.confirm(backend, keys, cached_blocks, now, predicted_blocks)

    def forget(self, backend: str, keys: Sequence[int], computed_blocks: int = 0) -> None:
        if backend not in self._covered:
            self.fallback.forget(backend, keys, computed_blocks)
            return
        s = self._spec.get(backend)
        if s is not None:
            for key in keys[computed_blocks:]:
                s.pop(key, None)

    def remove_backend(self, backend: str) -> None:
        self.fallback.remove_backend(backend)
        self._spec.pop(backend, None)
        with self._lock:
            for state in list(self._sources.values()):
                if state.backend == backend:
                    self._clear(state)

    def retain(self, live: Iterable[str]) -> list[str]:
        keep = set(live)
        gone = self.fallback.retain(keep)
        for b in [b for b in self._spec if b not in keep]:
            del self._spec[b]
        return gone

    def set_capacity(self, backend: str, capacity_tokens: int) -> None:
        """Capacity only bounds the approximate side; precise entries mirror the engine's own LRU."""
        self.fallback.set_capacity(backend, capacity_tokens)

    def blocks(self, backend: str | None = None) -> int:
        """Engine-confirmed distinct blocks (per backend, or over all), plus approximate ones."""
        if backend is not None:
            if backend in self._covered:
                return self._backend_blocks.get(backend, 0)
            return self.fallback.blocks(backend)
        return sum(self._backend_blocks.values()) + self.fallback.blocks()

    def speculative_blocks(self, backend: str) -> int:
        s = self._spec.get(backend)
        return len(s) if s else 0

    def holders(self, key: int) -> dict[str, int]:
        """Copies per backend of one own key (a copy of the internal counts)."""
        return dict(self._holders.get(key, {}))


def _best_tier(copies: dict, tiers: dict | None) -> int:
    """The fastest tier any of an entry's copies is in (copies absent from ``tiers`` are in GPU memory)."""
    if tiers is None:
        return GPU
    best = len(TIER_NAMES)
    for tag in copies:
        t = tiers.get(tag, GPU)
        if t < best:
            if t == GPU:
                return GPU
            best = t
    return best
