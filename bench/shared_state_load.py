"""Capacity load generator: the Redis-shared state driven directly (no LiteLLM) at rising rates, for docs/capacity.md.

    nice -n 10 .venv/bin/python bench/shared_state_load.py [--redis-url URL] [--quick] [--out FILE.json]

Three measurements, each in this one run (a throwaway ``redis-server`` on 127.0.0.1 unless ``--redis-url``):

- **memory**: ``tracemalloc`` of a ``PrefixIndex`` (what every instance holds; ``SharedPrefixIndex`` keeps one)
  at several sizes, in bytes per block, and a full ``SharedPrefixIndex`` after replaying the same blocks;
- **redis per request**: one writer instance routes N requests through a ``Router`` on the shared index and load
  tracker (a pick records the prompt's blocks, a completion confirms them, heartbeats run), with R reader
  instances attached; ``INFO commandstats`` and ``INFO stats`` before/after give Redis commands and bytes per
  request, split into the writer's share and each reader's;
- **lag vs rate and instances**: one writer process emitting request-shaped updates (a record and a confirm of
  ``--blocks`` chained keys per request) at rising rates, K reader processes replaying them; each reader
  reports its replication lag (Redis append → applied, p50/p90/max) and the CPU seconds it spent per applied op.

The rates two cores allow are far below the sizes the capacity model asks about; ``docs/capacity.md``
extrapolates from the per-op costs measured here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_state_bench import _start_redis

from kvroute.plugin.state.shared_state import SharedState, SharedStateConfig
from kvroute.policies import Router
from kvroute.policies.prefix_index import PrefixIndex, PrefixIndexConfig

BACKENDS = [f"replica-{i}" for i in range(8)]


def _chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


# --- memory -------------------------------------------------------------------------------------
def index_memory(sizes: list[int], chain: int = 64) -> list[dict]:
    """Bytes per block of a ``PrefixIndex`` holding ``size`` blocks over 8 backends (64-bit keys, no TTL)."""
    out = []
    for size in sizes:
        cfg = PrefixIndexConfig(capacity_tokens=10**12, max_blocks_per_backend=1 << 24)
        rng = random.Random(size)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        idx = PrefixIndex(cfg)
        for i in range(0, size, chain):
            idx.record(BACKENDS[(i // chain) % len(BACKENDS)], _chain(rng, min(chain, size - i)), 0.0)
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        out.append({"blocks": idx.blocks(), "bytes": used, "bytes_per_block": round(used / idx.blocks(), 1),
                    "mib_per_million_blocks": round(used / idx.blocks() * 1e6 / 2**20, 1)})
        del idx
    return out


# --- redis per request --------------------------------------------------------------------------
def _commandstats(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def _net(r: redis.Redis) -> tuple[int, int]:
    s = r.info("stats")
    return int(s["total_net_input_bytes"]), int(s["total_net_output_bytes"])


def redis_per_request(url: str, requests: int, readers: int, blocks: int, cfg: SharedStateConfig) -> dict:
    """Commands and bytes per routed request: with ``readers`` idle instances attached, and without."""
    r = redis.Redis.from_url(url)
    prompt_tokens = int(blocks * 64)
    rng = random.Random(1)
    systems = [" ".join(f"w{rng.getrandbits(20)}" for _ in range(prompt_tokens // 2)) for _ in range(16)]
    writer = SharedState(url, cfg, worker_id="writer")
    router = Router(index=writer.index("g"), load=writer.load("g"))
    others = [SharedState(url, cfg, worker_id=f"reader-{k}") for k in range(readers)]
    for o in others:
        o.index("g"), o.load("g")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(s.connected for s in [writer, *others]):
        time.sleep(0.05)
    time.sleep(3 * cfg.heartbeat_s)
    c0, n0, t0 = _commandstats(r), _net(r), time.monotonic()
    for i in range(requests):
        req = {"model": "m", "messages": [{"role": "system", "content": systems[i % len(systems)]},
                                          {"role": "user", "content": f"question {i}"}]}
        router.route(req, BACKENDS, request_id=f"q{i}")
        router.on_complete(f"q{i}", cached_tokens=prompt_tokens // 2)
        time.sleep(0.002)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (writer.stats()["outbox"] or any(
            o.counters["applied"] < writer.counters["sent"] for o in others)):
        time.sleep(0.05)
    time.sleep(2 * cfg.flush_interval_s)
    elapsed = time.monotonic() - t0
    c1, n1 = _commandstats(r), _net(r)
    for s in [writer, *others]:
        s.close()
    calls = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if c1.get(k, 0) - c0.get(k, 0) > 0}
    calls.pop("info", None)
    per_second_idle = {k: v / elapsed for k, v in calls.items() if k in ("xread",)}
    return {"requests": requests, "readers": readers, "blocks_per_request": blocks, "elapsed_s": round(elapsed, 2),
            "index_ops_sent": writer.counters["sent"],
            "commands": calls, "commands_per_request": round(sum(calls.values()) / requests, 2),
            "xadd_per_request": round(calls.get("xadd", 0) / requests, 3),
            "bytes_in_per_request": round((n1[0] - n0[0]) / requests, 1),
            "bytes_out_per_request": round((n1[1] - n0[1]) / requests, 1),
            "xread_per_s": {k: round(v, 1) for k, v in per_second_idle.items()}}


# --- lag vs rate ----------------------------------------------------------------------------------
def _reader(url: str, ns: str, name: str, seconds: float, q: mp.Queue) -> None:
    cfg = SharedStateConfig(namespace=ns, lag_samples=100_000)
    shared = SharedState(url, cfg, worker_id=name)
    shared.index("g")
    cpu0 = time.process_time()
    time.sleep(seconds)
    cpu = time.process_time() - cpu0
    rep = shared.replication()
    ms = {k: (round(rep[f"lag_{k}_s"] * 1000, 2) if rep["samples"] else None) for k in ("p50", "p90", "window_max")}
    q.put({"name": name, "applied": shared.counters["applied"], "entries": shared.counters["entries"],
           "cpu_s": round(cpu, 3), "lag_p50_ms": ms["p50"], "lag_p90_ms": ms["p90"], "lag_max_ms": ms["window_max"]})
    shared.close()


def _writer(url: str, ns: str, rate: float, seconds: float, blocks: int, q: mp.Queue) -> None:
    shared = SharedState(url, SharedStateConfig(namespace=ns), worker_id="writer")
    idx = shared.index("g")
    rng = random.Random(7)
    deadline = time.monotonic() + 10
    while not shared.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    n = 0
    while True:
        now = time.monotonic()
        if now - t0 >= seconds:
            break
        due = int((now - t0) * rate)
        while n < due:
            keys = _chain(rng, blocks)
            backend = BACKENDS[n % len(BACKENDS)]
            idx.record(backend, keys, now)
            idx.confirm(backend, keys, blocks, now, blocks)
            n += 1
        time.sleep(0.001)
    end = time.monotonic() + 5
    while shared.stats()["outbox"] and time.monotonic() < end:
        time.sleep(0.01)
    q.put({"name": "writer", "requests": n, "achieved_req_per_s": round(n / seconds, 1),
           "sent_ops": shared.counters["sent"], "dropped": shared.counters["dropped"]})
    shared.close()


def lag_level(url: str, rate: float, readers: int, seconds: float, blocks: int) -> dict:
    ns = f"load-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(url, ns, f"reader-{k}", seconds + 3.0, q)) for k in range(readers)]
    for p in procs:
        p.start()
    time.sleep(1.5)  # readers connected and bootstrapped before the writer starts
    w = ctx.Process(target=_writer, args=(url, ns, rate, seconds, blocks, q))
    w.start()
    results = [q.get(timeout=seconds + 60) for _ in range(readers + 1)]
    for p in [*procs, w]:
        p.join(10)
    writer = next(r for r in results if r["name"] == "writer")
    rs = [r for r in results if r["name"] != "writer"]
    ops = max(1, writer["sent_ops"])
    p50 = [r["lag_p50_ms"] for r in rs if r["lag_p50_ms"] is not None]
    p90 = [r["lag_p90_ms"] for r in rs if r["lag_p90_ms"] is not None]
    pmax = [r["lag_max_ms"] for r in rs if r["lag_max_ms"] is not None]
    return {"target_req_per_s": rate, "readers": readers, "blocks_per_request": blocks, **writer,
            "ops_per_s": round(writer["sent_ops"] / seconds, 1),
            "applied_share": round(statistics.median(r["applied"] for r in rs) / ops, 3),
            "lag_p50_ms": round(statistics.median(p50), 2) if p50 else None,
            "lag_p90_ms": round(max(p90), 2) if p90 else None, "lag_max_ms": round(max(pmax), 2) if pmax else None,
            "reader_cpu_us_per_op": round(statistics.median(r["cpu_s"] for r in rs) / ops * 1e6, 2),
            "reader_cpu_share": round(statistics.median(r["cpu_s"] for r in rs) / (seconds + 3.0), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--blocks", type=int, default=16, help="chained blocks per request (1,024 tokens at 64)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = _start_redis()
    try:
        sizes = [100_000, 300_000] if args.quick else [100_000, 300_000, 1_000_000, 2_000_000]
        memory = index_memory(sizes)
        print(json.dumps({"memory": memory}), flush=True)
        cfg = SharedStateConfig(namespace=f"perreq-{uuid.uuid4().hex[:6]}")
        per_request = [redis_per_request(url, 200 if args.quick else 500, readers, args.blocks,
                                         SharedStateConfig(namespace=f"{cfg.namespace}-{readers}"))
                       for readers in (0, 1, 4)]
        print(json.dumps({"redis_per_request": per_request}), flush=True)
        rates = [100, 1000] if args.quick else [100, 300, 1000, 3000, 10000]
        reader_counts = [1, 4] if args.quick else [1, 4, 8]
        seconds = 2.0 if args.quick else 4.0
        lag = []
        for readers in reader_counts:
            for rate in rates:
                row = lag_level(url, rate, readers, seconds, args.blocks)
                print(json.dumps(row), flush=True)
                lag.append(row)
        report = {"date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                  "memory": memory, "redis_per_request": per_request, "lag": lag}
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(5)


if __name__ == "__main__":
    main()
