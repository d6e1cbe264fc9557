"""Clients spraying a multi-turn, shared-prefix chat workload at random over several proxy instances (scale-out
e2e and ``bench/scale_out.py``).

``conversations`` chats share ``systems`` system prompts (chat ``c`` uses prompt ``c % systems``) and grow turn by
turn with their own history; ``clients`` concurrent clients each own every ``clients``-th chat and send its turns
one after another, each turn to an instance drawn at random (seeded). Requests stream, so the time to the first
content chunk is the client-side TTFT. Cached tokens are the engines' business: callers read them from the
engines (``engine_tokens``), so the figure does not depend on what the proxy relays. No prompt text is kept.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

_WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "iris", "jade", "kelp",
          "lagoon", "meadow", "nickel", "opal", "prairie", "quartz", "reef", "slate", "tundra")


def system_text(system: int, tokens: int) -> str:
    """A deterministic system prompt of about ``tokens`` tokens (4 bytes each), unique to ``system``."""
    rng = random.Random(system * 104_729 + 7)
    words = [f"Deployment {system} operating instructions."]
    size = len(words[0])
    while size < tokens * 4:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


@dataclass
class SprayResult:
    """Client-side outcome: counts, TTFTs (seconds), which instance and backend served each request."""

    requests: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_instance: dict[int, int] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def percentile(self, q: float) -> float | None:
        if not self.ttft_s:
            return None
        s = sorted(self.ttft_s)
        return s[min(len(s) - 1, int(q * len(s)))]


@dataclass(frozen=True)
class SprayPlan:
    """The workload's shape; ``first_conv`` shifts chat and system-prompt ids so two runs with ids far enough
    apart never share a prompt."""

    conversations: int = 16
    systems: int = 4
    turns: int = 4
    system_tokens: int = 1000

    def __post_init__(self) -> None:
        if min(self.conversations, self.systems, self.turns, self.clients) < 1:
            raise ValueError("conversations, systems, turns and clients must be >= 1")
    clients: int = 4
    first_conv: int = 0
    max_tokens: int = 8
    seed: int = 1
    model: str = "llama"


async def send_chat(client: httpx.AsyncClient, base_url: str, api_key: str | None, model: str,
                    messages: list[dict], max_tokens: int) -> tuple[str, float, str | None]:
    """One streamed chat completion: (answer text, seconds to first content chunk, serving deployment id)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        backend = resp.headers.get("x-litellm-model-id")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(piece)
    return "".join(parts), (ttft if ttft is not None else time.perf_counter() - t0), backend


async def spray(base_urls: Sequence[str], api_key: str | None, plan: SprayPlan,
                pick: Callable[[random.Random], int] | None = None,
                after_each: Callable[[int], object] | None = None) -> SprayResult:
    """Run ``plan`` against ``base_urls``; ``pick(rng)`` chooses the instance index (default: uniform at random).
    ``after_each(n)`` runs after the n-th request finishes (an awaitable result is awaited): a hook for faults."""
    result = SprayResult()
    rng = random.Random(plan.seed)
    choose = pick or (lambda r: r.randrange(len(base_urls)))
    histories = {c: [{"role": "system", "content": system_text(plan.first_conv + c % plan.systems, plan.system_tokens)}]
                 for c in range(plan.conversations)}
    done = 0

    async def client_loop(k: int, client: httpx.AsyncClient) -> None:
        nonlocal done
        mine = [c for c in range(plan.conversations) if c % plan.clients == k]
        for turn in range(plan.turns):
            for c in mine:
                msgs = histories[c] + [{"role": "user",
                                        "content": f"chat {plan.first_conv + c} turn {turn}: what is next?"}]
                i = choose(rng)
                result.requests += 1
                result.per_instance[i] = result.per_instance.get(i, 0) + 1
                try:
                    text, ttft, backend = await send_chat(client, base_urls[i], api_key, plan.model, msgs,
                                                          plan.max_tokens)
                except Exception as exc:
                    result.failed += 1
                    result.errors.append(f"instance {i}: {type(exc).__name__}: {str(exc)[:200]}")
                    text, ttft, backend = "", None, None
                if ttft is not None:
                    result.ttft_s.append(ttft)
                if backend:
                    result.backends[backend] = result.backends.get(backend, 0) + 1
                histories[c] = [*msgs, {"role": "assistant", "content": text or "ok"}]
                done += 1
                if after_each is not None:
                    out = after_each(done)
                    if asyncio.iscoroutine(out):
                        await out

    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        await asyncio.gather(*(client_loop(k, client) for k in range(plan.clients)))
    return result


async def engine_tokens(engine_urls: Sequence[str]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) the engines report so far, summed over ``engine_urls`` (``/admin/stats``)."""
    prompt = cached = 0
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
        for url in engine_urls:
            stats = (await c.get(url + "/admin/stats")).json()
            prompt += int(stats["prompt_tokens"])
            cached += int(stats["cached_tokens"])
    return prompt, cached
