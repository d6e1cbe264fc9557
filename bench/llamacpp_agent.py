"""Agent-shaped confirmation on real engines: kvroute vs round robin vs the simulator's second-ranked policy.

    .venv/bin/python bench/llamacpp_agent.py [--engine llamacpp|fake] [--replicas 3] [--sessions 12]
                                             [--turns 6] [--concurrency 4] [--repeats 3]
                                             [--slot-prompt-similarity 0] [--json OUT]

Sessions are agent loops: a shared tools + system prompt, a task, then turns that append the model's answer and a
tool output, so every session's context grows turn by turn; the replicas' prompt caches hold about two sessions'
final contexts each, so the fleet's cache is smaller than the sessions' contexts together. The same shape is
first simulated (``cpu-llamacpp-ci`` preset: the 7.4M model these replicas run; the policies a LiteLLM proxy
can run) to pick the policy the simulator ranks second after kvroute's default by TTFT p90; then each of the
three policies gets its own fresh fleet and a real LiteLLM proxy with kvroute, and the sessions are replayed
through it (streaming, official ``openai`` client), the three policies interleaved within every repeat.
Figures per run: cached-token share (engine-reported), TTFT p50/p90, requests/s, failures, and the cached
tokens kvroute predicted at pick time next to those the engines confirmed; then medians over the repeats.

Token counts are the tiny model's tokenizer's (not characters / 4), so "two final contexts" is what the
replicas' caches really hold. ``--slot-prompt-similarity`` is llama.cpp's option (its default 0.1 bypasses
the host prompt cache whenever the part a new prompt shares with the slot's last one, e.g. a fleet-wide tools
prefix, is half of that last prompt: see ``bench/llamacpp_cache_probe.py`` and the README's llama.cpp notes);
0 is kvroute's preset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from dataclasses import dataclass
from functools import cache

from kvroute.plugin.dev.demo_workload import PolicyReport, replay, warm_up
from kvroute.plugin.dev.workloads import Conversation, coding_agent_sessions

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
    engine: str = "llamacpp"  # whose token counts: the tiny model's tokenizer, or the fake engine's


    def final_context(self) -> int:
        """Longest final prompt of any session, in the served model's tokens (chat template included)."""
        return max(sum(n for _, n in segs) for segs in session_segments(self)[-1])


#: chat-template tokens around one message (role markers), measured on the tiny model's template
TEMPLATE_TOKENS = 4


@cache
def _tokenizer():
    from tokenizers import Tokenizer

    from kvroute.plugin.dev.tiny_model import ensure_tiny_model

    return Tokenizer.from_file(str(ensure_tiny_model().tokenizer_json))


def token_count(text: str, engine: str = "llamacpp") -> int:
    """Tokens of one message as the engine counts them (chat-template markers included)."""
    if engine == "fake":
        from kvroute.plugin.dev.fake_cache import token_count as fake_count

        return fake_count(text) + TEMPLATE_TOKENS
    return len(_tokenizer().encode(text).ids) + TEMPLATE_TOKENS


@cache
def session_segments(shape: AgentShape) -> list[list[list[tuple[str, int]]]]:
    """Per turn, per session: the prompt as (segment id, tokens) pieces; the last turn's are the final contexts."""
    sessions = build_sessions(shape)
    tools_n = token_count(sessions[0].system, shape.engine)
    answer_n = shape.max_tokens + TEMPLATE_TOKENS
    turns: list[list[list[tuple[str, int]]]] = [[] for _ in range(shape.turns)]
    for s, session in enumerate(sessions):
        task, outputs = session.turns[0], session.turns[1:]
        segs = [("tools", tools_n), (f"task{s}", token_count(task, shape.engine))]
        for t in range(shape.turns):
            turns[t].append(list(segs))
            if t < len(outputs):
                segs += [(f"a{s}.{t}", answer_n), (f"o{s}.{t}", token_count(outputs[t], shape.engine))]
    return turns


def build_sessions(shape: AgentShape) -> list[Conversation]:
    """Per session: the shared tools prompt, then the task and the tool outputs as turns (stdlib text)."""
    return coding_agent_sessions(shape.sessions, shape.turns, shape.tools_tokens, shape.task_tokens,
                                 shape.tool_output_tokens)


def simulate_ranking(shape: AgentShape, replicas: int) -> list[dict]:
    """The same shape in the simulator: TTFT p90 per deployable policy, best first."""
    from kvroute.sim.engine import FleetConfig
    from kvroute.sim.presets import get_preset
    from kvroute.sim.runner import compare
    from kvroute.sim.workload import SegmentKeys, SimRequest, Workload

    preset = get_preset("cpu-llamacpp-ci")
    kb = SegmentKeys(preset.block_tokens)
    turns = session_segments(shape)
    ids: dict[str, int] = {}
    reqs: list[SimRequest] = []
    last_of_worker: dict[int, int] = {}
    for s in range(shape.sessions):
        worker = s % shape.concurrency
        prev = last_of_worker.get(worker)
        for t in range(shape.turns):
            segs = [(ids.setdefault(name, len(ids) + 1), n) for name, n in turns[t][s]]
            prompt = sum(n for _, n in segs)
            idx = len(reqs)
            reqs.append(SimRequest(prompt, shape.max_tokens, kb.keys(segs), 0.0, follows=prev, session=f"s{s}"))
            prev = idx
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


def kvroute_cached(metrics_text: str, group: str) -> dict[str, float]:
    """kvroute's predicted (at pick time) and engine-confirmed cached tokens for ``group`` from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"predicted": 0.0, "confirmed": 0.0, "prompt": 0.0}
    names = {"kvroute_predicted_cached_tokens_total": "predicted",
             "kvroute_confirmed_cached_tokens_total": "confirmed", "kvroute_prompt_tokens_total": "prompt"}
    for fam in text_string_to_metric_families(metrics_text):
        for sample in fam.samples:
            if sample.name in names and sample.labels.get("group") == group:
                out[names[sample.name]] += sample.value
    return out


def run_live(policy: str, engine: str, replicas: int, shape: AgentShape, sessions: list,
             similarity: float = 0.0) -> tuple[PolicyReport, dict[str, float]]:
    import httpx

    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
    from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config, free_port
    from kvroute.plugin.dev.tiny_model import PRESETS

    capacity = cache_tokens(shape)
    if engine == "llamacpp":
        mib = PRESETS["small"].cache_ram_mib(capacity)
        opts = ReplicaOptions(cache_ram_mib=mib, threads=1, parallel=1,
                              extra_args=("--slot-prompt-similarity", str(similarity)))
    else:
        opts = ReplicaOptions(capacity_tokens=capacity, block_tokens=16, prefill_tokens_per_s=8760.0, decode_ms=2.0,
                              slots=2)
    group = f"agent-{policy.replace('_', '-')}"
    with Fleet(replicas, engine, opts, name_prefix=group) as fleet:
        groups = [ModelGroup(group, fleet.api_bases, model=fleet.model,
                             engine="llamacpp" if engine == "llamacpp" else "vllm", id_prefix=group,
                             kv_capacity_tokens=capacity, block_size=16 if engine == "fake" else None)]
        config = build_proxy_config(groups, kvroute=True)
        metrics_port = free_port()
        with ProxyProcess(config, kvroute_settings={"metrics_port": metrics_port,
                                                    "groups": {group: {"policy": policy}}},
                          inherit_kvroute_env=False) as proxy:
            asyncio.run(warm_up(proxy.base_url, proxy.master_key or "", group))
            before = kvroute_cached(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", trust_env=False).text,
                                    group)
            report = asyncio.run(replay(proxy.base_url, proxy.master_key or "", group, sessions, shape.concurrency,
                                        shape.max_tokens, timeout_s=300.0))
            after = kvroute_cached(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", trust_env=False).text,
                                   group)
            return report, {k: after[k] - before[k] for k in after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("llamacpp", "fake"), default="llamacpp")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (each runs every policy once)")
    ap.add_argument("--slot-prompt-similarity", type=float, default=0.0,
                    help="llama.cpp replicas' option (llama.cpp's own default is 0.1; see the module docstring)")
    ap.add_argument("--policies", default=None, help="comma-separated (default: kvroute, RR, sim's second)")
    ap.add_argument("--json", dest="json_out", default=None, help="Write the figures to this file.")
    a = ap.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    shape = AgentShape(sessions=a.sessions, turns=a.turns, concurrency=a.concurrency, engine=a.engine)
    ranking = simulate_ranking(shape, a.replicas)
    second = next(r["policy"] for r in ranking if r["policy"] not in ("cache_aware", "round_robin"))
    print(f"simulator ranking (TTFT p90): {ranking}; second-ranked deployable policy: {second}", flush=True)
    sessions = build_sessions(shape)
    policies = a.policies.split(",") if a.policies else ["cache_aware", "round_robin", second]
    out: dict = {"engine": a.engine, "replicas": a.replicas, "shape": shape.__dict__,
                 "final_context_tokens": shape.final_context(), "cache_tokens_per_replica": cache_tokens(shape),
                 "slot_prompt_similarity": a.slot_prompt_similarity, "load_before": os.getloadavg(),
                 "sim_ranking": ranking, "runs": {p: [] for p in policies}}
    for rep in range(a.repeats):
        for policy in policies:
            report, index = run_live(policy, a.engine, a.replicas, shape, sessions, a.slot_prompt_similarity)
            row = {**report.as_dict(), "kvroute_predicted_cached": index["predicted"],
                   "engine_confirmed_cached": index["confirmed"], "load1": round(os.getloadavg()[0], 2)}
            out["runs"][policy].append(row)
            print(f"repeat {rep} {policy:18s} {row}", flush=True)
    out["medians"] = {p: {k: round(statistics.median(r[k] for r in rows), 4)
                          for k in ("cached_token_share", "ttft_p50_s", "ttft_p90_s", "requests_per_s")}
                      for p, rows in out["runs"].items()}
    out["load_after"] = os.getloadavg()
    for p, m in out["medians"].items():
        print(f"median {p:18s} {m}", flush=True)
    line = json.dumps(out)
    print(line)
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    return 0


__all__ = ["AgentShape", "build_sessions", "main", "simulate_ranking"]

if __name__ == "__main__":
    sys.exit(main())
