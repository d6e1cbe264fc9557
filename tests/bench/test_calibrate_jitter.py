"""The calibration's repeats: the jitter measured on the real run's per-request logs, the simulator's requests moved
by it per seed, and medians against medians with each side's spread."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import calibrate  # noqa: E402
from calibrate_jitter import Jitter, jittered, measure  # noqa: E402
from calibrate_sim import sim_workload, simulate_cell  # noqa: E402
from calibrate_verdict import Figures  # noqa: E402
from peers_workloads import Size, build, replica_capacity_tokens  # noqa: E402


def _q(flow: str, turn: int, start: float, cached: int) -> dict:
    return {"flow": flow, "turn": turn, "start_s": start, "end_s": start + 0.1, "cached_tokens": cached, "ok": True}


def _repeat(a1: float, b1: float, b_cached0: int, a0: float = 0.0) -> dict:
    """Two flows of two turns: a's second turn starts at ``a1``, b's at ``b1``; b's first turn cached ``b_cached0``."""
    return {"requests_log": [_q("a", 0, a0, 0), _q("a", 1, a1, 10), _q("b", 0, 0.5, b_cached0), _q("b", 1, b1, 10)]}


def test_measure_pools_step_and_start_deviations_from_their_medians():
    runs = {"kvroute": [_repeat(0.200, 0.70, 0, a0=0.001), _repeat(0.210, 0.80, 0), _repeat(0.230, 0.90, 0)]}
    j = measure(runs)
    # a: steps 0.199, 0.210, 0.230 → median 0.210; b: steps 0.2, 0.3, 0.4 → median 0.3
    assert j.step_ms == tuple(sorted([-11.0, 0.0, 20.0, -100.0, 0.0, 100.0]))
    # and relative to those medians, what the fake engines replay
    assert j.step_rel == tuple(sorted([round(0.199 / 0.21 - 1, 4), 0.0, round(0.23 / 0.21 - 1, 4),
                                       round(0.2 / 0.3 - 1, 4), 0.0, round(0.4 / 0.3 - 1, 4)]))
    assert Jitter.from_json(j.to_json()) == j
    assert j.start_ms == tuple(sorted([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_a_step_after_a_turn_whose_cached_tokens_differ_is_routing_not_noise():
    runs = {"sglang-rr": [_repeat(0.2, 0.7, 0), _repeat(0.2, 0.9, 40), _repeat(0.2, 0.8, 0)]}
    j = measure(runs)
    assert len(j.step_ms) == 3  # flow a only: b's first turn hit in one repeat and missed in the others
    assert measure({"x": [_repeat(0.2, 0.7, 0)]}) == Jitter()  # one repeat: nothing to compare
    assert measure({"x": [{"cached_share": 0.5}, {"cached_share": 0.5}]}) == Jitter()  # no logs


def test_jittered_varies_each_requests_engine_time_both_ways_and_moves_first_turns_by_drawn_samples():
    size = Size.llamacpp()
    base = sim_workload(build("demo", size, replica_capacity_tokens(size, 4)), lambda t: list(t.encode()),
                        hop_s=0.005)
    j = Jitter(step_ms=(-50.0, 3.0), start_ms=(-1.0, 2.0), step_rel=(-0.2, 0.1))
    a, again, other = jittered(base, j, 1), jittered(base, j, 1), jittered(base, j, 2)
    assert [r.time_factor for r in a.requests] == [r.time_factor for r in again.requests]  # one seed, one draw
    assert [r.time_factor for r in a.requests] != [r.time_factor for r in other.requests]
    assert {round(r.time_factor, 6) for r in a.requests} == {0.8, 1.1}  # shorter and longer: no bias one way
    for src, moved in zip(base.requests, a.requests, strict=True):
        if src.follows is not None:
            assert moved.delay == src.delay  # a later turn leaves as the replay sends it: its step varies instead
        else:
            assert moved.arrival in (max(0.0, src.arrival - 0.001), pytest.approx(src.arrival + 0.002))
    plain = jittered(base, Jitter(start_ms=(0.0,)), 1)
    assert {r.time_factor for r in plain.requests} == {1.0}  # nothing measured: the model's own times


def test_a_few_milliseconds_of_arrival_jitter_move_round_robin_not_the_cache_aware_router():
    size = Size.llamacpp()
    tok = lambda t: list(t.encode())  # noqa: E731
    base = sim_workload(build("demo", size, replica_capacity_tokens(size, 4)), tok, hop_s=0.005)
    j = Jitter(step_ms=tuple(float(x) for x in range(-8, 9)), start_ms=(0.0, 1.0, 2.0))

    def shares(policy: str) -> set[float]:
        return {simulate_cell(jittered(base, j, s), policy, 4, 2297, None, 0.0, 0.005)["cached_share"]
                for s in range(4)}

    assert len(shares("round_robin")) > 1
    assert len(shares("cache_aware")) == 1


def test_sim_cells_are_medians_of_their_repeats_with_the_repeats_kept():
    repeats = [{"cached_share": v, "ttft_p50_ms": 10.0 * i, "ttft_p90_ms": 100.0 + i, "requests": 24, "failed": 0}
               for i, v in enumerate((0.40, 0.20, 0.30))]
    cell = calibrate.sim_cell(repeats)
    assert (cell["cached_share"], cell["ttft_p50_ms"], cell["ttft_p90_ms"]) == (0.30, 10.0, 101.0)
    assert cell["runs"] == repeats and cell["failed"] == 0 and cell["requests"] == 24
    fig = Figures.of(cell, cell["runs"])
    assert fig.cached_range == (0.20, 0.40) and fig.p90_range == (100.0, 102.0) and fig.repeats == 3


def _saved_with_repeats() -> dict:
    def cell(values: list[float]) -> tuple[dict, list[dict]]:
        runs = [{"cached_share": v, "ttft_p50_ms": 100.0, "ttft_p90_ms": 400.0, "failed": 0} for v in values]
        summary = {"cached_share": statistics.median(values), "ttft_p50_ms": 100.0, "ttft_p90_ms": 400.0,
                   "failed": 0}
        return summary, runs

    real_rows = {r: cell([0.30, 0.45, 0.50]) for r, _ in calibrate.ROUTERS}  # median 0.45, spread 0.30–0.50
    real = {"demo": {"summary": {r: s for r, (s, _) in real_rows.items()},
                     "runs": {r: runs for r, (_, runs) in real_rows.items()}}}
    sim = {"demo": {r: calibrate.sim_cell([{**x, "requests": 24} for x in cell([0.44, 0.20, 0.46])[1]])
                    for r, _ in calibrate.ROUTERS}}  # median 0.44: inside, though one repeat is 25 points off
    return {"cores": 2.0, "background_cores": 0.0, "cache_tokens": 2297,
            "real": {"workloads": real, "repeats": 3}, "fake": {"workloads": json.loads(json.dumps(real)),
                                                               "repeats": 3},
            "sim": {"workloads": sim, "repeats": 3}}


def test_the_verdict_compares_medians_and_shows_each_sides_spread(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_saved_with_repeats()))
    assert calibrate.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| demo | sglang-rr | 45.0% [30.0%–50.0%] | 45.0% [30.0%–50.0%] (+0.0) | 44.0% [20.0%–46.0%] (-1.0) |" \
        in out
    assert "repeats: llama.cpp 3, fake 3, sim 3" in out
    shifted = _saved_with_repeats()
    shifted["sim"]["workloads"]["demo"]["kvroute"] = calibrate.sim_cell(
        [{"cached_share": v, "ttft_p50_ms": 100.0, "ttft_p90_ms": 400.0, "requests": 24, "failed": 0}
         for v in (0.43, 0.50, 0.40)])  # median 0.43: 2 points under 0.45
    path.write_text(json.dumps(shifted))
    assert calibrate.main(["--render", str(path)]) == 1
    assert "MISSED demo kvroute sim: cached -2.0 pt" in capsys.readouterr().out


def test_jitters_are_measured_per_workload_from_the_real_runs_logs():
    real = {"workloads": {"demo": {"runs": {"kvroute": [_repeat(0.2, 0.7, 0), _repeat(0.21, 0.8, 0)]}}}}
    got = calibrate.jitters(real)
    assert set(got) == {"demo"} and len(got["demo"].step_ms) == 4
    assert calibrate.jitters(None) == {}


def test_a_gated_flows_first_start_is_no_start_sample():
    runs = {"kvroute": [_repeat(0.2, 0.7, 0, a0=0.0), _repeat(0.2, 0.7, 0, a0=0.3)]}
    assert sorted(measure(runs).start_ms) == [-150.0, 0.0, 0.0, 150.0]
    assert measure(runs, frozenset({"a"})).start_ms == (0.0, 0.0)  # b's alone


def test_each_workload_gets_the_background_load_measured_while_it_ran():
    real = {"workloads": {"demo": {"host_cpu": {"background_cores": 0.8}},
                          "agent": {"host_cpu": {"background_cores": 0.2}}, "apps": {}}}
    assert calibrate.background_cores(real) == {"demo": 0.8, "agent": 0.2}
    assert calibrate.background_cores(None) == {}
    said: list[str] = []
    tok = lambda t: list(t.encode())  # noqa: E731
    one = calibrate.run_sim(["demo"], 2.0, {"demo": 0.0, "agent": 1.5}, {}, said.append, tokenize=tok)
    busy = calibrate.run_sim(["demo"], 2.0, {"demo": 1.5, "agent": 0.0}, {}, said.append, tokenize=tok)
    same = calibrate.run_sim(["demo"], 2.0, 1.5, {}, said.append, tokenize=tok)  # one figure for every workload
    p90 = [r["workloads"]["demo"]["sglang-rr"]["ttft_p90_ms"] for r in (one, busy, same)]
    assert p90[1] > p90[0] and p90[1] == p90[2]


def test_turn_delays_hold_back_first_turns_per_flow_whatever_the_order_and_leave_steps_to_the_engines():
    from calibrate_jitter import turn_delays

    class Flow:
        def __init__(self, conv_id: str) -> None:
            self.conv_id = conv_id

    jitter = Jitter(step_ms=(-20.0, 10.0, 40.0), start_ms=(-3.0, 5.0), step_rel=(-0.1, 0.2))
    flows = [Flow(f"f{i}") for i in range(12)]
    one = turn_delays(jitter, 0)
    drawn = {(f.conv_id, n): one(f, n) for f in flows for n in range(4)}
    again = turn_delays(jitter, 0)
    assert {(f.conv_id, n): again(f, n) for f in reversed(flows) for n in reversed(range(4))} == drawn  # order-free
    assert all(v == 0.0 for (_, n), v in drawn.items() if n)  # later turns: the fake engines vary their steps
    assert {v for (_, n), v in drawn.items() if n == 0} == {0.0, 0.005}  # a negative sample holds nothing back
    other = turn_delays(jitter, 1)
    assert any(other(f, 0) != drawn[(f.conv_id, 0)] for f in flows)  # repeats differ
    assert turn_delays(Jitter(), 3)(flows[0], 0) == 0.0


def test_the_fake_run_gets_each_workloads_relative_step_jitter_on_a_fleet_of_its_own(monkeypatch):
    import peers

    got = []

    def run(args, say):
        got.append((tuple(args.workload), args.time_jitter, args.turn_delays is not None))
        return {"workloads": {w: {"runs": {}} for w in args.workload}, "wall_s": 1.0, "load_average_end": [0.0]}

    monkeypatch.setattr(peers, "run", run)
    jit = {"demo": Jitter(step_rel=(0.1, -0.1)), "apps": Jitter(step_rel=(0.05,))}
    calibrate.run_fleet("fake", ["demo", "apps"], 1, 2.0, {}, print, jitter=jit, costs={})
    assert got == [(("demo",), (0.1, -0.1), True), (("apps",), (0.05,), True)]
    got.clear()
    calibrate.run_fleet("fake", ["demo", "apps"], 1, 2.0, {}, print, jitter={}, costs={})
    assert got == [(("demo", "apps"), (), False)]  # one setting: one fleet
