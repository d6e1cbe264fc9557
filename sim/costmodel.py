"""Engine step-time model for continuous batching with chunked prefill.

One engine step runs up to ``chunk_tokens`` tokens: one decode token per running sequence plus chunks
of prompts being prefilled. Its duration is::

    step = step_overhead_s                                  # weights read, kernel launches
         + prefill_tokens / prefill_tok_s                   # linear (GEMM) prefill work
         + attn_s · Σ_chunks chunk · (start + chunk / 2)    # attention of new tokens over their context
         + decode_s_per_seq · decode_seqs                   # per-sequence sampling / bookkeeping
         + kv_read_s_per_token · decode_context_tokens      # KV read of every decoding sequence

A run of ``k`` decode-only steps with ``n`` sequences of total context ``c0`` has the closed form
``k·(overhead + n·per_seq + kv·c0) + kv·n·k(k−1)/2`` (each step adds ``n`` context tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-replica engine speed; all times in seconds."""

    prefill_tok_s: float
    attn_s: float
    step_overhead_s: float
    decode_s_per_seq: float
    kv_read_s_per_token: float
    chunk_tokens: int
    max_running: int

    def __post_init__(self) -> None:
        if self.prefill_tok_s <= 0:
            raise ValueError("prefill_tok_s must be positive")
        for name in ("attn_s", "step_overhead_s", "decode_s_per_seq", "kv_read_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.chunk_tokens < 1 or self.max_running < 1:
            raise ValueError("chunk_tokens and max_running must be >= 1")

    def slower(self, factor: float) -> CostModel:
        """This engine on a host ``factor`` times slower (every compute time times ``factor``; the same batch
        limits): how a measured host speed is given to a model."""
        if not factor > 0:
            raise ValueError("factor must be positive")
        return replace(self, prefill_tok_s=self.prefill_tok_s / factor, attn_s=self.attn_s * factor,
                       step_overhead_s=self.step_overhead_s * factor, decode_s_per_seq=self.decode_s_per_seq * factor,
                       kv_read_s_per_token=self.kv_read_s_per_token * factor)

    def chunk_attention(self, start: int, chunk: int) -> float:
        """Attention seconds for ``chunk`` new tokens after ``start`` already computed ones."""
        return self.attn_s * chunk * (start + chunk / 2.0)

    def step_time(self, prefill_tokens: int, prefill_attention_s: float, decode_seqs: int,
                  decode_context: int) -> float:
        """Duration of one mixed step (``prefill_attention_s`` from ``chunk_attention``)."""
        return (self.step_overhead_s + prefill_tokens / self.prefill_tok_s + prefill_attention_s
                + self.decode_s_per_seq * decode_seqs + self.kv_read_s_per_token * decode_context)

    def decode_run(self, steps: int, seqs: int, context: int) -> float:
        """Duration of ``steps`` decode-only steps of ``seqs`` sequences starting at ``context`` tokens."""
        if steps <= 0:
            return 0.0
        base = self.step_overhead_s + self.decode_s_per_seq * seqs + self.kv_read_s_per_token * context
        return steps * base + self.kv_read_s_per_token * seqs * steps * (steps - 1) / 2.0

    def decode_steps_before(self, elapsed: float, seqs: int, context: int) -> int:
        """Smallest ``j ≥ 1`` whose decode run lasts at least ``elapsed`` (the step running then ends at j)."""
        base = self.step_overhead_s + self.decode_s_per_seq * seqs + self.kv_read_s_per_token * context
        a = self.kv_read_s_per_token * seqs / 2.0
        if a <= 0:
            j = math.ceil(elapsed / base) if base > 0 else 1
        else:  # a·j² + (base − a)·j − elapsed ≥ 0
            b = base - a
            j = math.ceil((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
        j = max(1, j)
        while j > 1 and self.decode_run(j - 1, seqs, context) >= elapsed:
            j -= 1
        while self.decode_run(j, seqs, context) < elapsed:
            j += 1
        return j

    def cold_prefill_s(self, tokens: int) -> float:
        """Time to first token of one request alone on an idle engine (chunked prefill + nothing else)."""
        return self.prefill_alone_s(0, tokens)

    def prefill_alone_s(self, cached: int, tokens: int) -> float:
        """Time to first token of a request that computes ``tokens`` new tokens after ``cached`` ones, alone on
        an idle engine in full chunks. No schedule does it faster: every step pays the overhead, linear work is
        per token, and the attention of a token range is the same however it is cut into chunks."""
        done, total = 0, 0.0
        while done < tokens:
            chunk = min(self.chunk_tokens, tokens - done)
            total += self.step_time(chunk, self.chunk_attention(cached + done, chunk), 0, 0)
            done += chunk
        return total
