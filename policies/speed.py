"""Engine speed: how many seconds a prefill costs, as a prior that the ``LoadTracker`` rescales online.

A prefill of ``u`` new tokens after ``m`` cached ones, chunked at ``chunk_tokens`` per engine step::

    prefill_s(u, m) = u / prefill_tok_s + attn_s · u · (m + u / 2) + ⌈u / chunk⌉ · step_s

(linear GEMM work, attention of the new tokens over their context, one step floor per chunk). The
defaults are a Qwen3-32B TP2 H100 replica (the simulator's default preset); other engines differ
mostly by a constant factor, which the tracker learns from observed time to first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSpeed:
    """Prior speed of one replica; all times in seconds (``slots``: sequences the engine runs at once)."""

    prefill_tok_s: float = 18_900.0
    attn_s: float = 2.0e-9
    step_s: float = 0.014
    decode_s_per_seq: float = 1.0e-4
    chunk_tokens: int = 8192
    slots: int = 256

    def __post_init__(self) -> None:
        if not self.prefill_tok_s > 0:
            raise ValueError("prefill_tok_s must be positive")
        for name in ("attn_s", "step_s", "decode_s_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.chunk_tokens < 1 or self.slots < 1:
            raise ValueError("chunk_tokens and slots must be >= 1")

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to compute ``new_tokens`` after ``cached_tokens`` (at least one token is computed)."""
        u = max(1.0, new_tokens)
        steps = math.ceil(u / self.chunk_tokens)
        return u / self.prefill_tok_s + self.attn_s * u * (cached_tokens + u / 2.0) + steps * self.step_s
