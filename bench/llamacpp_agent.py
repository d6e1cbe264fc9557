"""Agent-shaped confirmation on real engines: kvroute vs round robin vs the simulator's second-ranked policy.

    .venv/bin/python bench/llamacpp_agent.py [--engine llamacpp|fake] [--replicas 3] [--sessions 12]
                                             [--turns 6] [--concurrency 4] [--json OUT]

Sessions are agent loops: a shared tools + system prompt, a task, then turns that append the model's answer and a
tool output, so every session's context grows turn by turn; the replicas' prompt caches hold about two sessions'
final contexts each, so the fleet's cache is smaller than the sessions' contexts together. The same shape is
first simulated (``cpu-llamacpp-ci`` preset: the 7.4M model these replicas run; the policies a LiteLLM proxy
can run) to pick the policy the simulator ranks second after kvroute's default by TTFT p90; then each of the
three policies gets its own fresh fleet and a real LiteLLM proxy with kvroute, and the sessions are replayed
through it (streaming, official ``openai`` client). Figures: cached-token share (engine-reported), TTFT
p50/p90, requests/s, failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass

from kvroute.plugin.demo_workload import PolicyReport, _corpus, _one_request, warm_up

DEPLOYABLE = ("cache_aware", "round_robin", "least_load", "session_affinity", "prefix_hash")


@dataclass(frozen=True)
class AgentShape:
    sessions: int = 12
    turns: int = 6
    tools_tokens: int = 1200
    task_tokens: int = 120
    tool_output_tokens: int = 350
    max_tokens: int = 8
    concurrency: int = 4

    def final_context(self) -> int:
        turn = self.tool_output_tokens + self.max_tokens + 16
        return self.tools_tokens + self.task_tokens + (self.turns - 1) * turn


def build_sessions(shape: AgentShape) -> list[tuple[str, str, list[str]]]:
    """(tools prompt, task, tool outputs per turn) per session; deterministic text from the stdlib corpus."""
    corpus = _corpus()

    def piece(i: int, tokens: int) -> str:
        chars = tokens * 4
        start = (i * 7919 * 4) % max(1, len(corpus) - chars)
        return corpus[start:start + chars]

    tools = "You are a coding agent. Tools: read_file, run_tests, grep, edit.\n" + piece(1, shape.tools_tokens)
    out = []
    for s in range(shape.sessions):
        task = f"Task {s}: fix the failing test in module {s}.\n" + piece(100 + s, shape.task_tokens)
        outputs = [f"tool output {s}.{t}:\n" + piece(1000 + s * 97 + t, shape.tool_output_tokens)
                   for t in range(shape.turns - 1)]
        out.append((tools, task, outputs))
    return out


def simulate_ranking(shape: AgentShape, replicas: int) -> list[dict]:
    """The same shape in the simulator: TTFT p90 per deployable policy, best first."""
    from kvroute.sim.engine import FleetConfig
    from kvroute.sim.presets import get_preset
    from kvroute.sim.runner import compare
    from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

    preset = get_preset("cpu-llamacpp-ci")
    kb = SegmentKeys(preset.block_tokens)
    reqs: list[SimRequest] = []
    last_of_worker: dict[int, int] = {}
    seg = 10
    for s in range(shape.sessions):
        segs = [(1, shape.tools_tokens), (2 + s, shape.task_tokens)]
        worker = s % shape.concurrency
        prev = last_of_worker.get(worker)
        for _t in range(shape.turns):
            prompt = sum(n for _, n in segs)
            idx = len(reqs)
            reqs.append(SimRequest(prompt, shape.max_tokens, kb.keys(segs), 0.0, follows=prev, session=f"s{s}"))
            prev = idx
            seg += 2
            segs = [*segs, (seg, shape.max_tokens + 16), (seg + 1, shape.tool_output_tokens)]
        last_of_worker[worker] = prev
    wl = Workload("llamacpp-agent", preset.block_tokens, reqs)
    capacity = cache_tokens(shape)
    comp = compare(wl, FleetConfig(replicas, preset, kv_tokens=capacity), list(DEPLOYABLE))
    rows = [{"policy": m.policy, "ttft_p90_s": round(m.ttft_p90_s, 4), "hit_rate": round(m.hit_rate, 4)}
            for m in comp.metrics]
    return sorted(rows, key=lambda r: r["ttft_p90_s"])


def cache_tokens(shape: AgentShape) -> int:
    """Prompt-cache room per replica: about two sessions' final contexts."""
    return 2 * shape.final_context()


async def replay(base_url: str, api_key: str, model: str, sessions: list, shape: AgentShape) -> PolicyReport:
    import httpx
    from openai import AsyncOpenAI

    report = PolicyReport()
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(300.0)) as http:
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "none", http_client=http, max_retries=0)

        async def worker() -> None:
            while True:
                try:
                    tools, task, outputs = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                messages = [{"role": "system", "content": tools}, {"role": "user", "content": task}]
                for t in range(shape.turns):
                    result, answer = await _one_request(client, model, messages, shape.max_tokens)
                    report.results.append(result)
                    if t < len(outputs):
                        messages += [{"role": "assistant", "content": answer or "(no answer)"},
                                     {"role": "user", "content": outputs[t]}]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(shape.concurrency, len(sessions)))))
        report.wall_s = time.perf_counter() - start
    return report


def run_live(policy: str, engine: str, replicas: int, shape: AgentShape, sessions: list) -> PolicyReport:
    from kvroute.plugin.fleet import Fleet, ReplicaOptions
    from kvroute.plugin.proxy_process import ModelGroup, ProxyProcess, build_proxy_config
    from kvroute.plugin.tiny_model import PRESETS

    capacity = cache_tokens(shape)
    if engine == "llamacpp":
        mib = max(1, math.ceil(capacity * PRESETS["small"].kv_bytes_per_token / (1024 * 1024)))
        opts = ReplicaOptions(cache_ram_mib=mib, threads=1, parallel=1)
    else:
        opts = ReplicaOptions(capacity_tokens=capacity, block_tokens=16, prefill_tokens_per_s=8760.0, decode_ms=2.0,
                              slots=2)
    group = f"agent-{policy.replace('_', '-')}"
    with Fleet(replicas, engine, opts, name_prefix=group) as fleet:
        groups = [ModelGroup(group, fleet.api_bases, model=fleet.model,
                             engine="llamacpp" if engine == "llamacpp" else "vllm", id_prefix=group,
                             kv_capacity_tokens=capacity, block_size=16 if engine == "fake" else None)]
        config = build_proxy_config(groups, kvroute=True)
        with ProxyProcess(config, kvroute_settings={"groups": {group: {"policy": policy}}},
                          inherit_kvroute_env=False) as proxy:
            asyncio.run(warm_up(proxy.base_url, proxy.master_key or "", group))
            return asyncio.run(replay(proxy.base_url, proxy.master_key or "", group, sessions, shape))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("llamacpp", "fake"), default="llamacpp")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", dest="json_out", default=None, help="Write the figures to this file.")
    a = ap.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    shape = AgentShape(sessions=a.sessions, turns=a.turns, concurrency=a.concurrency)
    ranking = simulate_ranking(shape, a.replicas)
    second = next(r["policy"] for r in ranking if r["policy"] not in ("cache_aware", "round_robin"))
    print(f"simulator ranking (TTFT p90): {ranking}; second-ranked deployable policy: {second}", flush=True)
    sessions = build_sessions(shape)
    out: dict = {"engine": a.engine, "replicas": a.replicas, "shape": shape.__dict__,
                 "cache_tokens_per_replica": cache_tokens(shape), "sim_ranking": ranking, "policies": {}}
    for policy in ("cache_aware", "round_robin", second):
        report = run_live(policy, a.engine, a.replicas, shape, sessions)
        out["policies"][policy] = report.as_dict()
        print(f"{policy:18s} {report.as_dict()}", flush=True)
    line = json.dumps(out)
    print(line)
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    return 0


__all__ = ["AgentShape", "build_sessions", "main", "simulate_ranking"]

if __name__ == "__main__":
    sys.exit(main())
