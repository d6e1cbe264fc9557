"""The fake engine's prefix cache: deterministic byte tokens, chain-hashed blocks, LRU bounded in tokens.

It mirrors vLLM's automatic prefix caching closely enough for routing tests: only full blocks are cached, a
request's cached count is its longest run of leading cached blocks (the last prompt token is always computed),
and eviction drops the least recently used blocks, deepest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import xxhash

BYTES_PER_TOKEN = 4


def token_count(text: str) -> int:
    """Tokens of ``text`` under the fake tokenizer: one per 4 UTF-8 bytes, rounded up."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


def block_keys(text: str, block_tokens: int, max_tokens: int | None = None, salt: str | None = None) -> list[int]:
    """Chained XXH3-64 keys of the full blocks of ``text`` (optionally of its first ``max_tokens`` tokens);
    a ``cache_salt`` seeds the chain, as vLLM mixes it into block 0, so differently salted prompts share none."""
    data = text.encode("utf-8", "surrogatepass")
    usable = len(data) // BYTES_PER_TOKEN
    if max_tokens is not None:
        usable = min(usable, max_tokens)
    step = block_tokens * BYTES_PER_TOKEN
    keys: list[int] = []
    parent = xxhash.xxh3_64_intdigest(salt.encode("utf-8", "surrogatepass")) if salt else 0
    for start in range(0, (usable // block_tokens) * step, step):
        parent = xxhash.xxh3_64_intdigest(data[start:start + step], seed=parent)
        keys.append(parent)
    return keys


class PrefixCache:
    """LRU set of block keys holding at most ``capacity_tokens`` tokens; counts queries and hit tokens."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_tokens

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    @property
    def usage(self) -> float:
        """Fraction of capacity in use, in [0, 1]."""
        return len(self._blocks) / self.capacity_blocks if self.capacity_blocks else 0.0

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def match(self, keys: Iterable[int]) -> int:
        """Number of leading ``keys`` cached, without touching recency or counters."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def lookup(self, prompt: str, salt: str | None = None) -> int:
        """Cached tokens for ``prompt``: leading cached blocks of all but its last token; counts the query."""
        total = token_count(prompt)
        matched = self.match(block_keys(prompt, self.block_tokens, max(total - 1, 0), salt)) * self.block_tokens
        self.queries += 1
        self.query_tokens += total
        self.hit_tokens += matched
        return matched

    def insert(self, text: str, salt: str | None = None) -> None:
        """Store the full blocks of ``text`` as most recent (block 0 last, so deeper blocks are evicted first)."""
        if not self.capacity_blocks:
            return
        keys = block_keys(text, self.block_tokens, salt=salt)[: self.capacity_blocks]
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.evicted_blocks += 1

    def clear(self) -> None:
        self._blocks.clear()
