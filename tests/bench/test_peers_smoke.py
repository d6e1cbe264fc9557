"""``bench/peers.py``: its workloads and figures, and one real ``--quick --json`` run in which every rival
(sglang-router 0.3.2 from PyPI in its own venv, LiteLLM's strategies, LiteLLM + kvroute) starts and answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from peers import METRICS, run_figures, summarise, targets  # noqa: E402
from peers_rivals import RIVALS  # noqa: E402
from peers_workloads import Outcome, RunResult, Size, build, replica_capacity_tokens  # noqa: E402


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


def test_run_figures_and_same_repeat_ratios():
    outcomes = [Outcome(True, ttft_s=t / 1000) for t in (10, 20, 30, 40)] + [Outcome(False, error="HTTP 500")]
    fig = run_figures(RunResult(outcomes, wall_s=2.0), before=[(0, 0), (100, 50)], after=[(300, 150), (200, 100)],
                      cpu_s=0.05)
    assert fig["cached_share"] == 0.5  # (150 + 50) / (300 + 100), as the engines counted
    assert fig["spread"] == 1.5 and fig["failed"] == 1 and fig["req_per_s"] == 2.0
    assert fig["ttft_p50_ms"] == 20.0 and fig["ttft_p90_ms"] == 40.0 and fig["router_cpu_ms_per_req"] == 10.0
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
    summary = {"kvroute": dict(row, **{"ttft_p90_ms_vs_litellm-sglang-ca": 0.9,
                                       "router_cpu_ms_per_req_vs_litellm-shuffle": 1.05}),
               "sglang-ca": dict(row, cached_share=0.85), "litellm-sglang-ca": row, "litellm-shuffle": row}
    t = targets(summary)
    assert t["cached_share"]["met"] is False and t["cached_share"]["difference"] == -0.05
    assert t["ttft_p90"]["met"] is True and t["ttft_p90"]["ratio"] == 0.9
    assert t["proxy_cpu"]["met"] is False and t["proxy_cpu"]["ratio"] == 1.05
    assert targets({"kvroute": row}) == {}  # a rival that did not run: no verdict rather than a wrong one


@pytest.mark.e2e
@pytest.mark.slow
def test_quick_run_starts_every_rival_and_reports_every_figure(tmp_path):
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=560, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["sglang_router"] == "sglang-router==0.3.2"
    assert {k: v["error"] for k, v in result["rivals"].items() if not v["started"]} == {}
    assert set(result["rivals"]) == {s.key for s in RIVALS}
    assert set(result["workloads"]) == {"demo", "apps", "agent"}
    for name, w in result["workloads"].items():
        assert set(w["summary"]) == set(result["rivals"]), name
        for key, row in w["summary"].items():
            assert set(METRICS) <= set(row), (name, key)
            assert row["requests"] == w["requests_per_run"] and row["failed"] == 0, (name, key, row)
            assert 0.0 <= row["cached_share"] <= 1.0 and row["spread"] >= 1.0, (name, key, row)
            assert row["router_cpu_ms_per_req"] > 0, (name, key, row)  # every rival did routing work
            assert row["ttft_p90_ms"] >= row["ttft_p50_ms"] > 0
            assert "cached_share_vs_litellm-shuffle" in row and "ttft_p90_ms_vs_litellm-sglang-ca" in row
        assert set(w["targets"]) == {"cached_share", "ttft_p90", "proxy_cpu"}
