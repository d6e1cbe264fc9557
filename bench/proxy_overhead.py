"""Proxy requests/s with the kvroute callback vs without: same fake backends, same run, interleaved rounds.

Starts 4 fake replicas and two real LiteLLM proxies (kvroute's ``cache_aware`` callback; plain simple-shuffle),
then sends the same shared-prefix chat workload to each in alternating rounds and prints two ratios (target
≥ 0.97): ``kvroute req/s ÷ baseline req/s`` (wall clock) and the same capacity measured as proxy CPU seconds
per request (``baseline CPU/req ÷ kvroute CPU/req``), which other load on a shared machine disturbs far less.
Usage::

    LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/python bench/proxy_overhead.py [--rounds 4] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config


def _body(i: int, prefixes: int) -> dict:
    system = f"System prompt {i % prefixes}: " + "shared instructions for the assistant " * 60
    return {"model": "llama", "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}


def _cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of ``pid`` and its direct children (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def _round(proxy: ProxyProcess, requests: int, concurrency: int, prefixes: int, offset: int) -> tuple[float, int]:
    """Requests/s of one round and the number of failed requests."""
    sem = asyncio.Semaphore(concurrency)
    failed = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=proxy.base_url, headers=proxy.headers, timeout=60, limits=limits,
                                 trust_env=False) as client:
        async def one(i: int) -> None:
            nonlocal failed
            async with sem:
                r = await client.post("/v1/chat/completions", json=_body(offset + i, prefixes))
                if r.status_code != 200:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        elapsed = time.perf_counter() - start
    return requests / elapsed, failed


async def _measure(ours: ProxyProcess, base: ProxyProcess, args: argparse.Namespace) -> dict:
    for proxy in (ours, base):  # warm-up: connections, lazy imports, first picks
        await _round(proxy, max(20, args.requests // 5), args.concurrency, args.prefixes, 10_000)
    rates: dict[str, list[float]] = {"kvroute": [], "baseline": []}
    cpu: dict[str, list[float]] = {"kvroute": [], "baseline": []}
    failures = 0
    for r in range(args.rounds):
        order = [("kvroute", ours), ("baseline", base)] if r % 2 == 0 else [("baseline", base), ("kvroute", ours)]
        for name, proxy in order:
            before = _cpu_seconds(proxy.process.pid)
            rate, failed = await _round(proxy, args.requests, args.concurrency, args.prefixes, r * args.requests)
            cpu[name].append((_cpu_seconds(proxy.process.pid) - before) / args.requests)
            rates[name].append(rate)
            failures += failed
    k, b = statistics.median(rates["kvroute"]), statistics.median(rates["baseline"])
    ck, cb = statistics.median(cpu["kvroute"]), statistics.median(cpu["baseline"])
    return {"kvroute_rps": round(k, 2), "baseline_rps": round(b, 2), "ratio": round(k / b, 3),
            "kvroute_cpu_ms_per_request": round(ck * 1000, 2), "baseline_cpu_ms_per_request": round(cb * 1000, 2),
            "cpu_ratio": round(cb / ck, 3) if ck > 0 else None,
            "rounds": args.rounds, "requests_per_round": args.requests, "concurrency": args.concurrency,
            "failed": failures, "kvroute_rounds": [round(x, 1) for x in rates["kvroute"]],
            "baseline_rounds": [round(x, 1) for x in rates["baseline"]], "target": 0.97}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    opts = ReplicaOptions(capacity_tokens=65536, prefill_tokens_per_s=1e6, decode_ms=0.0, slots=64)
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(Fleet(4, engine="fake", options=opts, name_prefix="bench"))
        group = ModelGroup("llama", fleet.api_bases, engine="vllm", id_prefix="replica")
        settings = {"num_retries": 0}
        ours = stack.enter_context(ProxyProcess(build_proxy_config([group], kvroute=True, router_settings=settings),
                                                env={"LITELLM_LOG": "ERROR"}))
        base = stack.enter_context(ProxyProcess(build_proxy_config([group], kvroute=False, router_settings=settings),
                                                env={"LITELLM_LOG": "ERROR"}))
        result = asyncio.run(_measure(ours, base, args))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kvroute {result['kvroute_rps']} req/s vs simple-shuffle {result['baseline_rps']} req/s "
              f"→ ratio {result['ratio']} (target ≥ 0.97); failed {result['failed']}")
        print(f"proxy CPU per request: kvroute {result['kvroute_cpu_ms_per_request']} ms vs simple-shuffle "
              f"{result['baseline_cpu_ms_per_request']} ms → capacity ratio {result['cpu_ratio']}")
        print(f"rounds kvroute {result['kvroute_rounds']} baseline {result['baseline_rounds']}")


if __name__ == "__main__":
    main()
