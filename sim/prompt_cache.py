"""llama.cpp's host prompt cache (``--cache-ram``) as its server keeps it: whole prompts, token-granular reuse.

The simulator's ``llamacpp`` replicas (``sim/replica_llamacpp.py``) and the fake engine's llama.cpp model
(``plugin/dev/fake_llamacpp.py``) both run this one model. A slot holds the last sequence it ran (the prompt and
the tokens it generated, all but the last). With ``--slot-prompt-similarity 0`` every request that takes a slot
updates the cache first (``HostPromptCache.take``):

1. save: the slot's sequence becomes the newest entry, unless an entry already contains it or it alone exceeds
   the byte budget; entries it contains are dropped as obsolete; then the oldest entries go until it fits;
2. restore: scanning oldest first, an entry that covers at least a quarter of itself with its common prefix with
   the new prompt, and beats the best so far (the slot's own sequence to start with; an empty slot loses to any)
   on both the kept share (common prefix / entry) and the covered share (common prefix / new prompt), wins; the
   winner moves into the slot and leaves the cache;
3. trim: the oldest entries go while the cache is over budget (one always stays).

The request then reuses the common prefix of the slot's sequence and its prompt, but never the prompt's last token
(``reused``). Sizes are in the engine's tokens: an entry of ``n`` tokens costs ``n · state_bytes_per_token`` bytes.
Sequences are anything sliceable and comparable (token id tuples, or bytes with ``tokens_per_unit`` tokens each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S", bound=Sequence)

#: "don't trash large prompts": an entry is restored only when the new prompt keeps this share of it
MIN_KEEP = 0.25


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (binary search over slices compared in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class PromptCacheConfig:
    """``budget_bytes``: ``--cache-ram`` in bytes; ``state_bytes_per_token``: one cached token's state (K and V of
    every layer plus cell metadata); ``tokens_per_unit``: engine tokens per sequence element."""

    budget_bytes: int
    state_bytes_per_token: float
    tokens_per_unit: float = 1.0

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or not self.state_bytes_per_token > 0 or not self.tokens_per_unit > 0:
            raise ValueError("budget_bytes >= 0, state_bytes_per_token > 0 and tokens_per_unit > 0 required")

    @property
    def budget_tokens(self) -> int:
        """How many cached tokens the budget holds."""
        return int(self.budget_bytes // self.state_bytes_per_token)


class HostPromptCache(Generic[S]):
    """One server's prompt cache: entries oldest first, the save/restore/trim rules of the module docstring."""

    def __init__(self, config: PromptCacheConfig) -> None:
        self.config = config
        self.entries: list[S] = []
        self.evicted = 0  # entries dropped for room or by the trim (not the obsolete ones)
        self.restored = 0

    def tokens(self, seq: Sequence) -> int:
        """Engine tokens of ``len(seq)`` sequence elements (rounded up)."""
        return -int(-len(seq) * self.config.tokens_per_unit // 1)

    def _bytes(self, seq: Sequence) -> float:
        return self.tokens(seq) * self.config.state_bytes_per_token

    @property
    def used_tokens(self) -> int:
        return sum(self.tokens(e) for e in self.entries)

    def _size(self) -> float:
        return sum(self._bytes(e) for e in self.entries)

    def save(self, seq: S) -> None:
        """Store a slot's sequence (rule 1)."""
        if not seq or self.config.budget_bytes <= 0:
            return
        if any(common_prefix(e, seq) == len(seq) for e in self.entries):
            return  # already held
        size = self._bytes(seq)
        if size > self.config.budget_bytes:
            return  # "exceeds cache size limit, skipping"
        self.entries = [e for e in self.entries if common_prefix(e, seq) < len(e)]  # obsolete ones go
        while self.entries and self._size() + size > self.config.budget_bytes:
            self.entries.pop(0)
            self.evicted += 1
        self.entries.append(seq)

    def restore(self, slot: S | None, prompt: Sequence) -> S | None:
        """What the slot holds for ``prompt`` (rule 2): a better entry leaves the cache for it, else ``slot``."""
        n_new = max(1, len(prompt))
        if slot:
            best = common_prefix(slot, prompt)
            keep_best, sim_best = best / len(slot), best / n_new
        else:
            keep_best, sim_best = -1.0, 0.0
        winner = None
        for i, e in enumerate(self.entries):
            lcp = common_prefix(e, prompt)
            keep, sim = lcp / max(1, len(e)), lcp / n_new
            if keep < MIN_KEEP:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, winner = keep, sim, i
        if winner is None:
            return slot
        self.restored += 1
        return self.entries.pop(winner)

    def trim(self) -> None:
        """Rule 3: the oldest entries go while over budget, one always stays."""
        while len(self.entries) > 1 and self._size() > self.config.budget_bytes:
            self.entries.pop(0)
            self.evicted += 1

    def take(self, slot: S | None, prompt: Sequence) -> S | None:
        """A request for ``prompt`` takes a slot holding ``slot``: save, restore, trim; the slot's sequence now."""
        if slot:
            self.save(slot)
        held = self.restore(slot, prompt)
        self.trim()
        return held

    def reused(self, held: Sequence | None, prompt: Sequence) -> int:
        """Engine tokens of ``prompt`` the slot holding ``held`` reuses (never the last one)."""
        if not held or not prompt:
            return 0
        return max(0, min(int(common_prefix(held, prompt) * self.config.tokens_per_unit), self.tokens(prompt) - 1))

    def holds(self, prompt: Sequence) -> int:
        """The longest common prefix of ``prompt`` with any entry, in engine tokens (what a restore could reach)."""
        return int(max((common_prefix(e, prompt) for e in self.entries), default=0) * self.config.tokens_per_unit)

    def clear(self) -> None:
        self.entries.clear()
