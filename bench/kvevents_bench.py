#!/usr/bin/env python3
"""Precise-mode benchmarks, each as a ratio against a baseline measured in the same run.

1. Event ingestion (blocks/s): msgspec decode of the payloads alone (baseline) vs decode + sequence
   bookkeeping + dual-key index updates (``KvEventFeed.ingest``) vs the same through real ZMQ sockets.
   Target: ≥ 100k blocks/s.
2. Warm multi-turn chat decision at ~8k tokens (ms p50): approximate fingerprint + pick (baseline) vs
   precise (chat template + tokenizer with its per-message prefix cache + token keys + pick) on a warm index.
   Target: ≤ 2 ms p50.

    .venv/bin/python bench/kvevents_bench.py [--model-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import msgspec

from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed
from kvroute.plugin.feeds.precise import PreciseGroup
from kvroute.plugin.feeds.tokenizing import LocalTokenizer
from kvroute.policies import Router
from kvroute.policies.fingerprint import chain_seed
from kvroute.policies.precise_index import PreciseIndex

WORDS = ("alpha beta gamma delta epsilon river mountain cloud stone forest ocean bridge tower garden market "
         "harbor engine signal vector matrix kernel buffer socket thread module import return yield class").split()


def make_batches(n_batches: int, events_per_batch: int, blocks_per_event: int, block_size: int,
                 seed: int = 0) -> tuple[list[bytes], int]:
    """Realistic vLLM batches (map encoding): chained stores, and removals of older blocks."""
    rng = random.Random(seed)
    payloads, total, h = [], 0, 1
    live: list[int] = []
    for _ in range(n_batches):
        events = []
        for _ in range(events_per_batch):
            parent = None
            hashes = []
            for _ in range(blocks_per_event):
                hashes.append(h)
                h += 1
            tokens = [rng.randrange(32000) for _ in range(blocks_per_event * block_size)]
            events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                           "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"})
            live.extend(hashes)
            total += len(hashes)
        if len(live) > 20_000:
            gone, live = live[:2000], live[2000:]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU", "group_idx": 0})
            total += len(gone)
        payloads.append(msgspec.msgpack.encode([time.time(), events, 0]))
    return payloads, total


def bench_ingest(args: argparse.Namespace) -> dict:
    payloads, blocks = make_batches(args.batches, 8, 16, 16)
    dec = msgspec.msgpack.Decoder()
    t0 = time.perf_counter()
    for p in payloads:
        dec.decode(p)
    decode_s = time.perf_counter() - t0

    index = PreciseIndex()
    feed = KvEventFeed(index, [EventSource("inproc://bench", backend="A", topic="kv", model="m")])
    stream = feed._stream(0, b"kv")
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads):
        feed.ingest(stream, seq, p, live=True)
    ingest_s = time.perf_counter() - t0

    import zmq

    index2 = PreciseIndex()
    feed2 = KvEventFeed(index2, [EventSource("tcp://127.0.0.1:0", backend="A", topic="kv", model="m", bind=True)])
    feed2.start()
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(feed2.bound["tcp://127.0.0.1:0"])
    pub.recv()  # the subscription: the feed is listening
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), p])
    last = len(payloads) - 1
    while feed2.stat("kv").last_seq != last and time.perf_counter() - t0 < 120:
        time.sleep(0.002)
    socket_s = time.perf_counter() - t0
    feed2.stop()
    pub.close(0)
    assert feed2.stat("kv").batches == len(payloads), "socket run lost batches"
    return {"batches": len(payloads), "blocks": blocks, "index_blocks_end": index.blocks(),
            "decode_only_blocks_per_s": round(blocks / decode_s),
            "ingest_blocks_per_s": round(blocks / ingest_s),
            "ingest_over_sockets_blocks_per_s": round(blocks / socket_s),
            "ingest_cost_vs_decode": round(ingest_s / decode_s, 2)}


def conversation(rng: random.Random, tokens_target: int, tok: LocalTokenizer) -> list[list[dict]]:
    """Turns of one chat whose last turn reaches about ``tokens_target`` tokens."""
    system = " ".join(rng.choice(WORDS) for _ in range(400))
    msgs = [{"role": "system", "content": f"conversation {rng.random()}: {system}"}]
    turns = []
    while True:
        msgs = [*msgs, {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(120))}]
        turns.append(msgs)
        if len(tok._tok.encode(tok._render(msgs, True, {}), add_special_tokens=False).ids) >= tokens_target:
            return turns
        msgs = [*msgs, {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(200))}]


def bench_decision(args: argparse.Namespace, model_dir: str) -> dict:
    rng = random.Random(1)
    backends = [f"b{i}" for i in range(args.backends)]
    probe = LocalTokenizer.from_dir(model_dir)
    template_turns = conversation(rng, args.tokens, probe)
    index = PreciseIndex()
    router = Router(index=index)
    tokenizer = LocalTokenizer.from_dir(model_dir, group="bench")
    group = PreciseGroup("m", index, tokenizer=tokenizer, block_size=args.block_size)
    for i, b in enumerate(backends):
        index.attach(f"src{i}", b)
    approx = Router()
    precise_ms, approx_ms, cold_ms, matched = [], [], [], []
    seed = chain_seed("m")
    for n in range(args.conversations):
        # A distinct conversation each time (its own system prompt) so nothing is warm by accident.
        turns = [[{**m, "content": f"{n} {m['content']}"} if m["role"] == "system" else m for m in t]
                 for t in template_turns]
        prev, last = turns[-2], turns[-1]
        t0 = time.perf_counter()
        ids = tokenizer.encode({"messages": prev})  # the previous turn: cold, fills the prefix cache
        cold_ms.append((time.perf_counter() - t0) * 1000)
        holder = backends[n % len(backends)]
        full = len(ids) // args.block_size * args.block_size
        index.stored(f"src{n % len(backends)}", list(range(n * 10**6, n * 10**6 + full // args.block_size)), None,
                     ids[:full], args.block_size, seed)
        approx.pick(approx.fingerprint({"messages": prev}, model="m", request_id=f"p{n}"), backends)
        kwargs = {"model": "m", "messages": last}
        t0 = time.perf_counter()
        request = group.fingerprint(kwargs, request_id=f"r{n}")
        decision = router.pick(request, backends)
        precise_ms.append((time.perf_counter() - t0) * 1000)
        matched.append((decision.backend == holder, decision.matched_tokens, request.prompt_tokens))
        t0 = time.perf_counter()
        approx.pick(approx.fingerprint(kwargs, model="m", request_id=f"a{n}"), backends)
        approx_ms.append((time.perf_counter() - t0) * 1000)
        router.on_complete(f"r{n}")
        approx.on_complete(f"a{n}")
    p50 = statistics.median(precise_ms)
    return {"prompt_tokens": matched[-1][2], "backends": len(backends), "conversations": args.conversations,
            "precise_warm_p50_ms": round(p50, 3),
            "precise_warm_p90_ms": round(sorted(precise_ms)[int(0.9 * len(precise_ms))], 3),
            "approximate_p50_ms": round(statistics.median(approx_ms), 3),
            "precise_over_approximate": round(p50 / statistics.median(approx_ms), 2),
            "cold_tokenization_p50_ms": round(statistics.median(cold_ms), 3),
            "picked_engine_holder": sum(1 for ok, _, _ in matched if ok) / len(matched),
            "matched_share": round(sum(m for _, m, _ in matched) / sum(p for _, _, p in matched), 3),
            "tokenizer_hit_rate": round(tokenizer.hit_rate() or 0.0, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description="Precise-mode benchmarks (ratios against same-run baselines).")
    p.add_argument("--model-dir", default=None, help="HF model dir with tokenizer.json + tokenizer_config.json "
                                                     "(default: the generated tiny model)")
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from kvroute.plugin.dev.tiny_model import ensure_tiny_model

        model_dir = str(ensure_tiny_model().hf_dir)
    result = {"ingest": bench_ingest(args), "decision": bench_decision(args, model_dir)}
    result["targets_met"] = {
        "ingest_ge_100k_blocks_per_s": result["ingest"]["ingest_over_sockets_blocks_per_s"] >= 100_000,
        "warm_8k_decision_le_2ms_p50": result["decision"]["precise_warm_p50_ms"] <= 2.0,
    }
    print(json.dumps(result, indent=2) if args.json else result)


if __name__ == "__main__":
    main()
