"""The fake engine's llama.cpp model (``--engine-model llamacpp``): what a llama.cpp replica of the bench does.

One model of the engine with the simulator's ``llamacpp`` preset (``sim/presets.py``): a slot holds the last
sequence it ran (prompt and generated tokens but the last), llama.cpp's host prompt cache of whole prompts decides
what a request that takes the slot reuses (``sim/prompt_cache.py``: save, restore, trim; token-granular, never the
last prompt token), and prefill and decode take the preset's step times. Tokens are the model's own when a
``tokenizer.json`` is given (the tiny model's: the bench's prompts then count exactly as on llama.cpp), else
``tokens_per_byte`` of the text's UTF-8 bytes. Answers are ``max_tokens`` words of one token each (``answer``):
llama.cpp's tiny model generates ``max_tokens`` tokens, and the next turn grows by as many.

``HostCores`` shares a host's cores between the replica processes of one fleet: a replica computing keeps a file
in a directory they all see, and while ``k`` of them compute each advances at ``min(1, cores / (k + background))``
of its speed (llama.cpp replicas of one thread on fewer cores than replicas slow each other down so).

``drawn`` gives a request its share of the variation llama.cpp's own times show from run to run (``--time-jitter``:
relative deviations measured by ``bench/calibrate_jitter.py``): one deviation a request, drawn by its tokens, so the
same request draws the same whatever order requests arrive in, and a run with other prompts draws anew.
"""

from __future__ import annotations

import asyncio
import os
import random
from array import array
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvroute.sim.presets import Preset, get_preset
from kvroute.sim.prompt_cache import HostPromptCache, PromptCacheConfig

Seq = tuple[int, ...] | bytes
ANSWER_WORD = "ok"  # a generated token, as text (the simulator's calibration answers with the same words)


class HostCores:
    """Processor sharing across processes through marker files in ``directory`` (one per computing replica)."""

    poll_s = 0.003

    def __init__(self, directory: str | Path, cores: float, name: str, background: float = 0.0) -> None:
        if not cores > 0 or background < 0:
            raise ValueError("cores > 0 and background >= 0 required")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cores = cores
        self.background = background
        self.marker = self.directory / name
        self.marker.unlink(missing_ok=True)  # a crashed predecessor's
        self._depth = 0

    def computing(self) -> int:
        """Replicas computing now (this one included while it does)."""
        try:
            return len(os.listdir(self.directory))
        except OSError:
            return 1

    def rate(self) -> float:
        return min(1.0, self.cores / (max(1, self.computing()) + self.background))

    async def run(self, seconds: float) -> None:
        """Wait until ``seconds`` of this replica's own compute are done at the shared rate."""
        if seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        self._depth += 1
        if self._depth == 1:
            self.marker.touch()
        try:
            left = seconds
            last = loop.time()
            rate = self.rate()
            while left > 1e-6:
                await asyncio.sleep(min(self.poll_s, left / rate))
                now = loop.time()
                left -= (now - last) * rate
                last = now
                rate = self.rate()
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.marker.unlink(missing_ok=True)


def drawn(pool: Sequence[float], seq: Seq) -> float:
    """One value of ``pool`` (0.0 when empty) for the request whose tokens are ``seq``, seeded by them."""
    if not pool:
        return 0.0
    data = seq if isinstance(seq, bytes) else array("q", seq).tobytes()
    return random.Random(xxhash.xxh64_intdigest(data)).choice(pool)


class LlamaCppModel:
    """One llama.cpp replica's slot and host prompt cache, and its step times (``--parallel 1``)."""

    def __init__(self, cache_ram_mib: float, tokenizer: str | None = None, preset: Preset | None = None) -> None:
        self.preset = preset or get_preset("llamacpp")
        spec = self.preset.llamacpp
        if spec is None:
            raise ValueError(f"preset {self.preset.name} has no llama.cpp spec")
        self.spec = spec
        self._tokenizer = _load_tokenizer(tokenizer) if tokenizer else None
        per_unit = 1.0 if self._tokenizer is not None else spec.tokens_per_byte
        self.cache: HostPromptCache[Seq] = HostPromptCache(PromptCacheConfig(
            budget_bytes=int(cache_ram_mib * 1024 * 1024), state_bytes_per_token=spec.state_bytes_per_token,
            tokens_per_unit=per_unit))
        self.slot: Seq = b"" if self._tokenizer is None else ()

    # --- tokens ---------------------------------------------------------------------------------
    def encode(self, text: str) -> Seq:
        """The sequence llama.cpp would hold for ``text``: token ids, or UTF-8 bytes without a tokenizer."""
        if self._tokenizer is None:
            return text.encode("utf-8", "surrogatepass")
        return tuple(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def tokens(self, seq: Sequence) -> int:
        return self.cache.tokens(seq)

    @staticmethod
    def answer(max_tokens: int) -> str:
        """The text of an answer of ``max_tokens`` tokens: one short word a token (the tiny model's tokenizer
        counts ``ok`` as one), so a conversation grows by what llama.cpp's answers add to it."""
        return " ".join([ANSWER_WORD] * max_tokens)

    # --- the slot -------------------------------------------------------------------------------
    def take(self, prompt: Seq) -> int:
        """A request takes the slot: the cache's save/restore/trim; the prompt tokens it reuses."""
        held = self.cache.take(self.slot or None, prompt)
        return self.cache.reused(held, prompt)

    def keep(self, prompt: Seq, output: str, output_tokens: int) -> None:
        """What the slot holds once the request ran: its prompt and its generated tokens but the last."""
        generated = self.encode(output)
        if self._tokenizer is None:
            keep = int(max(0, output_tokens - 1) / self.spec.tokens_per_byte)
        else:
            keep = max(0, output_tokens - 1)
        self.slot = prompt + generated[:keep]  # type: ignore[operator]

    # --- timing ---------------------------------------------------------------------------------
    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds of compute for ``new_tokens`` after ``cached_tokens`` (chunks of ``n_batch``), alone."""
        return self.preset.cost.prefill_alone_s(cached_tokens, max(1, new_tokens))

    def decode_s(self, context_tokens: int) -> float:
        """Seconds of compute of one decode step at ``context_tokens``."""
        return self.preset.cost.step_time(0, 0.0, 1, context_tokens)

    @property
    def used_tokens(self) -> int:
        return self.cache.used_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.cache.config.budget_tokens

    @property
    def evicted_blocks(self) -> int:
        return self.cache.evicted

    def clear(self) -> None:
        self.cache.clear()
        self.slot = self.slot[:0]


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer  # the engines extra: present wherever llama.cpp's tiny model is

    return Tokenizer.from_file(path)
