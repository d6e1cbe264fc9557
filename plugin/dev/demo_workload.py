"""Replaying conversations (``kvroute.plugin.dev.workloads``) through the official ``openai`` client with streaming,
and the per-policy figures of a replay (cached-token share, TTFT p50/p90, requests/s).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.plugin.dev.workloads import Conversation


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class PolicyReport:
    """What one replay measured; ``as_dict`` gives the demo's JSON keys."""

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.ok)

    @property
    def cached_token_share(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.ok)
        return sum(r.cached_tokens for r in self.ok) / prompt if prompt else 0.0

    def ttft_quantile(self, q: float) -> float | None:
        values = sorted(r.ttft_s for r in self.ok if r.ttft_s is not None)
        if not values:
            return None
        rank = max(0, math.ceil(q * len(values)) - 1)
        return values[rank]

    def as_dict(self) -> dict:
        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {"cached_token_share": round(self.cached_token_share, 4),
                "ttft_p50_s": rounded(self.ttft_quantile(0.5)),
                "ttft_p90_s": rounded(self.ttft_quantile(0.9)),
                "requests_per_s": round(len(self.ok) / self.wall_s, 3) if self.wall_s > 0 else 0.0,
                "failed": self.failed}


def _cached(usage: object) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    value = getattr(details, "cached_tokens", None) if details is not None else None
    return int(value or 0)


async def _one_request(client, model: str, messages: list[dict], max_tokens: int) -> tuple[RequestResult, str]:
    start = time.perf_counter()
    ttft = None
    text_parts: list[str] = []
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta is not None and delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text_parts.append(delta.content)
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
    except Exception as exc:  # any failure counts; the demo keeps going
        return RequestResult(ok=False, latency_s=time.perf_counter() - start, error=type(exc).__name__), ""
    result = RequestResult(ok=True, ttft_s=ttft if ttft is not None else time.perf_counter() - start,
                           latency_s=time.perf_counter() - start,
                           prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0), cached_tokens=_cached(usage))
    return result, "".join(text_parts)


async def replay(base_url: str, api_key: str, model: str, sessions: Sequence[Conversation], concurrency: int,
                 max_tokens: int, on_result: Callable[[RequestResult], None] | None = None,
                 timeout_s: float = 120.0) -> PolicyReport:
    """Send every session's turns through the proxy at ``base_url``, ``concurrency`` sessions in flight, each turn
    after the previous answer."""
    import httpx
    from openai import AsyncOpenAI

    report = PolicyReport()
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(timeout_s)) as http:
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "none", http_client=http, max_retries=0)

        async def worker() -> None:
            while True:
                try:
                    session = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                messages: list[dict] = [{"role": "system", "content": session.system}]
                for turn in session.turns:
                    messages.append({"role": "user", "content": turn})
                    result, answer = await _one_request(client, model, messages, max_tokens)
                    report.results.append(result)
                    if on_result is not None:
                        on_result(result)
                    messages.append({"role": "assistant", "content": answer or "(no answer)"})

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(sessions)))))
        report.wall_s = time.perf_counter() - start
    return report


async def warm_up(base_url: str, api_key: str, model: str) -> None:
    """One tiny streamed request through the same client path ``replay`` measures, so neither the proxy's nor
    this process's first-call costs (the OpenAI client's lazy imports: ~0.6 s on 2 cores) land in the TTFT of
    whichever policy is replayed first."""
    import httpx
    from openai import AsyncOpenAI

    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as http:
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "none", http_client=http, max_retries=0)
        await _one_request(client, model, [{"role": "user", "content": "hi"}], 1)
