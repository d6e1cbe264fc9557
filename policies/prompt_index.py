"""Prompt index: which backend holds which whole prompts, as llama.cpp's server keeps them.

llama.cpp caches prompts, not blocks: each slot holds the prompt it last ran, and a host prompt cache keeps
whole earlier prompts (a prefix shared by several is stored once per prompt) up to a token budget, least
recently used dropped first but always at least one. A new request restores the cached prompt sharing most
with it (it leaves the cache for the slot), and a cached prompt the new one contains is dropped as obsolete.
A block index that counts a shared prefix once, and evicts single blocks, then believes a replica holds
contexts it lost (and the reverse). This index keeps the same entries per backend and answers the same
``PrefixLocator`` questions; ``evictions`` says how many held tokens a new prompt would push out.

| knob | meaning |
|---|---|
| ``cache_tokens`` | the host prompt cache's budget per backend, in the index's tokens (``set_capacity``) |
| ``slots`` | prompts held live in slots beside the cache (llama.cpp ``--parallel``) |
| ``value_half_life_s`` | the most a held prompt's worth takes to halve unused (``evictions`` weighs by it) |

A held prompt is worth what its conversation is likely to come back for. One whose request is still running is
worth all of it (for at most ``value_half_life_s``); an answered one loses half its worth every typical gap
between an answer and the conversation's next turn on this fleet (learned from the turns that came back: a later
prompt containing a held one), capped by ``value_half_life_s``, and trusted by how many turns came back, wholly from
8 (``ReturnGap``).
A fleet whose sessions answer in a second then no longer values a minute-old prompt of a finished conversation
like the live session beside it.

An entry's size is what the engine counted for it once it answered (``learn_size``: its prompt and answer, in the
engine's tokens, over the router's current engine-token ratio, ``set_token_ratio``), else its blocks: a budget
filled by estimates drifts with how the fingerprint's count compares with the tokenizer's on that text, and on
llama.cpp the budget is one or two prompts, where that drift decides which one is pushed out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.policies.prefix_index import LocatorParts
from kvroute.policies.return_gap import ReturnGap


@dataclass(frozen=True, slots=True)
class PromptIndexConfig:
    """Defaults: a 16k-token host cache, one slot, 64-token blocks (the block of the chained keys)."""

    cache_tokens: int = 16384
    slots: int = 1
    block_tokens: float = 64.0
    max_entries: int = 4096  # per backend, a memory bound far above what any budget keeps
    value_half_life_s: float = 60.0

    def __post_init__(self) -> None:
        if self.cache_tokens < 0 or self.slots < 1 or self.block_tokens <= 0 or self.max_entries < 2 \
                or not self.value_half_life_s > 0:
            raise ValueError("cache_tokens >= 0, slots >= 1, block_tokens > 0, max_entries >= 2 and "
                             "value_half_life_s > 0 required")


class _Backend:
    __slots__ = ("cache_tokens", "displaced", "engine_size", "entries", "next_id", "pending", "refs", "used")

    def __init__(self, cache_tokens: int) -> None:
        self.pending: set[int] = set()  # entries whose request has not been answered yet
        # pending entry -> the entries its recording dropped (id, keys, last use, engine size, pending): put back if
        # its request fails before the engine ran it
        self.displaced: dict[int, list[tuple[int, tuple[int, ...], float, int | None, bool]]] = {}
        self.engine_size: dict[int, int] = {}  # entry -> the engine's count of it (prompt and answer), once known
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # oldest first; the newest are the slots
        self.used: dict[int, float] = {}  # entry -> when it was last sent or answered
        self.refs: dict[int, int] = {}  # key -> entries holding it
        self.cache_tokens = cache_tokens
        self.next_id = 0


def _contains(a: Sequence[int], b: Sequence[int]) -> bool:
    """Prompt ``a`` holds all of prompt ``b``: every block, or every block but ``b``'s last when ``a`` is longer
    (that last block was partial, and ``a`` goes on where ``b``'s ended: a later turn of the same conversation)."""
    if not b:
        return False
    n = _common(a, b)
    return n == len(b) or (len(a) > len(b) and n == len(b) - 1)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chains share (chained keys: equal at n means equal up to n)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptIndex(LocatorParts):
    """Per-backend whole-prompt entries with llama.cpp's restore, obsolete and least-recently-used rules."""

    #: the engine reuses any token prefix of a held prompt: a session's home holds its whole tail (the last
    #: partial block of the index and the answer), token by token
    tail_block_tokens = 1

    def __init__(self, config: PromptIndexConfig | None = None) -> None:
        self.config = config or PromptIndexConfig()
        self._backends: dict[str, _Backend] = {}
        self.token_ratio = 1.0  # engine tokens per index token (``set_token_ratio``)
        self.gap = ReturnGap(self.config.value_half_life_s)  # from an answer to its conversation's next turn

    def set_token_ratio(self, ratio: float) -> None:
        """Engine tokens per index token: converts the engine's counts of answered entries into the index's."""
        if ratio > 0:
            self.token_ratio = ratio

    def learn_size(self, backend: str, keys: Sequence[int], engine_tokens: int) -> None:
        """The engine counted ``engine_tokens`` for the prompt ``keys`` it answered on ``backend`` (its answer
        included, which it keeps too): the newest entry of exactly ``keys`` is that big from now on."""
        state = self._backends.get(backend)
        if state is None or engine_tokens <= 0:
            return
        entry = tuple(keys)
        for eid in reversed(state.entries):
            if state.entries[eid] == entry:
                state.engine_size[eid] = int(engine_tokens)
                return

    def _size(self, state: _Backend, eid: int) -> float:
        """An entry's size in the index's tokens: the engine's count when it answered, else its blocks."""
        known = state.engine_size.get(eid)
        if known is not None:
            return known / self.token_ratio
        return len(state.entries[eid]) * self.config.block_tokens

    def _state(self, backend: str) -> _Backend:
        state = self._backends.get(backend)
        if state is None:
            state = self._backends[backend] = _Backend(self.config.cache_tokens)
        return state

    # --- capacity -------------------------------------------------------------------------------
    def set_capacity(self, backend: str, capacity_tokens: int) -> None:
        """The host prompt cache's budget in tokens (the slots' prompts come on top); evicts down to it."""
        state = self._state(backend)
        state.cache_tokens = max(0, int(capacity_tokens))
        self._evict(state)

    def capacity_blocks(self, backend: str) -> int:
        state = self._state(backend)
        return max(1, int(state.cache_tokens // self.config.block_tokens))

    # --- queries --------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], backends: Iterable[str], now: float) -> dict[str, int]:
        """Leading blocks of ``keys`` held per backend (some entry holds that prefix); none are omitted."""
        result: dict[str, int] = {}
        if not keys:
            return result
        for backend in backends:
            state = self._backends.get(backend)
            if state is None or keys[0] not in state.refs:
                continue
            refs = state.refs
            lo, hi = 1, len(keys)
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if keys[mid - 1] in refs:
                    lo = mid
                else:
                    hi = mid - 1
            result[backend] = lo
        return result

    def evictions(self, backend: str, keys: Sequence[int], now: float) -> float:
        """Tokens of other prompts ``backend`` would lose if it ran ``keys`` now: the restored entry's part
        past the shared prefix, and whole entries the cache budget then drops (what they share with ``keys``
        stays held and does not count), each weighed by how recently it was used (halving every
        ``value_half_life_s``: a prompt nobody came back to for minutes is worth little)."""
        state = self._backends.get(backend)
        if state is None or not state.entries:
            return 0.0
        _, lost = self._after(state, keys, then_saved=True)
        bt, half = self.config.block_tokens, self.value_half_life_s
        return sum(max(0.0, self._size(state, eid) - _common(state.entries[eid], keys) * bt)
                   * self._worth(state, eid, now, half) for eid in lost)

    def live_tokens(self, backend: str, now: float) -> float:
        """Tokens ``backend`` holds, each entry weighed by its worth (as ``evictions`` weighs them): what a new
        prompt placed beside them puts at risk, whatever its size turns out to be in the engine's tokens."""
        state = self._backends.get(backend)
        if state is None:
            return 0.0
        half = self.value_half_life_s
        return sum(self._size(state, eid) * self._worth(state, eid, now, half) for eid in state.entries)

    def _worth(self, state: _Backend, eid: int, now: float, half: float) -> float:
        """A running request's prompt is all there (unless it never came back); an answered one halves every
        ``half`` seconds unused."""
        return self.gap.worth(now - state.used.get(eid, now), eid in state.pending, half)

    @property
    def value_half_life_s(self) -> float:
        """How fast an answered prompt's worth halves: the learned gap to a conversation's next turn, capped by
        the configured half-life (``ReturnGap``)."""
        return self.gap.half_life_s

    def _note_return(self, state: _Backend, keys: Sequence[int], now: float) -> None:
        """``keys`` continues a held, answered prompt (a conversation's next turn): learn how long it took."""
        for eid in reversed(state.entries):
            entry = state.entries[eid]
            if eid not in state.pending and len(entry) < len(keys) and _contains(keys, entry):
                self.gap.note(now - state.used.get(eid, now))
                return

    def holdings(self, backends: Sequence[str]) -> tuple[list[int], list[int]]:
        blocks, caps = [], []
        for b in backends:
            caps.append(self.capacity_blocks(b))
            blocks.append(self.blocks(b))
        return blocks, caps

    def blocks(self, backend: str | None = None) -> int:
        if backend is not None:
            state = self._backends.get(backend)
            return len(state.refs) if state else 0
        return sum(len(s.refs) for s in self._backends.values())

    def backends(self) -> list[str]:
        return list(self._backends)

    # --- updates --------------------------------------------------------------------------------
    def _after(self, state: _Backend, keys: Sequence[int],
               then_saved: bool = False) -> tuple[list[int], list[int]]:
        """(entry ids kept, entry ids lost) if ``keys`` ran now, in llama.cpp's order: the prompt of the slot it
        takes (the least recently given of the newest ``slots`` entries) is saved into the host cache unless a
        cached entry holds it already, dropping the cached entries it contains and then the oldest until it fits;
        the cached entry sharing more with ``keys`` than the slot's prompt does (for its own length and for
        ``keys``'), and at least a quarter of itself, is restored into the slot; the oldest go while the cache is
        over budget (one always stays). ``then_saved``: also make room for ``keys`` itself, as its own save will
        when the next request takes its slot (what placing it there costs the prompts held there)."""
        entries = state.entries
        ids = list(entries)
        live = ids[max(0, len(ids) - self.config.slots):]
        cache = ids[: len(ids) - len(live)]
        slot = live[0] if live else None
        lost: list[int] = []
        budget = state.cache_tokens

        def make_room(saved: Sequence[int], size: float) -> None:
            cache[:] = [c for c in cache if not _contains(saved, entries[c])]  # obsolete: ``saved`` holds them
            total = sum(self._size(state, c) for c in cache)
            while cache and total + size > budget:
                total -= self._size(state, cache[0])
                lost.append(cache.pop(0))

        if slot is not None and not any(_contains(entries[c], entries[slot]) for c in cache):
            make_room(entries[slot], self._size(state, slot))
            cache.append(slot)
        best, best_n = None, _common(entries[slot], keys) if slot is not None else 0
        keep_best = best_n / len(entries[slot]) if slot is not None else -1.0
        for c in cache:
            e = entries[c]
            n = _common(e, keys)
            if n * 4 >= len(e) and n > best_n and n / len(e) > keep_best:
                best, best_n, keep_best = c, n, n / len(e)
        if best is not None:
            cache.remove(best)
            if not _contains(keys, entries[best]):
                lost.append(best)  # restored into the slot: what ``keys`` does not share with it is overwritten
        total = sum(self._size(state, c) for c in cache)
        while len(cache) > 1 and total > budget:
            total -= self._size(state, cache[0])
            lost.append(cache.pop(0))
        while len(cache) + len(live) + 1 > self.config.max_entries:
            lost.append(cache.pop(0))
        if then_saved and not any(_contains(entries[c], keys) for c in cache):
            make_room(keys, len(keys) * self.config.block_tokens)
        kept = cache + [e for e in live if e != slot]
        return kept, lost

    def record(self, backend: str, keys: Sequence[int], now: float) -> None:
        """``backend`` was given the prompt ``keys``: it becomes the newest entry, by the rules of ``_after``."""
        if keys:
            self._add(self._state(backend), keys, now, sent=True)

    def _add(self, state: _Backend, keys: Sequence[int], now: float, *, sent: bool) -> None:
        """``keys`` becomes the newest entry; ``sent``: its request runs now (else it was answered already)."""
        if sent:
            self._note_return(state, keys, now)
        kept, _ = self._after(state, keys)
        keep = set(kept)
        dropped = [e for e in state.entries if e not in keep]
        displaced = [(e, state.entries[e], state.used.get(e, now), state.engine_size.get(e), e in state.pending)
                     for e in dropped]
        for e in dropped:
            self._drop(state, e)
        eid = state.next_id
        state.next_id += 1
        entry = tuple(keys)
        state.entries[eid] = entry
        state.used[eid] = now
        if sent:
            state.pending.add(eid)
            if displaced:
                state.displaced[eid] = displaced
        self._ref(state, entry)

    def _drop(self, state: _Backend, eid: int) -> None:
        state.used.pop(eid, None)
        state.pending.discard(eid)
        state.displaced.pop(eid, None)
        state.engine_size.pop(eid, None)
        self._unref(state, state.entries.pop(eid))

    def _ref(self, state: _Backend, entry: tuple[int, ...]) -> None:
        for key in entry:
            state.refs[key] = state.refs.get(key, 0) + 1

    def _unref(self, state: _Backend, entry: tuple[int, ...]) -> None:
        for key in entry:
            left = state.refs[key] - 1
            if left:
                state.refs[key] = left
            else:
                del state.refs[key]

    def _evict(self, state: _Backend) -> None:
        ids = list(state.entries)
        cached = ids[: max(0, len(ids) - self.config.slots)]
        total = sum(self._size(state, eid) for eid in cached)
        for eid in cached[:-1]:
            if total <= state.cache_tokens:
                break
            total -= self._size(state, eid)
            self._drop(state, eid)

    def confirm(self, backend: str, keys: Sequence[int], cached_blocks: int, now: float,
                predicted_blocks: int | None = None) -> None:
        """After a request the engine holds its whole prompt: re-record it if the entries lost it meanwhile."""
        if keys and self.match(keys, [backend], now).get(backend, 0) < len(keys):
            self._add(self._state(backend), keys, now, sent=False)
            return
        state = self._backends.get(backend)
        if state is not None and state.entries:  # answered: the newest entry holding it was just used
            entry = tuple(keys)
            for eid in reversed(state.entries):
                if state.entries[eid][: len(entry)] == entry:
                    state.used[eid] = now
                    state.pending.discard(eid)
                    state.displaced.pop(eid, None)
                    break

    def forget(self, backend: str, keys: Sequence[int], computed_blocks: int = 0) -> None:
        """The request for the prompt ``keys`` failed before the engine ran it (``computed_blocks``, what it already
        held, stays held): its entry goes, and the entries its recording pushed out come back, as the engine
        never saved or restored anything for it; the budget then holds as always."""
        state = self._backends.get(backend)
        if state is None:
            return
        entry = tuple(keys)
        found = None  # the newest entry of the prompt, a pending one first
        for eid in reversed(state.entries):
            if state.entries[eid] == entry:
                if eid in state.pending:
                    found = eid
                    break
                found = eid if found is None else found
        if found is None:
            return
        displaced = state.displaced.get(found, [])
        self._drop(state, found)
        for eid, held, used, size, pending in displaced:
            if eid in state.entries:
                continue
            state.entries[eid] = held
            state.used[eid] = used
            if size is not None:
                state.engine_size[eid] = size
            if pending:
                state.pending.add(eid)
            self._ref(state, held)
        if displaced:
            state.entries = OrderedDict(sorted(state.entries.items()))
            self._evict(state)

    def forget_before(self, backend: str, before: float) -> None:
        """``backend``'s engine restarted after ``before``: drop every prompt last sent or answered no later
        than that (what the new engine was given since stays)."""
        state = self._backends.get(backend)
        if state is None:
            return
        for eid in [eid for eid in state.entries if state.used.get(eid, before) <= before]:
            self._drop(state, eid)

    def remove_backend(self, backend: str) -> None:
        self._backends.pop(backend, None)

    def retain(self, live: Iterable[str]) -> list[str]:
        keep = set(live)
        gone = [b for b in self._backends if b not in keep]
        for b in gone:
            del self._backends[b]
        return gone

