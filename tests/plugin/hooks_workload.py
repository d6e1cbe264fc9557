"""Shared-prefix multi-turn chat workload and counters used by the plugin's hook, e2e and benchmark runs."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
          "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def system_prompt(conv: int, tokens: int = 1000) -> str:
    """A deterministic system prompt unique to ``conv`` of about ``tokens`` tokens (4 bytes each)."""
    rng = random.Random(conv * 7919 + 1)
    words = [f"Conversation {conv} instructions."]
    size = len(words[0])
    while size < tokens * 4:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


@dataclass
class Tally:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    backends: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


Send = Callable[[list[dict[str, str]]], Awaitable[tuple[str, int, int, str | None]]]


async def run_conversations(send: Send, conversations: int = 16, turns: int = 4, *, prompt_tokens: int = 1000,
                            first_conv: int = 0, on_turn: Callable[[int], Awaitable[Any]] | None = None) -> Tally:
    """Interleave ``conversations`` chats for ``turns`` turns; ``send(messages) -> (text, prompt, cached, backend)``."""
    tally = Tally()
    history = {c: [{"role": "system", "content": system_prompt(first_conv + c, prompt_tokens)}]
               for c in range(conversations)}
    for turn in range(turns):
        if on_turn is not None:
            await on_turn(turn)
        for c in range(conversations):
            msgs = history[c] + [{"role": "user", "content": f"question {turn} of chat {c}: what next?"}]
            tally.requests += 1
            try:
                text, prompt, cached, backend = await send(msgs)
            except Exception as exc:
                tally.failed += 1
                tally.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            tally.prompt_tokens += prompt
            tally.cached_tokens += cached
            if backend:
                tally.backends[backend] = tally.backends.get(backend, 0) + 1
            history[c] = [*msgs, {"role": "assistant", "content": text}]
    return tally
