"""Upper references and precise mode in the simulator: exact-state TTFT oracle, kvroute on KV events,
over-long prompts rejected before routing, and the matrix bench end to end on one small cell."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from kvroute.policies import ConfigError
from kvroute.policies.precise_index import PreciseIndex
from kvroute.sim.costmodel import CostModel
from kvroute.sim.engine import FleetConfig, make_policy, simulate
from kvroute.sim.metrics import summarize
from kvroute.sim.presets import Preset, get_preset
from kvroute.sim.workload import SegmentKeys, SimRequest, Workload
from kvroute.sim.workloads import GENERATORS

ROOT = Path(__file__).resolve().parents[2]
BT = 10


def preset(max_len: int = 100_000) -> Preset:
    cost = CostModel(prefill_tok_s=1000.0, attn_s=0.0, step_overhead_s=0.01, decode_s_per_seq=0.0,
                     kv_read_s_per_token=0.0, chunk_tokens=1000, max_running=8)
    return Preset("test", "hand-computable engine", cost, 20_000, BT, 1, Decimal("1"), max_len)


def test_oracle_ttft_sends_a_session_back_to_the_replica_that_holds_its_context() -> None:
    kb = SegmentKeys(BT)
    ctx = (1, 2000)
    reqs = [SimRequest(2000, 2, kb.keys([ctx]), 0.0),
            SimRequest(2100, 2, kb.keys([ctx, (2, 100)]), 10.0)]
    res = simulate(Workload("t", BT, reqs), "oracle_ttft", FleetConfig(4, preset(), metrics_interval_s=None))
    assert res.requests[1].hit_tokens == 2000  # the exact cache said where the context was
    assert res.reasons["exact_ttft"] == 2


def test_oracle_ttft_needs_the_fleet() -> None:
    from kvroute.policies import Router, RoutingRequest

    out = Router().pick(RoutingRequest("m", [1, 2, 3], 64, 192, request_id="x"), ["a", "b"],
                        policy=make_policy("oracle_ttft"))
    assert out.fallback is not None and "bind()" in out.fallback  # never raises; says why


def test_kvroute_precise_reads_the_engines_events_and_matches_them() -> None:
    p = get_preset("qwen3-32b-h100-tp2")
    wl = GENERATORS["chat"](p.block_tokens, users=40)
    fleet = FleetConfig(4, p)
    policy = make_policy("kvroute_precise", {"event_delay_s": 0.2})
    res = simulate(wl, policy, fleet)
    approx = simulate(wl, "cache_aware", fleet)
    hit_precise = summarize(res, wl, fleet).hit_rate
    hit_approx = summarize(approx, wl, fleet).hit_rate
    assert hit_precise > 0.5 and abs(hit_precise - hit_approx) < 0.1
    with pytest.raises(ConfigError):
        make_policy("kvroute_precise", {"event_delay_s": -1})


def test_precise_index_stored_keys_and_removals() -> None:
    idx = PreciseIndex()
    idx.attach("s", "a")
    assert idx.stored_keys("s", [11, 12], [11, 12]) == 2
    assert idx.match([11, 12, 13], ["a"], 0.0) == {"a": 2}
    idx.removed("s", [12])
    assert idx.match([11, 12, 13], ["a"], 0.0) == {"a": 1}
    assert idx.stored_keys("unknown", [1], [1]) == 0


def test_over_long_prompts_are_rejected_before_any_policy_records_them() -> None:
    kb = SegmentKeys(BT)
    reqs = [SimRequest(500, 2, kb.keys([(1, 500)]), 0.0), SimRequest(5000, 2, kb.keys([(2, 5000)]), 0.1)]
    fleet = FleetConfig(2, preset(max_len=1000), metrics_interval_s=None)
    res = simulate(Workload("t", BT, reqs), "cache_aware", fleet)
    assert res.dropped == 1
    assert sum(res.reasons.values()) == 1  # the long one never reached the router


def test_sim_matrix_quick_json_one_cell() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_matrix.py"), "--quick", "--json",
                          "--only", "unique", "--policies", "cache_aware,round_robin,oracle_ttft"],
                         capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.strip()]
    cell, summary = lines[0], lines[-1]
    assert cell["cell"] == "unique" and set(cell["policies"]) == {"cache_aware", "round_robin", "oracle_ttft"}
    row = cell["policies"]["cache_aware"]
    assert {"ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "hit_rate", "hotspot"} <= set(row)
    assert cell["checks"]["best_baseline"] == "round_robin"  # references are not baselines
    verdict = summary["summary"]
    assert verdict.startswith("kvroute best or within 5 % on ") and "of 1 cells at seed 0" in verdict
    assert summary["summary"].endswith("of 1 cells met") and isinstance(summary["missed_targets"], list)
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_matrix.py"), "--only", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown cell" in bad.stderr
