"""``bench/peers.py``: its workloads, figures and wasted prefill, and one real ``--quick --json`` run of one tiny
workload in which every rival starts and answers (SMG 1.13, vllm-router 0.1.17 and sglang-router 0.3.2 from PyPI,
each in its own venv under ``.kvroute/``, created on first use; LiteLLM's strategies; LiteLLM + kvroute)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from peers import METRICS, run_figures, summarise, targets  # noqa: E402
from peers_rivals import PEERS, RIVALS  # noqa: E402
from peers_waste import Served, wasted_prefill  # noqa: E402
from peers_workloads import Outcome, RunResult, Size, build, replica_capacity_tokens, shared_tokens  # noqa: E402


def test_apps_workload_has_a_fifth_unique_prompts_and_poisson_starts():
    size = Size()
    w = build("apps", size, replica_capacity_tokens(size, 4))
    assert w.requests == size.app_requests and w.concurrency == 0
    unique = [f for f in w.flows if f.system.startswith("One-off")]
    assert len(unique) == round(0.2 * size.app_requests)
    assert len({f.turns[0] for f in unique}) == len(unique)  # unique means unique
    assert len({f.system for f in w.flows if f not in unique}) > 1  # several apps
    starts = [f.start_s for f in w.flows]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert build("apps", size, 1000) == w  # deterministic


def test_agent_context_outgrows_a_replica_cache():
    size = Size()
    capacity = replica_capacity_tokens(size, 4)
    w = build("agent", size, capacity)
    assert len(w.flows) == size.agents and all(len(f.turns) == size.agent_steps for f in w.flows)
    final_chars = len(w.flows[0].system) + sum(len(t) for t in w.flows[0].turns)
    assert final_chars / 4 > capacity  # the fake tokenizer: 4 bytes a token
    demo = build("demo", size, capacity)
    assert demo.requests == size.demo_requests and demo.concurrency == 4
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", size, capacity)


def test_shared_workload_is_one_prefix_and_unique_questions_at_a_fixed_rate():
    size = Size()
    capacity = replica_capacity_tokens(size, 4)
    w = build("shared", size, capacity)
    assert w.requests == size.shared_requests and w.concurrency == 0
    assert len({f.system for f in w.flows}) == 1 and len({f.turns[0] for f in w.flows}) == w.requests
    system, question = shared_tokens(capacity)
    assert abs(system / (system + question) - 2548 / 9800) < 0.01 and system + question <= 0.75 * capacity + 1
    assert abs(len(w.flows[0].system) / 4 - system) < 0.03 * system
    assert abs(len(w.flows[0].turns[0]) / 4 - question) < 0.03 * question
    assert shared_tokens(10 ** 6) == (2548, 7252)  # the field's own sizes where they fit
    assert [f.start_s for f in w.flows[:3]] == [0.0, 1 / size.shared_rate_per_s, 2 / size.shared_rate_per_s]


def _served(prompt, replica, cached, start, end, tokens=None):
    return Served(prompt, "", replica, tokens or len(prompt) // 4, cached, start, end)


def test_wasted_prefill_counts_prefixes_another_replica_held():
    shared = "s" * 640  # 10 blocks of 64 bytes, 160 tokens
    a = _served(shared + "a" * 64, "r0", 0, 0.0, 1.0)
    same = _served(shared + "b" * 64, "r0", 160, 1.5, 2.0)  # hit on the holder: nothing wasted
    other = _served(shared + "c" * 64, "r1", 0, 1.5, 2.0)  # recomputed the 160 tokens r0 held
    early = _served(shared + "d" * 64, "r2", 0, 0.5, 2.0)  # sent before a finished: r0 did not hold it yet
    waste = wasted_prefill([a, same, other, early])
    assert waste.exact and waste.tokens == 160
    assert waste.share == round(160 / (4 * 176), 4)
    partial = _served(shared + "e" * 64, "r3", 64, 3.0, 4.0)  # 64 cached of 160 held: 96 wasted
    assert wasted_prefill([a, partial]).tokens == 96
    own_only = _served(shared + "f" * 64, "r0", 0, 3.0, 4.0)  # only its own replica held it: eviction, not waste
    assert wasted_prefill([a, own_only]).tokens == 0
    unknown = [dataclasses.replace(s, replica=None) for s in (a, own_only)]
    bound = wasted_prefill(unknown)  # replicas unknown: an upper bound that counts the eviction too
    assert not bound.exact and bound.tokens == 160
    # early was sent while a was in flight: not held yet, but computed twice; in_flight counts it (and other)
    assert wasted_prefill([a, same, other, early], in_flight=True).tokens == 320


def test_run_figures_and_same_repeat_ratios():
    outcomes = [Outcome(True, ttft_s=t / 1000) for t in (10, 20, 30, 40)] + [Outcome(False, error="HTTP 500")]
    fig = run_figures(RunResult(outcomes, wall_s=2.0), before=[(0, 0), (100, 50)], after=[(300, 150), (200, 100)],
                      cpu_s=0.05)
    assert fig["cached_share"] == 0.5  # (150 + 50) / (300 + 100), as the engines counted
    assert fig["spread"] == 1.5 and fig["failed"] == 1 and fig["req_per_s"] == 2.0
    assert fig["ttft_p50_ms"] == 20.0 and fig["ttft_p90_ms"] == 40.0 and fig["router_cpu_ms_per_req"] == 10.0
    assert fig["wasted_share"] is None  # these outcomes carry no usage: no verdict
    base = dict(fig, cached_share=0.25, ttft_p90_ms=80.0)
    fast = dict(fig, cached_share=0.5, ttft_p90_ms=20.0)
    summary = summarise({"litellm-shuffle": [base, dict(base, ttft_p90_ms=10.0)],
                         "kvroute": [fast, dict(fast, ttft_p90_ms=40.0)]})
    # ratios pair runs of the same repeat: 20/80 and 40/10 → median 2.125, not median(30)/median(45)
    assert summary["kvroute"]["ttft_p90_ms_vs_litellm-shuffle"] == 2.125
    assert summary["kvroute"]["cached_share_vs_litellm-shuffle"] == 2.0
    assert summary["kvroute"]["failed"] == 2


def test_targets_say_by_how_much_each_is_met_or_missed():
    row = {"cached_share": 0.8, "ttft_p90_ms": 100.0, "router_cpu_ms_per_req": 10.0}
    summary = {"kvroute": dict(row, **{"ttft_p90_ms_vs_litellm-smg-ca": 0.9, "ttft_p90_ms_vs_litellm-vllm-ca": 1.2,
                                       "router_cpu_ms_per_req_vs_litellm-shuffle": 1.05}),
               "smg-ca": dict(row, cached_share=0.85), "vllm-ca": dict(row, cached_share=0.5),
               "vllm-sll": dict(row, cached_share=0.81),
               "litellm-smg-ca": row, "litellm-vllm-ca": row, "litellm-shuffle": row}
    t = targets(summary)
    assert t["cached_share smg"]["met"] is False and t["cached_share smg"]["difference"] == -0.05
    assert t["cached_share vllm-router"]["met"] is True
    assert t["ttft_p90 smg"]["met"] is True and t["ttft_p90 smg"]["ratio"] == 0.9
    assert t["ttft_p90 vllm-router"]["met"] is False
    assert t["proxy_cpu"]["met"] is False and t["proxy_cpu"]["ratio"] == 1.05
    assert t["cached_share vllm-sll"]["met"] is False  # every direct mode that ran, sticky sessions too
    assert "cached_share sglang-router" not in t  # a peer that did not run: no verdict rather than a wrong one
    assert targets({"kvroute": row}) == {}


@pytest.mark.e2e
@pytest.mark.slow
def test_quick_run_starts_every_rival_and_reports_every_figure(tmp_path):
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--json", "--workload", "demo"],
                          capture_output=True, text=True, timeout=560, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert set(result["routers"].values()) == {"sglang-router==0.3.2", "smg==1.13.0", "vllm-router==0.1.17"}
    assert {k: v["error"] for k, v in result["rivals"].items() if not v["started"]} == {}
    assert set(result["rivals"]) == {s.key for s in RIVALS}
    w = result["workloads"]["demo"]
    assert set(w["summary"]) == set(result["rivals"])
    for key, row in w["summary"].items():
        assert set(METRICS) <= set(row), key
        assert row["requests"] == w["requests_per_run"] and row["failed"] == 0, (key, row)
        assert 0.0 <= row["cached_share"] <= 1.0 and row["spread"] >= 1.0, (key, row)
        assert row["router_cpu_ms_per_req"] > 0, (key, row)  # every rival did routing work
        assert row["ttft_p90_ms"] >= row["ttft_p50_ms"] > 0
        assert row["wasted_exact"] and 0.0 <= row["wasted_share"] < 1.0, (key, row)  # fake engines name themselves
        assert "cached_share_vs_kvroute" in row and "router_cpu_ms_per_req_vs_litellm-shuffle" in row
    direct = {s.key for s in RIVALS if s.router and s.litellm is None} - {d for d, _ in PEERS.values()}
    assert set(w["targets"]) == ({f"{t} {p}" for p in PEERS for t in ("cached_share", "ttft_p90")} | {"proxy_cpu"}
                                 | {f"cached_share {k}" for k in direct})
    assert result["engine_token_calls"].get("/v1/chat/completions/render", 0) > 0  # vllm-router's cache_aware


def test_every_peer_router_installs_from_a_hashed_file_that_pins_it():
    from peer_routers import KINDS

    for kind in KINDS.values():
        text = kind.requirements.read_text()
        assert f"\n{kind.pin} \\\n    --hash=sha256:" in text, f"{kind.requirements} lacks {kind.pin} with hashes"


def test_prompts_of_one_system_prompt_share_their_salt_and_unrelated_prompts_share_none():
    from peers_workloads import system_content

    from kvroute.plugin.dev.workloads import Conversation

    def flow(conv: str, system_id: int, system: str = "S") -> Conversation:
        return Conversation(conv_id=conv, system=system, turns=("q",), system_id=system_id)

    a, b = system_content("run1", flow("c0", 1)), system_content("run1", flow("c1", 1))
    other, own = system_content("run1", flow("c2", 2)), system_content("run1", flow("c3", -1))
    assert a == b  # one app's sessions: the same prefix
    assert len({a[:18], other[:18], own[:18], system_content("run2", flow("c0", 1))[:18]}) == 4
    assert {len(a), len(other), len(own)} == {len("[0123456789abcdef] S")}  # one length: the same blocks
