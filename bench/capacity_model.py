"""Extrapolate the replicated shared-state design beyond two cores from the per-op costs measured by
``bench/shared_state_load.py`` (docs/capacity.md explains each term).

    .venv/bin/python bench/capacity_model.py bench/results/shared-state-load-<date>.json [--json]

Every instance holds the whole index and replays every other instance's updates, so with N instances, a fleet
rate of L requests/s, o index ops per request, k blocks per prompt and R replicas of C index blocks each:

- replay per instance:   (N-1)/N · L · o  ops/s, costing  c(k) CPU seconds each (c: the marginal CPU per applied
  op measured at the bench's k, scaled by k/k_bench: the work is one LRU move per key);
- stream into Redis:     L · b_in(k)  bytes/s; out of Redis: N · L · b_out(k) bytes/s (each instance reads all);
- memory per instance:   R · C · m  bytes (m measured by tracemalloc per block).

Limits used to say where the design stops (assumptions, not measurements): one Python core per instance, of
which the replay may take ``--cpu-budget`` (default 0.25: the same interpreter serves requests); Redis egress
``--egress-gbps`` (default 10 Gbit/s, one NIC); ``--memory-gib`` per instance for the index (default 4 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SCENARIOS = [  # (instances, replicas, fleet req/s, prompt tokens)
    (4, 8, 50, 1024),
    (8, 32, 200, 4096),
    (16, 64, 1000, 4096),
    (64, 512, 1000, 4096),
    (64, 512, 1000, 32768),
    (64, 512, 64000, 4096),  # 1,000 req/s on each of 64 instances
]


def measured(report: dict) -> dict:
    """The per-op and per-block figures the model needs, from one ``shared_state_load`` report."""
    mem = max(report["memory"], key=lambda m: m["blocks"])
    per_req = next(r for r in report["redis_per_request"] if r["readers"] == max(x["readers"] for x in
                                                                              report["redis_per_request"]))
    alone = next(r for r in report["redis_per_request"] if r["readers"] == 0)
    readers = per_req["readers"]
    k = per_req["blocks_per_request"]
    # Egress attributable to one reading instance per request: (out with R readers - out alone) / R.
    b_out = (per_req["bytes_out_per_request"] - alone["bytes_out_per_request"]) / readers if readers else 0.0
    # Marginal replay cost: the slope of a reader's CPU seconds over the ops it applied, across the rates it kept
    # up with (the intercept is its idle polling); rows it could not keep up with are left out.
    kept = [row for row in report["lag"] if row["applied_share"] >= 0.99]
    xs = [row["sent_ops"] for row in kept]
    ys = [row["reader_cpu_us_per_op"] * row["sent_ops"] / 1e6 for row in kept]
    cpu = None
    if len(kept) >= 2 and len(set(xs)) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        cpu = round(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
                    / sum((x - mx) ** 2 for x in xs) * 1e6, 2)
    ops = per_req["index_ops_sent"] / per_req["requests"]
    return {"bytes_per_block": mem["bytes_per_block"], "blocks_bench": k, "ops_per_request": round(ops, 2),
            "bytes_in_per_request": alone["bytes_in_per_request"], "bytes_out_per_reader_per_request": round(b_out, 1),
            "replay_cpu_us_per_op": cpu}


def project(m: dict, instances: int, replicas: int, rate: float, prompt_tokens: int, *, block_tokens: int = 64,
            kv_tokens_per_replica: int = 500_000, cpu_budget: float = 0.25, egress_gbps: float = 10.0,
            memory_gib: float = 4.0) -> dict:
    scale = (prompt_tokens / block_tokens) / m["blocks_bench"]
    ops = (instances - 1) / instances * rate * m["ops_per_request"]
    cpu = ops * m["replay_cpu_us_per_op"] * scale / 1e6
    ingress = rate * m["bytes_in_per_request"] * scale
    egress = instances * rate * m["bytes_out_per_reader_per_request"] * scale
    blocks = replicas * kv_tokens_per_replica / block_tokens
    memory = blocks * m["bytes_per_block"] / 2**30
    limits = []
    if cpu > cpu_budget:
        limits.append(f"replay {cpu:.2f} cores > {cpu_budget}")
    if egress * 8 / 1e9 > egress_gbps:
        limits.append(f"Redis egress {egress * 8 / 1e9:.1f} Gbit/s > {egress_gbps}")
    if memory > memory_gib:
        limits.append(f"index {memory:.1f} GiB > {memory_gib}")
    return {"instances": instances, "replicas": replicas, "fleet_req_per_s": rate, "prompt_tokens": prompt_tokens,
            "replay_ops_per_s_per_instance": round(ops), "replay_cores_per_instance": round(cpu, 3),
            "stream_mb_per_s_per_instance": round(rate * m["bytes_out_per_reader_per_request"] * scale / 1e6, 2),
            "redis_ingress_mb_per_s": round(ingress / 1e6, 2), "redis_egress_mb_per_s": round(egress / 1e6, 1),
            "index_blocks_per_instance": int(blocks), "index_gib_per_instance": round(memory, 2),
            "verdict": "ok" if not limits else "stops: " + "; ".join(limits)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("--cpu-budget", type=float, default=0.25)
    p.add_argument("--egress-gbps", type=float, default=10.0)
    p.add_argument("--memory-gib", type=float, default=4.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    m = measured(json.loads(Path(args.report).read_text()))
    rows = [project(m, *s, cpu_budget=args.cpu_budget, egress_gbps=args.egress_gbps, memory_gib=args.memory_gib)
            for s in SCENARIOS]
    if args.json:
        print(json.dumps({"measured": m, "projections": rows}, indent=1))
        return
    print("measured:", json.dumps(m))
    print("| instances | replicas | fleet req/s | prompt tokens | replay ops/s per instance | replay cores "
          "| stream in per instance | Redis egress | index per instance | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['instances']} | {r['replicas']} | {r['fleet_req_per_s']:,} | {r['prompt_tokens']:,} "
              f"| {r['replay_ops_per_s_per_instance']:,} | {r['replay_cores_per_instance']:.3f} "
              f"| {r['stream_mb_per_s_per_instance']} MB/s | {r['redis_egress_mb_per_s']:,} MB/s "
              f"| {r['index_gib_per_instance']} GiB | {r['verdict']} |")


if __name__ == "__main__":
    main()
