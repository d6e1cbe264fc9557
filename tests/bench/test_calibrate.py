"""The sim-to-real calibration: its verdict (a model outside the bounds, or a figure missing, misses and exits 1)
and its simulator side on the bench's own flows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import calibrate  # noqa: E402
from calibrate_sim import SALT, block_keys, nearest_rank, replayed, sim_workload, simulate_cell  # noqa: E402
from calibrate_verdict import Bounds, Figures, check, paired  # noqa: E402
from peers_workloads import Size, Workload, build, replica_capacity_tokens  # noqa: E402

from kvroute.plugin.dev.workloads import Conversation  # noqa: E402
from kvroute.sim.engine import FleetConfig, simulate  # noqa: E402
from kvroute.sim.presets import get_preset  # noqa: E402

MEASURED = Figures(0.80, 100.0, 400.0)


# ---------------------------------------------------------------------------------------------- the verdict
@pytest.mark.parametrize(("predicted", "cached_met", "p90_met"), [
    (Figures(0.814, 150.0, 499.0), True, True),  # +1.4 pt, +24.75 %: inside
    (Figures(0.786, 50.0, 301.0), True, True),  # -1.4 pt, -24.75 %
    (Figures(0.816, 100.0, 400.0), False, True),  # +1.6 pt
    (Figures(0.784, 100.0, 400.0), False, True),  # -1.6 pt
    (Figures(0.80, 100.0, 501.0), True, False),  # +25.25 %
    (Figures(0.80, 100.0, 299.0), True, False),  # -25.25 %
])
def test_a_model_meets_the_cell_only_inside_both_bounds(predicted, cached_met, p90_met):
    c = check("sim", MEASURED, predicted)
    assert (c.cached_met, c.p90_met, c.met) == (cached_met, p90_met, cached_met and p90_met)
    assert c.cached_err_pt == pytest.approx((predicted.cached_share - 0.80) * 100)


@pytest.mark.parametrize(("measured", "predicted", "why"), [
    (MEASURED, None, "no complete prediction"),
    (MEASURED, Figures(0.80, 100.0, None), "no complete prediction"),
    (MEASURED, Figures(0.80, 100.0, 400.0, failed=1), "no complete prediction"),
    (None, MEASURED, "no complete measurement"),
    (Figures(None, 100.0, 400.0), MEASURED, "no complete measurement"),
])
def test_a_missing_figure_misses(measured, predicted, why):
    c = check("fake", measured, predicted)
    assert not c.met and c.why == why


def _summary(cached: float, p90: float) -> dict:
    return {"cached_share": cached, "ttft_p50_ms": p90 / 3, "ttft_p90_ms": p90, "failed": 0}


def _saved(fake_apps_p90: float, sim_demo_cached: float) -> dict:
    """A saved calibration of two workloads; every cell right but the two figures given."""
    real = {w: {"summary": {r: _summary(0.7, 400.0) for r, _ in calibrate.ROUTERS}} for w in ("demo", "apps")}
    fake = json.loads(json.dumps(real))
    fake["apps"]["summary"]["smg-ca"]["ttft_p90_ms"] = fake_apps_p90
    sim = {w: {r: _summary(0.7, 400.0) for r, _ in calibrate.ROUTERS} for w in ("demo", "apps")}
    sim["demo"]["kvroute"]["cached_share"] = sim_demo_cached
    return {"cores": 2.0, "background_cores": 0.0, "cache_tokens": 2296, "real": {"workloads": real, "repeats": 1},
            "fake": {"workloads": fake}, "sim": {"workloads": sim}}


def test_render_exits_0_when_every_cell_is_met_and_1_with_a_missed_line_per_check(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_saved(fake_apps_p90=480.0, sim_demo_cached=0.71)))
    assert calibrate.main(["--render", str(good)]) == 0
    out = capsys.readouterr().out
    assert "every model on every cell: MET" in out and "MISSED" not in out
    assert out.count("| met |") == 6

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_saved(fake_apps_p90=520.0, sim_demo_cached=0.72)))
    assert calibrate.main(["--render", str(bad)]) == 1
    out = capsys.readouterr().out
    missed = [line for line in out.splitlines() if line.startswith("MISSED ")]
    assert missed == ["MISSED demo kvroute sim: cached +2.0 pt", "MISSED apps smg-ca fake: p90 +30%"]
    assert "MISSED on 2 of 6 cells" in out


def test_predictions_without_a_measurement_miss_every_cell():
    result = _saved(480.0, 0.7)
    result["real"] = None
    cal = calibrate.judge(result)
    assert not cal.met and len(cal.cells) == 6
    assert all(c.why == "no complete measurement" for cell in cal.cells for c in cell.checks)
    assert not calibrate.judge({}).met  # nothing at all is no pass either


def test_bounds_are_the_issues():
    assert Bounds() == Bounds(cached_pt=1.5, p90_rel=0.25)


def _run(cached: float, p90: float, failed: int = 0) -> dict:
    return {"cached_share": cached, "ttft_p90_ms": p90, "failed": failed}


def test_a_replay_is_judged_repeat_against_repeat_on_the_median_errors_size():
    measured = [_run(0.40, 500.0), _run(0.50, 400.0), _run(0.30, 600.0)]
    one_off = paired(measured, [_run(0.40, 500.0), _run(0.50, 400.0), _run(0.45, 600.0)])  # one repeat +15 pt
    assert one_off.met and one_off.cached_pt == 0.0 and max(one_off.cached_err_pt) == pytest.approx(15.0)
    # the medians agree (40 % each side) while every repeat is 10 points off: paired, that misses
    shuffled = paired(measured, [_run(0.50, 500.0), _run(0.30, 400.0), _run(0.40, 600.0)])
    assert not shuffled.met and shuffled.cached_pt == pytest.approx(10.0)
    biased = paired(measured, [_run(0.42, 500.0), _run(0.52, 400.0), _run(0.32, 600.0)])
    assert not biased.met and biased.cached_pt == pytest.approx(2.0)
    slow = paired(measured, [_run(0.40, 640.0), _run(0.50, 520.0), _run(0.30, 600.0)])  # +28 %, +30 %, 0
    assert slow.met and slow.p90_rel == pytest.approx(0.28)  # shown: TTFT is the closed-loop models' to meet
    failed = paired(measured, [_run(0.40, 500.0, failed=1)] * 3)
    assert failed.repeats == 0 and not failed.met  # nothing compared is no pass
    assert not paired([], []).met


def test_a_replayed_run_arrives_as_it_was_sent_and_a_simulated_run_replays_to_itself():
    size = Size.llamacpp()
    workload = build("agent", size, replica_capacity_tokens(size, 4))
    closed = sim_workload(workload, _bytes, salt=SALT)
    fleet = FleetConfig(4, get_preset("llamacpp"), kv_tokens=calibrate.cache_tokens(), cores=2.0)
    ran = simulate(closed, "round_robin", fleet)
    turns = [(flow.conv_id, t) for flow in workload.flows for t in range(len(flow.turns))]
    log = [{"flow": turns[r.idx][0], "turn": turns[r.idx][1], "call_id": f"{SALT}-{turns[r.idx][0]}-{turns[r.idx][1]}",
            "start_s": r.arrival - 0.010, "router_in_ms": 10.0, "router_out_ms": 5.0} for r in ran.requests]
    replay, hops = replayed(workload, _bytes, list(reversed(log)))
    assert [r.arrival for r in replay.requests] == sorted(r.arrival for r in ran.requests)
    assert all(r.follows is None for r in replay.requests) and hops == [pytest.approx(0.015)] * len(log)
    assert sorted((r.arrival, r.tokens) for r in replay.requests) == \
        sorted((r.arrival, closed.requests[r.idx].tokens) for r in ran.requests)
    # given its own arrivals, round robin meets the same prompts: the same share, request for request
    again = simulate(replay, "round_robin", fleet)
    assert sorted(r.hit_tokens for r in again.requests) == sorted(r.hit_tokens for r in ran.requests)
    cell = simulate_cell(replay, "round_robin", 4, calibrate.cache_tokens(), 2.0, 0.0, hops)
    plain = simulate_cell(closed, "round_robin", 4, calibrate.cache_tokens(), 2.0)
    assert cell["cached_share"] == plain["cached_share"]
    assert cell["ttft_p50_ms"] == pytest.approx(plain["ttft_p50_ms"] + 15.0, abs=0.2)
    other = replayed(workload, _bytes, [{**q, "call_id": "f" * 16 + q["call_id"][16:]} for q in log])[0]
    assert other.requests[0].tokens != replay.requests[0].tokens  # the run's own salt, from its call ids


def test_the_replay_cells_judge_a_saved_calibration_and_set_the_exit(tmp_path, capsys):
    result = _saved(fake_apps_p90=480.0, sim_demo_cached=0.71)
    real_runs = [_run(0.7, 400.0), _run(0.6, 420.0), _run(0.8, 380.0)]
    for w in ("demo", "apps"):
        result["real"]["workloads"][w]["runs"] = {r: real_runs for r, _ in calibrate.ROUTERS}
    result["replay"] = {"workloads": {w: {r: {"runs": real_runs} for r, _ in calibrate.ROUTERS}
                                      for w in ("demo", "apps")}}
    good = tmp_path / "good.json"
    good.write_text(json.dumps(result))
    assert calibrate.main(["--render", str(good)]) == 0
    out = capsys.readouterr().out
    assert "Given each llama.cpp repeat's own arrivals" in out and out.count("| 3 | ") == 6
    result["replay"]["workloads"]["apps"]["kvroute"]["runs"] = [_run(0.6, 400.0), _run(0.8, 420.0), _run(0.7, 380.0)]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(result))
    assert calibrate.main(["--render", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "every model on every cell: MET" in out and "MISSED apps kvroute replay" in out


# ---------------------------------------------------------------------------------------------- the sim side
def _bytes(text: str) -> list[int]:
    return list(text.encode())


def test_sim_workload_tokenizes_every_turn_and_chains_the_flows():
    size = Size.llamacpp()
    workload = build("agent", size, replica_capacity_tokens(size, 4))
    sim = sim_workload(workload, _bytes)
    assert len(sim.requests) == workload.requests
    first = sim.requests[0]
    assert first.tokens is not None and first.prompt_tokens == len(first.tokens)
    assert first.keys == block_keys(first.tokens, 16) and len(first.keys) == len(first.tokens) // 16
    follows = [r for r in sim.requests if r.follows is not None]
    assert follows and all(sim.requests[r.follows].tokens is not None for r in follows)
    turn2 = next(r for r in sim.requests if r.follows == 0)
    assert turn2.tokens[:len(first.tokens)] == first.tokens  # the conversation grows on the same prefix


def test_nearest_rank():
    assert nearest_rank([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert nearest_rank([5.0, 1.0, 3.0, 2.0, 4.0], 0.9) == 5.0
    assert nearest_rank([], 0.5) is None


def test_a_small_calibrate_run_on_the_simulator_side():
    said: list[str] = []
    out = calibrate.run_sim(["demo"], 2.0, 0.0, {"demo": {"kvroute": 50.0}}, said.append, tokenize=_bytes)
    cells = out["workloads"]["demo"]
    assert set(cells) == {r for r, _ in calibrate.ROUTERS} and said and said[0].startswith("sim demo: ")
    assert all(c["failed"] == 0 and c["requests"] == 24 for c in cells.values())
    assert cells["kvroute"]["cached_share"] > cells["sglang-rr"]["cached_share"] + 0.2
    assert cells["smg-ca"]["cached_share"] > cells["sglang-rr"]["cached_share"] + 0.2
    assert all(0 < c["ttft_p50_ms"] <= c["ttft_p90_ms"] for c in cells.values())
    assert out["hop_ms"] == {"demo": {"kvroute": 50.0}} and out["cache_tokens"] == calibrate.cache_tokens()
    busy = calibrate.run_sim(["demo"], 2.0, 2.0, {"demo": {"kvroute": 50.0}}, said.append, tokenize=_bytes)
    rr, busy_rr = cells["sglang-rr"], busy["workloads"]["demo"]["sglang-rr"]
    assert busy_rr["ttft_p90_ms"] > rr["ttft_p90_ms"]  # a busy host slows the replicas


def test_the_routers_round_trip_delays_the_next_turn_and_the_first_token():
    flow = Conversation("c0", "You are a tester. " * 40, ("one", "two", "three"), 0.0, 0)
    workload = Workload("one", (flow,), concurrency=0, max_tokens=8)
    plain = sim_workload(workload, _bytes)
    hop = sim_workload(workload, _bytes, hop_s=0.05)
    assert [r.delay for r in hop.requests] == [0.0, 0.05, 0.05] and all(r.delay == 0 for r in plain.requests)
    a = simulate_cell(plain, "round_robin", 1, 4096, None)
    b = simulate_cell(hop, "round_robin", 1, 4096, None, hop_s=0.05)
    assert a["cached_share"] == b["cached_share"] > 0.5  # one conversation on one replica: nothing else changes
    assert b["ttft_p50_ms"] == pytest.approx(a["ttft_p50_ms"] + 50.0, abs=0.2)


def test_hops_come_from_the_real_runs_under_load_else_the_idle_fleet_else_none():
    runs = {"kvroute": [{"hop_ms": 40.0}, {"hop_ms": 52.0}, {"hop_ms": None}], "smg-ca": [{}]}
    real = {"rivals": {"kvroute": {"hop_ms": 15.5}, "smg-ca": {"hop_ms": 4.0}, "sglang-rr": {}},
            "workloads": {"demo": {"runs": runs}}}
    assert calibrate.hops_ms(real) == {"demo": {"kvroute": 46.0, "smg-ca": 4.0, "sglang-rr": 0.0}}
    assert calibrate.hops_ms(None) == {}
    said: list[str] = []
    slow_hop = calibrate.run_sim(["demo"], 2.0, 0.0, {"demo": {"kvroute": 80.0}}, said.append, tokenize=_bytes)
    no_hop = calibrate.run_sim(["demo"], 2.0, 0.0, {}, said.append, tokenize=_bytes)
    p50 = [run["workloads"]["demo"]["kvroute"]["ttft_p50_ms"] for run in (slow_hop, no_hop)]
    assert p50[0] > p50[1]  # each TTFT carries the router's round trip


def test_engine_cost_is_the_replicas_cpu_per_computed_token_over_every_run():
    log = [{"prompt_tokens": 1000, "cached_tokens": 600}, {"prompt_tokens": 500, "cached_tokens": 400},
           {"prompt_tokens": None, "cached_tokens": None}]
    real = {"workloads": {"demo": {"host_cpu": {"replica_cores": 0.5, "wall_s": 2.0},
                                   "runs": {"kvroute": [{"requests_log": log}], "smg-ca": [{"requests_log": log}]}},
                          "apps": {"runs": {}}}}
    assert calibrate.replica_cpu_per_token(real) == {"demo": 1.0}  # 1 CPU-second over 1,000 computed tokens
    assert calibrate.replica_cpu_per_token(None) == {}


def test_engine_costs_are_the_median_probe_over_the_presets_prefill_and_slow_the_models():
    preset = calibrate.get_preset("llamacpp")
    at = preset.cost.prefill_alone_s(6, 1200) * 1000
    probes = [{"cache_n": 6, "prompt_n": 1200, "prompt_ms": at * f} for f in (1.1, 1.3, 1.2)]
    real = {"workloads": {"demo": {"engine_probe": [*probes, {"prompt_n": 0, "prompt_ms": 0}]}, "apps": {}}}
    assert calibrate.engine_cost_sources(real) == {"demo": (1.2, "3 probes")}
    assert calibrate.probe_cost({"prompt_n": 0, "prompt_ms": 5.0}) is None and calibrate.engine_cost_sources(None) == {}
    said: list[str] = []
    plain = calibrate.run_sim(["demo"], 2.0, 0.0, {}, said.append, tokenize=_bytes)
    slow = calibrate.run_sim(["demo"], 2.0, 0.0, {}, said.append, tokenize=_bytes, costs={"demo": 1.5})
    assert slow["engine_cost"] == {"demo": 1.5}
    for rival in ("smg-ca", "sglang-rr"):
        assert slow["workloads"]["demo"][rival]["ttft_p50_ms"] > plain["workloads"]["demo"][rival]["ttft_p50_ms"]


def test_the_runs_own_requests_alone_on_the_host_measure_its_speed_before_the_probes():
    """Requests that ran alone on the host read its speed (less the response time and the router's measured way);
    one that overlapped another is left out; too few such requests leave the probes' figure."""
    preset = calibrate.get_preset("llamacpp")
    response_s = preset.llamacpp.response_s

    def request(start: float, cached: int, computed: int, slowness: float, hop_ms: float = 0.0) -> dict:
        ttft = response_s + hop_ms / 1000 + slowness * preset.cost.prefill_alone_s(cached, computed)
        return {"ok": True, "start_s": start, "ttft_s": ttft, "end_s": start + ttft + 0.01, "cached_tokens": cached,
                "prompt_tokens": cached + computed, "router_in_ms": hop_ms / 2, "router_out_ms": hop_ms / 2}

    alone = [request(10.0 * i, 1200 * (i % 2), 600, 0.9, hop_ms=20.0) for i in range(calibrate.MIN_SOLO)]
    crowded = [request(500.0, 0, 1200, 2.0), request(500.1, 0, 1200, 2.0)]  # two at once: neither counts
    short = [request(700.0, 1000, 20, 5.0)]  # too few tokens computed to read the engine's speed
    at = preset.cost.prefill_alone_s(6, 1200) * 1000
    probes = [{"cache_n": 6, "prompt_n": 1200, "prompt_ms": at * 1.2}]
    runs = {"kvroute": [{"requests_log": alone[:10] + crowded}], "smg-ca": [{"requests_log": alone[10:] + short}]}
    real = {"workloads": {"agent": {"runs": runs, "engine_probe": probes},
                          "demo": {"runs": {"kvroute": [{"requests_log": alone[:3]}]}, "engine_probe": probes}}}
    assert calibrate.solo_costs(real["workloads"]["agent"]) == pytest.approx([0.9] * calibrate.MIN_SOLO)
    sources = calibrate.engine_cost_sources(real)
    assert sources["agent"] == (0.9, f"{calibrate.MIN_SOLO} requests alone on the host")
    assert sources["demo"] == (1.2, "1 probe")  # 3 requests alone: the probes decide


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_probe_reads_a_replicas_own_prefill_timing_and_recovers_its_slowness():
    """Two fake llama.cpp replicas 1.3 times slower than the preset: ``bench/peers.py``'s probe takes their
    reported ``timings`` and the calibration reads 1.3 back."""
    import asyncio

    from peers import engine_probe

    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

    options = ReplicaOptions(engine_model="llamacpp", cache_ram_mib=9, engine_cost=1.3)
    with Fleet(2, engine="fake", options=options, name_prefix="probe") as fleet:
        samples = asyncio.run(engine_probe(fleet.base_urls, fleet.model, per_replica=2, words=120))
    assert len(samples) == 4 and all(s["prompt_n"] > 100 for s in samples)
    cost, _ = calibrate.engine_cost_sources({"workloads": {"demo": {"engine_probe": samples}}})["demo"]
    assert cost == pytest.approx(1.3, rel=0.01)


def test_fake_repeats_that_drew_a_llamacpp_repeats_order_are_compared_with_it():
    def run(order: str, cached: float) -> dict:
        log = [{"flow": f"f{c}", "turn": 0, "start_s": i * 0.1} for i, c in enumerate(order)]
        return {"cached_share": cached, "ttft_p90_ms": 400.0, "failed": 0, "requests_log": log}

    result = {"real": {"workloads": {"agent": {"runs": {"sglang-rr": [run("abc", 0.44), run("bac", 0.49)]}}}},
              "fake": {"workloads": {"agent": {"runs": {"sglang-rr": [run("bac", 0.49), run("cab", 0.30),
                                                                      run("abc", 0.45)]}}}}}
    matched = calibrate.same_order(result)
    assert list(matched) == [("agent", "sglang-rr")]
    pair = matched[("agent", "sglang-rr")]
    assert pair.repeats == 2 and sorted(pair.cached_err_pt) == [pytest.approx(0.0), pytest.approx(1.0)]
    assert calibrate.arrival_order(run("cab", 0.3)) == (("fc", 0), ("fa", 0), ("fb", 0))


def test_a_runs_salt_comes_back_from_its_call_ids_and_only_from_its_own():
    from peers_workloads import call_id, salt_of, session_key

    assert call_id("f5b83c051048dd83", "demo-3", 2) == session_key("f5b83c051048dd83", "demo-3") + "-2"
    assert salt_of(call_id("f5b83c051048dd83", "demo-3", 2), "demo-3", 2) == "f5b83c051048dd83"
    for other in (("demo-3", 1), ("demo-4", 2)):
        with pytest.raises(ValueError):
            salt_of(call_id("f5b83c051048dd83", "demo-3", 2), *other)
