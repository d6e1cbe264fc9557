"""Wasted prefill: prefix tokens a replica computed while another replica already held them.

Computed in the harness from what each request's engine reported, one run at a time. For request ``i``:

- ``P_i`` prompt tokens and ``c_i`` cached tokens, as its engine reported them (``usage.prompt_tokens`` and
  ``usage.prompt_tokens_details.cached_tokens``, or llama.cpp's ``timings.cache_n``);
- ``r_i`` the replica that answered (the engine's ``system_fingerprint``: the fake engine stamps its replica name;
  llama.cpp stamps its build, the same on every replica, so there ``r_i`` is unknown);
- ``H_i`` the longest prefix of request ``i``'s prompt that another replica had already been sent: the longest
  common prefix, cut to whole blocks of ``block_bytes`` bytes (prompts rendered with the fake engine's chat
  template), between ``i``'s prompt and the prompt + answer of any request ``j`` that finished before ``i`` was
  sent and was answered by a replica ``r_j ≠ r_i``, converted to tokens at ``i``'s own bytes-per-token ratio.

Then ``wasted_i = max(0, min(H_i, P_i − 1) − c_i)`` (an engine always computes a prompt's last token), and a run's
wasted prefill is ``Σ wasted_i / Σ P_i``: the share of all prompt tokens that were computed again although
another replica held them. "Held" means "had been sent", so a prefix the other replica evicted meanwhile still
counts. Where the replica is unknown, ``H_i`` is taken over every earlier request, whichever replica answered it:
an upper bound that also counts a replica recomputing its own evicted prefix (``exact`` is then False).

``in_flight=True`` widens "earlier" from "finished before ``i`` was sent" to "sent before ``i``": it also counts
a prefix computed on a second replica while the first was still computing it (two requests of one prefix placed
apart under load), which the default leaves out because no replica held those tokens yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

BLOCK_BYTES = 64  # 16 fake-engine tokens, the fake engine's (and vLLM's) block


@dataclass(frozen=True)
class Served:
    """What the harness knows about one answered request."""

    prompt: str
    answer: str
    replica: str | None
    prompt_tokens: int
    cached_tokens: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Waste:
    """A run's wasted prefill: tokens, their share of all prompt tokens, and whether replicas were known."""

    tokens: int
    share: float
    exact: bool


def _block_keys(text: str, block_bytes: int) -> list[int]:
    data = text.encode("utf-8", "surrogatepass")
    keys, parent = [], 0
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        parent = xxhash.xxh3_64_intdigest(data[start:start + block_bytes], seed=parent)
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class Holding:
    """What the fleet held of one request's prompt when it was sent, in tokens (at its own bytes per token):
    another replica through requests finished by then (``other_finished``) or sent by then (``other_sent``, in
    flight too), and its own replica through requests sent by then (``own_sent``). Where replicas are unknown,
    "another" means any replica."""

    other_finished: int
    other_sent: int
    own_sent: int


def holdings(served: Sequence[Served], block_bytes: int = BLOCK_BYTES) -> list[Holding]:
    """One ``Holding`` per request of ``served``, in the same order."""
    exact = all(s.replica is not None for s in served)
    by_end = sorted(served, key=lambda s: s.end_s)
    by_start = sorted(served, key=lambda s: s.start_s)
    finished: dict[int, set[str | None]] = {}  # block key → replicas that had answered a request holding it
    sent: dict[int, set[str | None]] = {}  # block key → replicas that had been sent a request holding it
    done = went = 0
    out: dict[int, Holding] = {}
    for s in by_start:
        while done < len(by_end) and by_end[done].end_s <= s.start_s:
            f = by_end[done]
            for key in _block_keys(f.prompt + f.answer, block_bytes):
                finished.setdefault(key, set()).add(f.replica)
            done += 1
        while went < len(by_start) and by_start[went].start_s < s.start_s:
            f = by_start[went]
            for key in _block_keys(f.prompt + f.answer, block_bytes):
                sent.setdefault(key, set()).add(f.replica)
            went += 1
        depth = {"other_finished": 0, "other_sent": 0, "own_sent": 0}
        live = set(depth)
        for n, key in enumerate(_block_keys(s.prompt, block_bytes), 1):
            fin, snt = finished.get(key, ()), sent.get(key, ())
            held = {"other_finished": any(r != s.replica or not exact for r in fin),
                    "other_sent": any(r != s.replica or not exact for r in snt),
                    "own_sent": exact and s.replica in snt}
            live = {k for k in live if held[k]}
            if not live:
                break
            for k in live:
                depth[k] = n
        prompt_bytes = len(s.prompt.encode("utf-8", "surrogatepass")) or 1
        out[id(s)] = Holding(**{k: int(v * block_bytes * s.prompt_tokens / prompt_bytes) for k, v in depth.items()})
    return [out[id(s)] for s in served]


def wasted_prefill(served: Sequence[Served], block_bytes: int = BLOCK_BYTES, in_flight: bool = False) -> Waste:
    """The run's wasted prefill as the module docstring defines it (requests in any order)."""
    exact = all(s.replica is not None for s in served)
    total_prompt = total_wasted = 0
    for s, h in zip(served, holdings(served, block_bytes), strict=True):
        held_tokens = h.other_sent if in_flight else h.other_finished
        total_wasted += max(0, min(held_tokens, s.prompt_tokens - 1) - s.cached_tokens)
        total_prompt += s.prompt_tokens
    return Waste(total_wasted, round(total_wasted / total_prompt, 4) if total_prompt else 0.0, exact)
