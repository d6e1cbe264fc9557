"""What the llama.cpp preset assumes about this host, measured: the engine's response time and the cores' sharing.

    .venv/bin/python bench/llamacpp_host.py [--engine llamacpp|fake] [--replicas 4] [--repeats 5] [--json]

Two probes on the bench's replicas (``bench/peers.py``'s llama.cpp options: the tiny model, 1 thread, 1 slot), each
request streamed straight to a replica, no router:

- **response time**: a request's time to first token less llama.cpp's own ``timings.prompt_ms``, for a tiny prompt,
  a 2,000-token prompt the replica holds (asked again after the tiny one), and a cold 1,800-token prompt. The
  preset's ``response_s`` (``sim/presets.py``) is what both models add to every request outside the slot;
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

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from peers import _replica_options, random_words
from peers_workloads import Outcome, Size, replica_capacity_tokens, stream_one

from kvroute.plugin.dev.fleet import Fleet

WORDS = "the quick brown fox jumps over the lazy dog and keeps running far away".split()


def _client(base_url: str) -> httpx.AsyncClient:
    """A client of one replica; a fresh connection per request (llama.cpp closes idle kept-alive ones, which a reused
    one would meet)."""
    return httpx.AsyncClient(base_url=base_url, timeout=300, trust_env=False,
                             limits=httpx.Limits(max_keepalive_connections=0))


async def ask(client: httpx.AsyncClient, model: str, text: str, max_tokens: int = 4) -> Outcome:
    """One streamed request (``peers_workloads.stream_one``): its client TTFT, llama.cpp's ``prompt_ms`` and the
    cached tokens it reported."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "ok"}]}
    out = await stream_one(client, body, {})
    if not out.ok or out.ttft_s is None or out.prompt_ms is None:
        raise httpx.HTTPError(f"probe request failed or told no prompt_ms: {out.error}")
    return out


async def response_times(client: httpx.AsyncClient, model: str, repeats: int) -> dict[str, dict]:
    """Per prompt shape: the median of TTFT less llama.cpp's own ``prompt_ms`` (ms), and the tokens it reused."""
    out: dict[str, list[Outcome]] = {}
    for rep in range(repeats):
        # ~2,000 tokens, new each repeat: the replica keeps it (its host cache holds 2,297) while the tiny one runs
        long = f"{rep} " + " ".join(WORDS[i % len(WORDS)] for i in range(1200))
        await ask(client, model, long)  # computed once: the next one finds it in the slot
        for name, text in (("tiny", f"hi {rep}"), ("held 2,000", long), ("cold 1,800", random_words(300))):
            out.setdefault(name, []).append(await ask(client, model, text))
    return {name: {"response_ms": round(statistics.median(o.ttft_s * 1000 - o.prompt_ms for o in got), 1),
                   "prompt_tokens": got[-1].prompt_tokens, "cached_tokens": got[-1].cached_tokens}
            for name, got in out.items()}


async def sharing(clients: list[httpx.AsyncClient], model: str, repeats: int) -> dict[int, float]:
    """Per ``k``: the median TTFT of ``k`` cold prefills sent at once over that of one alone."""
    ttfts: dict[int, list[float]] = {}
    ks = list(range(1, len(clients) + 1))
    for rep in range(repeats):
        for k in ks if rep % 2 == 0 else ks[::-1]:
            got = await asyncio.gather(*(ask(c, model, random_words(350), 1) for c in clients[:k]))
            ttfts.setdefault(k, []).extend(o.ttft_s for o in got)
            await asyncio.sleep(0.2)
    alone = statistics.median(ttfts[1])
    return {k: round(statistics.median(v) / alone, 3) for k, v in sorted(ttfts.items())}


def run(engine: str, replicas: int, repeats: int, cores: float) -> dict:
    size = Size.llamacpp()
    kind = "llamacpp" if engine == "llamacpp" else "fake"
    options = _replica_options(kind, replica_capacity_tokens(size, replicas), False, "llamacpp",
                               host_cores=cores if kind == "fake" else 0.0)

    async def probe(fleet: Fleet) -> dict:
        clients = [_client(url) for url in fleet.base_urls]
        try:
            for client in clients:  # each replica's first request (model load, caches) is no sample
                await ask(client, fleet.model, "warm up")
            return {"response": await response_times(clients[0], fleet.model, repeats),
                    "sharing": await sharing(clients, fleet.model, repeats)}
        finally:
            for client in clients:
                await client.aclose()

    with Fleet(replicas, engine=kind, options=options, name_prefix="host") as fleet:
        result = asyncio.run(probe(fleet))
    return {"engine": engine, "replicas": replicas, "repeats": repeats, "cores": cores, **result}


def render(result: dict) -> str:
    lines = [f"{result['engine']}, {result['replicas']} replicas on {result['cores']:g} cores, "
             f"medians of {result['repeats']}"]
    for name, r in result["response"].items():
        lines.append(f"  response time, {name}: {r['response_ms']} ms ({r['cached_tokens']} of {r['prompt_tokens']} "
                     "tokens reused)")
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
