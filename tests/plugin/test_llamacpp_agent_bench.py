"""bench/llamacpp_agent.py: the agent shape, its simulated ranking, and one live run through real proxies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import llamacpp_agent as bench  # noqa: E402


@pytest.mark.slow
def test_sessions_grow_turn_by_turn_past_the_replica_cache():
    shape = bench.AgentShape()  # the bench's default shape
    sessions = bench.build_sessions(shape)
    assert len(sessions) == shape.sessions and all(len(s.turns) == shape.turns for s in sessions)  # task + outputs
    assert len({s.system for s in sessions}) == 1  # one shared tools prompt
    assert len({s.turns[0] for s in sessions}) == shape.sessions
    # contexts grow every turn, and a replica's cache holds fewer than three sessions' final contexts
    assert shape.final_context() > 2 * (shape.tools_tokens + shape.task_tokens)
    assert 2 * shape.final_context() <= bench.cache_tokens(shape) < 3 * shape.final_context()


def test_simulated_ranking_covers_the_deployable_policies_best_first():
    ranking = bench.simulate_ranking(bench.AgentShape(sessions=6, turns=4), 3)
    assert {r["policy"] for r in ranking} == set(bench.DEPLOYABLE)
    p90 = [r["ttft_p90_s"] for r in ranking]
    assert p90 == sorted(p90)


@pytest.mark.e2e
def test_live_run_on_fake_engines_through_real_proxies(tmp_path):
    out = tmp_path / "agent.json"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "llamacpp_agent.py"), "--engine", "fake",
                          "--replicas", "2", "--sessions", "4", "--turns", "3", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert len(runs) == 3 and {"cache_aware", "round_robin"} <= set(runs)
    for rows in runs.values():
        assert len(rows) == 1 and rows[0]["failed"] == 0 and rows[0]["ttft_p90_s"] is not None
        assert rows[0]["engine_confirmed_cached"] > 0
    assert runs["cache_aware"][0]["kvroute_predicted_cached"] > 0  # kvroute's index predicted hits at pick time
    assert runs["round_robin"][0]["kvroute_predicted_cached"] == 0  # round robin does not consult it
    assert result["medians"]["cache_aware"]["cached_token_share"] > 0.3
