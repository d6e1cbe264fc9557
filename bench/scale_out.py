"""Scale-out: 1, 2, 4 and 8 LiteLLM proxy instances with kvroute sharing one Redis, clients spraying at random.

    nice -n 10 .venv/bin/python bench/scale_out.py [--sizes 1,2,4,8] [--rounds 1] [--out bench/results/...json]

Per fleet size, in one run (sizes in order, each round; every fleet started fresh on its own namespace, the
engines' caches reset, the prompts new): the same multi-turn shared-prefix workload sprayed at random over the
instances; **cached share** from the engines' own counters, **TTFT** p50/p90 at the client (streamed),
**agreement** (a fresh prefix sent to one instance, its next turn sent at once to another: same replica and
counted a ``prefix_match`` there), **replication lag** (each instance's ``/kvroute/status`` figures) and
**memory** (RSS of each instance's process group). Ratios are against the 1-instance fleet of the same round;
with several rounds the medians are reported. Fake engines (``kvroute.plugin.dev.fake_engine``) on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_state_bench import _start_redis

from kvroute.plugin.dev.child_processes import tree_rss_mib
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.instances import ProxyInstances
from kvroute.plugin.dev.proxy_process import ModelGroup, build_proxy_config
from kvroute.plugin.dev.spray import SprayPlan, engine_tokens, send_chat, spray, system_text

HASH_SECRET = "scale-out-bench-hash-secret-0123456789"


def proxy_config(replica_bases: list[str]) -> dict:
    """One self-hosted group of fake replicas behind kvroute's cache_aware (the example config's routing)."""
    cfg = build_proxy_config([ModelGroup("llama", replica_bases, engine="vllm", id_prefix="replica",
                                         kv_capacity_tokens=16384, block_size=16)])
    cfg["kvroute"] = {"default_policy": "cache_aware",
                      "groups": {"llama": {"policy": "cache_aware", "knobs": {"min_prefix_tokens": 256}}}}
    return cfg


async def agreement(fleet: ProxyInstances, probes: int, seed: int) -> tuple[int, int]:
    """(agreed, asked): a fresh prefix to instance i, then at once its next turn to another instance j."""
    if len(fleet) < 2:
        return 0, 0
    rng = random.Random(seed)
    agreed = 0
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
        for p in range(probes):
            i = rng.randrange(len(fleet))
            j = rng.choice([k for k in range(len(fleet)) if k != i])
            system = {"role": "system", "content": system_text(seed * 1000 + p, 1000)}
            first = [system, {"role": "user", "content": f"probe {p}"}]
            _, _, holder = await send_chat(c, fleet.base_urls[i], fleet.master_key, "llama", first, 4)
            before = fleet.decisions(j, "llama").get("prefix_match", 0)
            second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
            _, _, backend = await send_chat(c, fleet.base_urls[j], fleet.master_key, "llama", second, 4)
            after = fleet.decisions(j, "llama").get("prefix_match", 0)
            agreed += int(backend == holder and after - before == 1)
    return agreed, probes


async def one_size(n: int, redis_url: str, replicas: Fleet, plan: SprayPlan, probes: int) -> dict:
    async with httpx.AsyncClient(trust_env=False) as c:
        for url in replicas.base_urls:
            await c.post(url + "/admin/reset")
    cfg = proxy_config(replicas.api_bases)
    t0 = time.monotonic()
    with ProxyInstances(cfg, n, redis_url=redis_url, namespace=f"scale-{uuid.uuid4().hex[:6]}",
                        hash_secret=HASH_SECRET) as fleet:
        started_s = time.monotonic() - t0
        rss_idle = [tree_rss_mib(pid) for pid in fleet.pids()]
        before = await engine_tokens(replicas.base_urls)
        t1 = time.monotonic()
        result = await spray(fleet.base_urls, fleet.master_key, plan)
        wall = time.monotonic() - t1
        after = await engine_tokens(replicas.base_urls)
        reasons: dict[str, float] = {}
        for i in range(n):
            for reason, count in fleet.decisions(i, "llama").items():
                reasons[reason] = reasons.get(reason, 0) + count
        agreed, asked = await agreement(fleet, probes, seed=plan.seed + 7)
        statuses = [fleet.status(i) for i in range(n)]
        rss = [tree_rss_mib(pid) for pid in fleet.pids()]
    prompt, cached = after[0] - before[0], after[1] - before[1]
    lags = [s["shared_state"]["replication"] for s in statuses]
    p50s = [lag["lag_p50_s"] for lag in lags if lag["lag_p50_s"] is not None]
    p90s = [lag["lag_p90_s"] for lag in lags if lag["lag_p90_s"] is not None]
    return {
        "instances": n, "requests": result.requests, "failed": result.failed, "errors": result.errors[:3],
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "ttft_p50_ms": round(result.percentile(0.5) * 1000, 1), "ttft_p90_ms": round(result.percentile(0.9) * 1000, 1),
        "agreement": round(agreed / asked, 3) if asked else None, "agreement_probes": asked,
        "lag_p50_ms": round(statistics.median(p50s) * 1000, 1) if p50s else None,
        "lag_p90_ms": round(max(p90s) * 1000, 1) if p90s else None,
        "entries_applied": [s["shared_state"]["entries"] for s in statuses],
        "decisions": {k: int(v) for k, v in sorted(reasons.items())},
        "rss_mib_per_instance": round(statistics.median(rss), 1), "rss_mib_idle": round(statistics.median(rss_idle), 1),
        "per_instance_requests": dict(sorted(result.per_instance.items())),
        "req_per_s": round(result.requests / wall, 2),
        "start_s": round(started_s, 1),
    }


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Per size: medians over rounds, and each round's ratios against that round's 1-instance fleet."""
    sizes = sorted({r["instances"] for rnd in rounds for r in rnd})
    out = []
    for n in sizes:
        rows = [r for rnd in rounds for r in rnd if r["instances"] == n]
        ratios = []
        for rnd in rounds:
            base = next((r for r in rnd if r["instances"] == 1), None)
            row = next((r for r in rnd if r["instances"] == n), None)
            if base and row and base["cached_share"]:
                ratios.append(row["cached_share"] / base["cached_share"])

        def med(key: str, rows=rows) -> float | None:
            vals = [r[key] for r in rows if r[key] is not None]
            return round(statistics.median(vals), 4) if vals else None

        out.append({"instances": n, "cached_share": med("cached_share"),
                    "ratio_vs_1": round(statistics.median(ratios), 4) if ratios else None,
                    "ttft_p50_ms": med("ttft_p50_ms"), "ttft_p90_ms": med("ttft_p90_ms"),
                    "agreement": med("agreement"), "lag_p50_ms": med("lag_p50_ms"), "lag_p90_ms": med("lag_p90_ms"),
                    "rss_mib_per_instance": med("rss_mib_per_instance"), "failed": sum(r["failed"] for r in rows),
                    "requests": sum(r["requests"] for r in rows)})
    return out


def table(summary: list[dict]) -> str:
    lines = ["| instances | cached share | vs 1 instance | TTFT p50 | TTFT p90 | agreement | lag p50 / p90 "
             "| RSS per instance | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        agree = "—" if s["agreement"] is None else f"{s['agreement']:.2f}"
        lag = "—" if s["lag_p50_ms"] is None else f"{s['lag_p50_ms']:.0f} / {s['lag_p90_ms']:.0f} ms"
        lines.append(f"| {s['instances']} | {s['cached_share']:.3f} | {s['ratio_vs_1']:.3f}× "
                     f"| {s['ttft_p50_ms']:.0f} ms "
                     f"| {s['ttft_p90_ms']:.0f} ms | {agree} | {lag} | {s['rss_mib_per_instance']:.0f} MiB "
                     f"| {s['failed']}/{s['requests']} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict:
    sizes = [int(x) for x in args.sizes.split(",")]
    opts = ReplicaOptions(capacity_tokens=16384, prefill_tokens_per_s=20000, decode_ms=1.0, slots=8)
    proc, url = _start_redis()
    rounds: list[list[dict]] = []
    try:
        with Fleet(args.replicas, engine="fake", options=opts, name_prefix="rep") as replicas:
            for rnd in range(args.rounds):
                rows = []
                for k, n in enumerate(sizes):
                    plan = SprayPlan(conversations=args.conversations, systems=args.systems, turns=args.turns,
                                     clients=args.clients, system_tokens=args.system_tokens,
                                     first_conv=10_000 * (rnd * len(sizes) + k + 1), seed=rnd * 100 + k)
                    row = await one_size(n, url, replicas, plan, args.probes)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                rounds.append(rows)
    finally:
        with contextlib.suppress(Exception):
            proc.kill()
            proc.wait(5)
    summary = summarize(rounds)
    return {"date": dt.date.today().isoformat(), "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "workload": {k: getattr(args, k) for k in ("conversations", "systems", "turns", "clients",
                                                       "system_tokens", "replicas", "probes", "rounds")},
            "summary": summary, "rounds": rounds,
            "targets": {"4_instances_ge_0.97": _meets(summary, 4, 0.97),
                        "8_instances_ge_0.95": _meets(summary, 8, 0.95)}}


def _meets(summary: list[dict], n: int, ratio: float) -> bool | None:
    row = next((s for s in summary if s["instances"] == n), None)
    return None if row is None or row["ratio_vs_1"] is None else row["ratio_vs_1"] >= ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--out", default=f"bench/results/scale-out-{dt.date.today().isoformat()}.json")
    args = p.parse_args()
    report = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report["summary"]))
    print(json.dumps(report["targets"]))


if __name__ == "__main__":
    main()
