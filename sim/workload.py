"""What the simulator replays: requests as block keys and sizes (never text), plus how they arrive.

A ``SimRequest`` arrives at ``arrival`` seconds, or — when ``follows`` names an earlier request —
``delay`` seconds after that request completes (closed-loop sessions, agent steps, fixed concurrency).
``keys`` are chained block keys of ``block_tokens`` tokens each (key k covers blocks 0..k), the same
keys the router and the simulated engines use; a ``llamacpp`` fleet's engines also need ``tokens`` (the prompt's
token ids: llama.cpp reuses any token prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvroute.policies.fingerprint import chain_seed

_xxh3 = xxhash.xxh3_64_intdigest
_PACK = (1 << 64) - 1


@dataclass(slots=True)
class SimRequest:
    """One request: sizes in tokens, chained keys of its full blocks, arrival or predecessor."""

    prompt_tokens: int
    output_tokens: int
    keys: list[int]
    arrival: float = 0.0
    follows: int | None = None
    delay: float = 0.0
    session: str | None = None
    app: str | None = None
    cache_prefix_blocks: int | None = None
    stage: int = 0
    tokens: tuple[int, ...] | None = None  # the prompt's token ids, for engines that reuse token prefixes
    answer_tokens: tuple[int, ...] = ()  # the token ids it generates, where known (a llama.cpp slot keeps them)
    time_factor: float = 1.0  # its engine steps take this many times the model's (a llama.cpp replica's run-to-run
    # variation, as a calibration replays it; the block-cache replica does not read it)


@dataclass(slots=True)
class Workload:
    """A named list of requests sharing one block size, with notes on every assumption it makes."""

    name: str
    block_tokens: int
    requests: list[SimRequest]
    notes: list[str] = field(default_factory=list)
    stages: list[tuple[str, float]] = field(default_factory=list)
    first_pass: int | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")


class SegmentKeys:
    """Chained block keys for prompts made of segments ``(segment_id, length)`` (content = id + offset).

    Two prompts share block k exactly when their first ``(k+1)·block_tokens`` tokens come from the same
    segments at the same offsets: what equal token ids give a real engine. Prefix states are memoised,
    so a shared system prompt is hashed once however many requests reuse it.
    """

    def __init__(self, block_tokens: int, model: str = "sim", salt: str | None = None,
                 max_memo: int = 200_000) -> None:
        self.block_tokens = block_tokens
        self.seed = chain_seed(model, salt)
        self._memo: dict[tuple[tuple[int, int], ...], tuple[tuple[int, ...], int, tuple[int, ...], int]] = {}
        self._max_memo = max_memo

    def keys(self, segments: Sequence[tuple[int, int]]) -> list[int]:
        """Keys of the full blocks of the concatenated segments (a trailing partial block has none)."""
        return list(self._state(tuple(segments))[0])

    def _state(self, segs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
        if not segs:
            return ((), self.seed, (), 0)
        got = self._memo.get(segs)
        if got is not None:
            return got
        keys, h, parts, fill = self._state(segs[:-1])
        sid, length = segs[-1]
        bt = self.block_tokens
        new_keys = list(keys)
        parts_l = list(parts)
        off = 0
        while off < length:
            take = min(bt - fill, length - off)
            parts_l.extend((sid & _PACK, off, take))
            fill += take
            off += take
            if fill == bt:
                h = _xxh3(repr(parts_l).encode(), h)
                new_keys.append(h)
                parts_l = []
                fill = 0
        state = (tuple(new_keys), h, tuple(parts_l), fill)
        if len(self._memo) >= self._max_memo:
            self._memo.clear()
        self._memo[segs] = state
        return state


def id_keys(ids: Sequence[int], seed: int, chained_ids: bool) -> list[int]:
    """Keys from a trace's block ids: prefix-chained ids (Mooncake) map 1:1, per-block ids get chained."""
    out: list[int] = []
    h = seed
    for i in ids:
        data = (int(i) & _PACK).to_bytes(8, "little")
        h = _xxh3(data, seed) if chained_ids else _xxh3(data, h)
        out.append(h)
    return out
