"""What the llama.cpp preset assumes about this host, measured: the engine's response time and the cores' sharing.

    .venv/bin/python bench/llamacpp_host.py [--engine llamacpp|fake] [--replicas 4] [--repeats 5] [--json]

Two probes on the bench's replicas (``bench/peers.py``'s llama.cpp options: the tiny model, 1 thread, 1 slot), each
request streamed straight to a replica, no router:

- **response time**: a request's time to first token less llama.cpp's own ``timings.prompt_ms``, for a tiny prompt,
  a 2,000-token prompt whose prefix the slot holds, and a cold 1,800-token prompt. The preset's ``response_s``
  (``sim/presets.py``) is what both models add to every request outside the slot;
- **sharing the cores**: ``k`` replicas sent a cold prefill at once (``k`` = 1 … replicas, the order alternating per
  repeat), each one's TTFT over the median alone. On a host of ``c`` cores the models run each at
  ``min(1, c / k)`` of its speed (``HostCores``, ``SharedCores``).

``--engine fake`` runs the same probes on the fake engine's llama.cpp model (sharing the host's cores as the
calibration runs it), so the two can be put side by side. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from peers import _replica_options
from peers_workloads import Size, replica_capacity_tokens

from kvroute.plugin.dev.fleet import Fleet

WORDS = "the quick brown fox jumps over the lazy dog and keeps running far away".split()


def _random_words(n: int) -> str:
    return " ".join(f"{int.from_bytes(os.urandom(4), 'big'):08x}" for _ in range(n))


async def stream_one(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int = 4) -> dict:
    """One streamed request: its client TTFT (s) and llama.cpp's ``timings`` (from the last chunk)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "ok"}]}
    started = time.perf_counter()
    ttft, timings = None, {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None and '"content"' in line:
                ttft = time.perf_counter() - started
            if '"timings"' in line:
                timings = json.loads(line[6:]).get("timings") or {}
    return {"ttft_s": ttft, "prompt_ms": timings.get("prompt_ms"), "prompt_n": timings.get("prompt_n"),
            "cache_n": timings.get("cache_n")}


async def response_times(client: httpx.AsyncClient, url: str, model: str, repeats: int) -> dict[str, dict]:
    """Per prompt shape: median TTFT − prompt_ms (ms), and the tokens llama.cpp computed and reused."""
    out: dict[str, list[dict]] = {}
    for rep in range(repeats):
        long = " ".join(WORDS[(i * 7 + rep) % len(WORDS)] for i in range(1400)) + f" {rep}"
        await stream_one(client, url, model, long)  # computed once: the next one finds it in the slot
        shapes = (("tiny", f"hi {rep}"), ("cached 2,000", long), ("cold 1,800", _random_words(300)))
        for name, text in shapes:
            out.setdefault(name, []).append(await stream_one(client, url, model, text))
    return {name: {"response_ms": round(statistics.median(s["ttft_s"] * 1000 - s["prompt_ms"] for s in samples), 1),
                   "prompt_n": samples[-1]["prompt_n"], "cache_n": samples[-1]["cache_n"]}
            for name, samples in out.items()}


async def sharing(client: httpx.AsyncClient, urls: list[str], model: str, repeats: int) -> dict[int, float]:
    """Per ``k``: the median TTFT of ``k`` cold prefills sent at once over that of one alone."""
    ttfts: dict[int, list[float]] = {}
    ks = list(range(1, len(urls) + 1))
    for rep in range(repeats):
        for k in ks if rep % 2 == 0 else ks[::-1]:
            got = await asyncio.gather(*(stream_one(client, u, model, _random_words(350), 1) for u in urls[:k]))
            ttfts.setdefault(k, []).extend(g["ttft_s"] for g in got)
            await asyncio.sleep(0.2)
    alone = statistics.median(ttfts[1])
    return {k: round(statistics.median(v) / alone, 3) for k, v in sorted(ttfts.items())}


def run(engine: str, replicas: int, repeats: int, cores: float) -> dict:
    size = Size.llamacpp()
    kind = "llamacpp" if engine == "llamacpp" else "fake"
    options = _replica_options(kind, replica_capacity_tokens(size, replicas), False, "llamacpp",
                               host_cores=cores if kind == "fake" else 0.0)

    async def probe(fleet: Fleet) -> dict:
        # a fresh connection per request: llama.cpp closes idle kept-alive ones, which a reused one would meet
        async with httpx.AsyncClient(timeout=300, trust_env=False,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            for url in fleet.base_urls:  # each replica's first request (model load, caches) is no sample
                await stream_one(client, url, fleet.model, "warm up")
            return {"response": await response_times(client, fleet.base_urls[0], fleet.model, repeats),
                    "sharing": await sharing(client, fleet.base_urls, fleet.model, repeats)}

    with Fleet(replicas, engine=kind, options=options, name_prefix="host") as fleet:
        result = asyncio.run(probe(fleet))
    return {"engine": engine, "replicas": replicas, "repeats": repeats, "cores": cores, **result}


def render(result: dict) -> str:
    lines = [f"{result['engine']}, {result['replicas']} replicas on {result['cores']:g} cores, "
             f"medians of {result['repeats']}"]
    for name, r in result["response"].items():
        lines.append(f"  response time, {name}: {r['response_ms']} ms (computed {r['prompt_n']}, reused "
                     f"{r['cache_n']})")
    for k, ratio in result["sharing"].items():
        lines.append(f"  {k} prefilling at once: ×{ratio:.2f} (min(1, cores/k) model: "
                     f"×{max(1.0, k / result['cores']):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("llamacpp", "fake"), default="llamacpp")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 1),
                   help="the host's cores (the fake's model shares them)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.replicas < 1 or args.repeats < 1:
        p.error("--replicas and --repeats must be positive")
    result = run(args.engine, args.replicas, args.repeats, args.cores)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
