"""What one llama.cpp replica actually keeps for interleaved agent sessions, per request.

    .venv/bin/python bench/llamacpp_cache_probe.py [--sessions 3] [--turns 6] [--similarity 0.1] [--cache-ram-mib N]

Starts one replica (the CI tiny model, 1 slot, the same prompt-cache size as ``bench/llamacpp_agent.py``) and
sends the agent sessions' turns round-robin across sessions (A1 B1 C1 A2 B2 ...), as a replica sees them when a
router keeps every session on it. Prints per request the engine's ``timings.cache_n`` next to what a block-LRU
index of the same capacity (what kvroute's approximate index records: the shared tools prefix once, every
session's blocks, least recently used evicted first) predicts, so the difference is the part of llama.cpp's
cache behaviour such an index does not model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from llamacpp_agent import AgentShape, build_sessions, cache_tokens, session_segments

BLOCK = 16


class BlockLRU:
    """What an approximate index records for one replica: prompt blocks, a shared prefix counted once, LRU."""

    def __init__(self, capacity_tokens: int) -> None:
        from collections import OrderedDict

        self.capacity = capacity_tokens // BLOCK
        self.blocks: OrderedDict = OrderedDict()

    @staticmethod
    def keys(session: int, prompt: int, shared: int) -> list:
        return [("shared", i) if i * BLOCK + BLOCK <= shared else (session, i) for i in range(prompt // BLOCK)]

    def match(self, keys: list) -> int:
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n * BLOCK

    def record(self, keys: list) -> None:
        for k in reversed(keys):
            self.blocks[k] = True
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--similarity", type=float, default=0.1, help="--slot-prompt-similarity of the replica")
    ap.add_argument("--cache-ram-mib", type=int, default=None, help="default: the agent bench's size")
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
    from kvroute.plugin.dev.tiny_model import PRESETS

    shape = AgentShape(sessions=a.sessions, turns=a.turns)
    mib = a.cache_ram_mib if a.cache_ram_mib is not None else PRESETS["small"].cache_ram_mib(cache_tokens(shape))
    opts = ReplicaOptions(cache_ram_mib=mib, threads=1, parallel=1,
                          extra_args=("--slot-prompt-similarity", str(a.similarity)))
    sessions = build_sessions(shape)
    rows = []
    with Fleet(1, "llamacpp", opts, name_prefix="probe") as fleet, httpx.Client(trust_env=False, timeout=120) as http:
        url = fleet.base_urls[0] + "/v1/chat/completions"
        msgs = [[{"role": "system", "content": c.system}, {"role": "user", "content": c.turns[0]}] for c in sessions]
        lru = BlockLRU(cache_tokens(shape))
        shared = session_segments(shape)[0][0][0][1]  # the tools prefix, tokenizer-counted until measured
        for turn in range(shape.turns):
            for s, outputs in enumerate(c.turns[1:] for c in sessions):
                r = http.post(url, json={"model": fleet.model, "messages": msgs[s], "max_tokens": shape.max_tokens,
                                         "temperature": 0}).json()
                t = r["timings"]
                prompt = t["cache_n"] + t["prompt_n"]
                if turn == 0 and s == 1:
                    shared = t["cache_n"]  # the fleet-wide tools prefix, as the engine matched it
                keys = BlockLRU.keys(s, prompt, shared)
                rows.append({"session": s, "turn": turn, "prompt": prompt, "cache_n": t["cache_n"],
                             "index": lru.match(keys) if (turn, s) != (0, 1) else t["cache_n"]})
                lru.record(keys)
                answer = r["choices"][0]["message"]["content"] or "(no answer)"
                if turn < len(outputs):
                    msgs[s] += [{"role": "assistant", "content": answer}, {"role": "user", "content": outputs[turn]}]
    got = sum(r["cache_n"] for r in rows)
    ideal = sum(r["index"] for r in rows)
    total = sum(r["prompt"] for r in rows)
    for r in rows:
        print(f"s{r['session']} t{r['turn']} prompt {r['prompt']:5d} cache_n {r['cache_n']:5d} "
              f"block-LRU index {r['index']:5d}")
    print(f"similarity {a.similarity} cache {mib} MiB: cached share {got / total:.3f} "
          f"(a block-LRU index of the same capacity predicts {ideal / total:.3f})")
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            json.dump({"similarity": a.similarity, "cache_ram_mib": mib, "rows": rows}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
