"""Decision latency with Redis-shared state vs local state vs a read-through design, in one run.

    .venv/bin/python bench/shared_state_bench.py [--redis-url URL] [--picks 2000] [--json]

Without ``--redis-url`` it starts a throwaway ``redis-server`` on a free 127.0.0.1 port. Three routers
pick among 8 backends for the same warm, shared-prefix workload (about 8k-token chat prompts):
``local`` (plain Router), ``shared`` (SharedPrefixIndex + SharedLoadTracker, another worker writing at
the same time) and ``read_through`` (the local pick plus the one Redis round trip a design that reads the
index from Redis needs per decision: a lower bound of its cost). Prints p50/p99 per pick, ratios, and
how long a new prefix takes to become visible on the other worker.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid

from kvroute.plugin.state.shared_state import SharedStateConfig, connect
from kvroute.policies import Router

BACKENDS = [f"b{i}" for i in range(8)]


def _workload(n: int) -> list[dict]:
    out = []
    for i in range(n):
        system = f"Assistant for tenant {i % 32}. " + "Long shared instructions. " * 1200
        out.append({"model": "m", "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": f"question {i}"}]})
    return out


def _time_picks(router: Router, requests: list, before=None) -> list[float]:
    samples = []
    for i, req in enumerate(requests):
        t0 = time.perf_counter()
        if before is not None:
            before(req)
        router.pick(req, BACKENDS)
        samples.append(time.perf_counter() - t0)
        router.on_complete(req.request_id, cached_tokens=0)
        if i % 64 == 0:
            time.sleep(0)
    return samples


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": statistics.median(s) * 1e6, "p99_us": s[int(len(s) * 0.99) - 1] * 1e6,
            "mean_us": statistics.fmean(s) * 1e6}


def _start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: pass --redis-url or install it (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def run(url: str, picks: int) -> dict:
    import redis

    cfg = SharedStateConfig(namespace=f"kvbench-{uuid.uuid4().hex[:8]}")
    kwargs = _workload(picks)
    local = Router()
    shared = connect(url, cfg, worker_id="bench-1")
    other = connect(url, cfg, worker_id="bench-2")
    try:
        shared_router = Router(index=shared.index("g"), load=shared.load("g"))
        other_router = Router(index=other.index("g"), load=other.load("g"))
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 5
        while not (shared.connected and other.connected) and time.monotonic() < deadline:
            time.sleep(0.02)
        # Warm every index with the same history; the other worker keeps writing during the timing.
        warm = [local.fingerprint(k, request_id=f"w{i}") for i, k in enumerate(kwargs[:64])]
        for r in (local, shared_router, other_router):
            for i, req in enumerate(warm):
                r.pick(req, BACKENDS)
                r.on_complete(req.request_id, cached_tokens=0)
                req.request_id = f"w{i}x"
        reqs = [local.fingerprint(k, request_id=f"q{i}") for i, k in enumerate(kwargs)]
        for i, req in enumerate(reqs[: picks // 4]):  # background writes from worker 2
            other_router.pick(req, BACKENDS)
            req.request_id = f"q{i}"

        def read_through(req) -> None:
            pipe = client.pipeline(transaction=False)
            for b in BACKENDS:
                pipe.hmget(f"{cfg.namespace}:idx:{b}", req.keys[0], req.keys[-1])
            pipe.execute()

        results = {}
        for _ in range(2):  # alternate to spread noise from the shared CPU
            for name, router, hook in (("local", local, None), ("shared", shared_router, None),
                                       ("read_through", local, read_through)):
                results.setdefault(name, []).extend(_time_picks(router, reqs, hook))
        stats = {name: _stats(s) for name, s in results.items()}
        base = stats["local"]["p50_us"]
        # Propagation: how long until the other worker's index shows a new prefix.
        lags = []
        for i in range(30):
            fresh = other_router.fingerprint(_workload(1)[0] | {"user": f"p{i}"}, request_id=f"lag{i}")
            fresh.keys = [k ^ (i + 1) for k in fresh.keys]
            t0 = time.perf_counter()
            other_router.pick(fresh, ["b0"])
            while not shared_router.index.match(fresh.keys, ["b0"], time.monotonic()):
                if time.perf_counter() - t0 > 2:
                    break
                time.sleep(0.0005)
            lags.append(time.perf_counter() - t0)
        lags.sort()
        return {
            "propagation_ms": {"p50": statistics.median(lags) * 1e3, "max": lags[-1] * 1e3},
            "picks": picks * 2,
            "backends": len(BACKENDS),
            "prompt_tokens": reqs[0].prompt_tokens,
            "latency": stats,
            "ratio_p50": {name: s["p50_us"] / base for name, s in stats.items()},
            "shared_stats": shared.stats(),
        }
    finally:
        shared.close()
        other.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--picks", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = _start_redis()
    try:
        result = run(url, args.picks)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['picks']} picks, {result['backends']} backends, ~{result['prompt_tokens']} prompt tokens")
    for name, s in result["latency"].items():
        print(f"  {name:13s} p50 {s['p50_us']:8.1f} us  p99 {s['p99_us']:8.1f} us  "
              f"ratio p50 vs local {result['ratio_p50'][name]:.2f}x")
    lag = result["propagation_ms"]
    print(f"  prefix visible on the other worker after p50 {lag['p50']:.1f} ms, max {lag['max']:.1f} ms")


if __name__ == "__main__":
    main()
