"""Hedged streams through real LiteLLM proxies: the TTFT tail and what it costs, against the same proxy unhedged.

Three hosted fake providers of one model, each stalling a share of its streams' first token by a heavy-tailed
(Pareto) delay after the stream started (``fake_engine --stall-*``, a seed per provider). One proxy per setting
(hedging off, and ``hedge: {budget: B}`` for each ``--budget``), all with kvroute and its ledger, take the same
streamed requests in interleaved rounds (the order rotates each round). Reports per setting the client's TTFT
p50/p90/p99, the extra upstream requests (``kvroute_hedges_total{event="sent"}`` over requests) and the extra
provider cost (the ledger's ``hedge_cost`` over the cost of the answers). Usage::

    LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/python bench/hedge_bench.py [--requests 300] [--rounds 3]
        [--budget 0.02 --budget 0.05 --budget 0.10] [--stall-share 0.05] [--json] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ProxyProcess

PRICES = ({"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6},
          {"input_cost_per_token": 1.1e-6, "output_cost_per_token": 2.2e-6},
          {"input_cost_per_token": 1.2e-6, "output_cost_per_token": 2.4e-6})
RESULTS = Path(__file__).resolve().parent / "results"


def config(bases: list[str]) -> dict[str, Any]:
    """One ``hosted`` group of the three providers (``provider-a`` cheapest)."""
    model_list = [{"model_name": "hosted",
                   "litellm_params": {"model": "openai/fake-model", "api_base": base, "api_key": "none", **price},
                   "model_info": {"id": f"provider-{'abc'[i]}", "provider": f"provider-{'abc'[i]}", **price}}
                  for i, (base, price) in enumerate(zip(bases, PRICES, strict=True))]
    return {"model_list": model_list, "litellm_settings": {"drop_params": True,
                                                           "callbacks": ["kvroute.plugin.kvroute_callback"]},
            "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 0},
            "general_settings": {"master_key": "sk-bench"}}


def settings(budget: float | None) -> dict[str, Any]:
    group: dict[str, Any] = {"policy": "marketplace"}
    if budget is not None:
        group["hedge"] = {"budget": budget, "min_samples": 20}
    return {"default_policy": "marketplace", "groups": {"hosted": group}}


async def stream(c: httpx.AsyncClient, proxy: ProxyProcess, text: str) -> float:
    """Seconds to the first content chunk of one streamed request."""
    body = {"model": "hosted", "stream": True, "max_tokens": 64, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    start = time.monotonic()
    ttft = math.nan
    async with c.stream("POST", proxy.base_url + "/v1/chat/completions", json=body, headers=proxy.headers,
                        timeout=60) as resp:
        async for line in resp.aiter_lines():
            if math.isnan(ttft) and line.startswith("data: ") and not line.endswith("[DONE]"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    ttft = time.monotonic() - start
    return ttft


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(v for v in values if not math.isnan(v))
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


async def hedges_sent(c: httpx.AsyncClient, proxy: ProxyProcess) -> float:
    text = (await c.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers)).text
    return sum(float(m[1]) for m in re.finditer(r'^kvroute_hedges_total\{[^}]*event="sent"[^}]*\} (\S+)$', text, re.M))


def ledger_costs(data: Path) -> tuple[float, float]:
    """(cost of every attempt, cost of the hedges' losers) in the proxy's ledger."""
    command = [str(Path(sys.executable).parent / "kvroute"), "report", "usage", "--by", "app", "--format", "json",
               "--period", datetime.now(UTC).strftime("%Y-%m"), "--db", f"sqlite:///{data / 'billing.db'}"]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return math.nan, math.nan
    totals = json.loads(out.stdout).get("totals") or [{}]
    return float(totals[0].get("spend") or 0), float(totals[0].get("hedge_cost") or 0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = ["off", *(f"budget {b:g}" for b in args.budget)]
    budgets: list[float | None] = [None, *args.budget]
    ttfts: dict[str, list[float]] = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        fleets = []
        for i in range(3):
            stall = ["--stall-share", str(args.stall_share), "--stall-scale-ms", str(args.stall_scale_ms),
                     "--stall-alpha", str(args.stall_alpha), "--stall-max-ms", str(args.stall_max_ms),
                     "--stall-seed", str(1000 + i)]
            opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=400000, decode_ms=1.0, slots=16,
                                  extra_args=tuple(stall))
            fleets.append(stack.enter_context(Fleet(1, engine="fake", options=opts, name_prefix=f"host{i}")))
        bases = [f.api_bases[0] for f in fleets]
        proxies, data = {}, {}
        for name, budget in zip(names, budgets, strict=True):
            data[name] = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-hedge-")))
            proxies[name] = stack.enter_context(ProxyProcess(
                config(bases), kvroute_settings=settings(budget), env={"KVROUTE_DATA_DIR": str(data[name])},
                inherit_kvroute_env=False))
        async with httpx.AsyncClient(trust_env=False) as c:
            per_round = args.requests // args.rounds
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    for i in range(per_round):
                        ttfts[name].append(await stream(c, proxies[name], f"{name} round {r} req {i} " * 30))
            sent = {n: await hedges_sent(c, proxies[n]) for n in names}
        await asyncio.sleep(3.0)  # the ledger's drainer catches up
        costs = {n: ledger_costs(data[n]) for n in names}
    rows = []
    base_p99 = quantile(ttfts["off"], 0.99)
    for n in names:
        spend, hedge = costs[n]
        answers = spend - hedge
        rows.append({"setting": n, "requests": len(ttfts[n]), "ttft_p50_ms": round(quantile(ttfts[n], 0.5) * 1000, 1),
                     "ttft_p90_ms": round(quantile(ttfts[n], 0.9) * 1000, 1),
                     "ttft_p99_ms": round(quantile(ttfts[n], 0.99) * 1000, 1),
                     "p99_vs_off": round(quantile(ttfts[n], 0.99) / base_p99, 3) if base_p99 else None,
                     "extra_requests_pct": round(100 * sent[n] / len(ttfts[n]), 2),
                     "extra_cost_pct": round(100 * hedge / answers, 2) if answers > 0 else None})
    return {"stall_share": args.stall_share, "stall_scale_ms": args.stall_scale_ms, "stall_alpha": args.stall_alpha,
            "stall_max_ms": args.stall_max_ms, "rounds": args.rounds, "rows": rows,
            "median_ttft_ms": {n: round(statistics.median(v) * 1000, 1) for n, v in ttfts.items()}}


def render(result: dict[str, Any]) -> str:
    lines = [f"stall: {result['stall_share']:.0%} of streams, Pareto scale {result['stall_scale_ms']} ms, "
             f"alpha {result['stall_alpha']}, max {result['stall_max_ms']} ms",
             "| setting | requests | TTFT p50 ms | p90 ms | p99 ms | p99 vs off | extra requests | extra cost |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['setting']} | {r['requests']} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} | "
                     f"{r['ttft_p99_ms']} | {r['p99_vs_off']} | {r['extra_requests_pct']} % | "
                     f"{r['extra_cost_pct']} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="streams per setting")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, action="append", help="a hedge budget (fraction); repeatable")
    p.add_argument("--stall-share", type=float, default=0.05)
    p.add_argument("--stall-scale-ms", type=float, default=400.0)
    p.add_argument("--stall-alpha", type=float, default=1.2)
    p.add_argument("--stall-max-ms", type=float, default=5000.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", action="store_true", help="write bench/results/hedge-<time>.json")
    args = p.parse_args(argv)
    args.budget = args.budget or [0.02, 0.05, 0.10]
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1) if args.json else render(result))
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"hedge-{datetime.now(UTC):%Y-%m-%dT%H%M}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
