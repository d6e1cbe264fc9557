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


def wasted_prefill(served: Sequence[Served], block_bytes: int = BLOCK_BYTES, in_flight: bool = False) -> Waste:
    """The run's wasted prefill as the module docstring defines it (requests in any order)."""
    exact = all(s.replica is not None for s in served)
    finished = sorted(served, key=(lambda s: s.start_s) if in_flight else (lambda s: s.end_s))
    holders: dict[int, set[str | None]] = {}  # block key → replicas that had been sent that prefix
    done = 0
    total_prompt = total_wasted = 0
    for s in sorted(served, key=lambda s: s.start_s):
        while done < len(finished) and (finished[done].start_s < s.start_s if in_flight
                                         else finished[done].end_s <= s.start_s):
            f = finished[done]
            for key in _block_keys(f.prompt + f.answer, block_bytes):
                holders.setdefault(key, set()).add(f.replica)
            done += 1
        held_blocks = 0
        for key in _block_keys(s.prompt, block_bytes):
            owners = holders.get(key)
            if not owners or (exact and owners == {s.replica}):
                break
            held_blocks += 1
        prompt_bytes = len(s.prompt.encode("utf-8", "surrogatepass")) or 1
        held_tokens = int(held_blocks * block_bytes * s.prompt_tokens / prompt_bytes)
        total_wasted += max(0, min(held_tokens, s.prompt_tokens - 1) - s.cached_tokens)
        total_prompt += s.prompt_tokens
    return Waste(total_wasted, round(total_wasted / total_prompt, 4) if total_prompt else 0.0, exact)
