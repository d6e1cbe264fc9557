"""``bench/sim_matrix.py --seeds``: the matrix's own run unchanged, more seeds of each workload, medians over them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sim_matrix  # noqa: E402


def _run(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_matrix.py"), "--quick", "--json", *args],
                         capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(x) for x in out.stdout.splitlines() if x.strip()]


def test_seed_offsets_add_runs_and_leave_the_matrix_run_as_it_was() -> None:
    one = _run("--only", "prefix-ratio", "--policies", "cache_aware,round_robin")
    three = _run("--only", "prefix-ratio", "--policies", "cache_aware,round_robin", "--seeds", "3")
    cells = [c for c in three if "cell" in c]
    assert [c["seed_offset"] for c in cells] == [0, 1, 2]
    assert cells[0]["policies"] == one[0]["policies"] and cells[0]["checks"] == one[0]["checks"]
    p90s = {c["policies"]["round_robin"]["ttft_p90_s"] for c in cells}
    assert len(p90s) == 3  # other seeds are other workloads
    for c in cells:  # kvroute's requests short of the best anchor's p90: none exactly where that target holds
        short = c["checks"]["requests_short_of_best_p90"]
        assert (short == 0) == c["checks"]["le_every_anchor_p90"] and short >= 0
    # the summary line counts the matrix's own cells only
    assert "on 1 of 1 cells at seed 0" in three[-1]["summary"]


def test_a_generated_cell_takes_a_seed_offset() -> None:
    gsp = sim_matrix.CELLS["gsp"][1]
    assert gsp(16, True).requests == gsp(16, True, 0).requests != gsp(16, True, 1).requests


def test_a_trace_without_a_seed_runs_once() -> None:
    assert "mooncake" in sim_matrix.SEEDLESS
    if not sim_matrix.MOONCAKE.exists():
        pytest.skip(f"{sim_matrix.MOONCAKE} not present (shared traces are not part of the repository)")
    bt = 16
    assert sim_matrix.CELLS["mooncake"][1](bt, True, 3).requests == sim_matrix.CELLS["mooncake"][1](bt, True).requests


def _cell(offset: int, p90: dict[str, float], wasted: dict[str, int], met: bool) -> dict:
    checks = {"le_every_anchor_p90": met, "wasted_le_best_anchor": True}
    return {"cell": "c", "seed_offset": offset, "checks": checks,
            "policies": {p: {"ttft_p90_s": v, "wasted_prefill_tokens": wasted[p]} for p, v in p90.items()}}


def test_over_seeds_reports_medians_the_best_anchor_by_median_and_how_often_targets_held() -> None:
    waste = {"cache_aware": 10, "round_robin": 100, "llmd_2026": 5, "oracle_ttft": 0}
    cells = [
        _cell(0, {"cache_aware": 1.0, "round_robin": 2.0, "llmd_2026": 0.9, "oracle_ttft": 0.1}, waste, False),
        _cell(1, {"cache_aware": 1.0, "round_robin": 1.5, "llmd_2026": 1.2, "oracle_ttft": 0.1}, waste, True),
        _cell(2, {"cache_aware": 2.0, "round_robin": 1.0, "llmd_2026": 1.1, "oracle_ttft": 0.1}, waste, False),
    ]
    header, row = sim_matrix.over_seeds(cells)
    fields = row.split()
    # medians: kvroute 1.0; round robin 1.5, llmd_2026 1.1 (the best anchor; oracle_ttft is a reference)
    assert fields[:3] == ["c", "3", "1.000"]
    assert fields[3:5] == ["llmd_2026", "1.100"]
    assert fields[5] == "0.909"
    assert fields[6:8] == ["10", "5"]
    assert fields[8] == "1/3"
    assert fields[9] == "2"  # ranks 2, 1, 3 among kvroute and the anchors
    assert sim_matrix.over_seeds(cells[:1]) == [header]  # one run: nothing to take a median of


def test_a_run_split_over_processes_is_put_back_together_in_cell_order(tmp_path) -> None:
    def part(name: str, *cells: str) -> Path:
        path = tmp_path / name
        subprocess.run([sys.executable, str(ROOT / "bench" / "sim_matrix.py"), "--quick", "--json", "--only",
                        ",".join(cells), "--policies", "cache_aware,round_robin", "--seeds", "2", "--jsonl",
                        str(path)], capture_output=True, text=True, timeout=300, check=True)
        return path

    # the parts in the other order than the matrix's: unique comes after prefix-ratio there
    a, b = part("a.jsonl", "unique"), part("b.jsonl", "prefix-ratio")
    out = tmp_path / "all.jsonl"
    shown = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_matrix.py"), "--summary-of", str(a), str(b),
                            "--jsonl", str(out)], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(c["cell"], c["seed_offset"]) for c in lines[:-1]] == [
        ("prefix-ratio", 0), ("prefix-ratio", 1), ("unique", 0), ("unique", 1)]
    assert lines[-1] == sim_matrix.verdict(lines[:-1])
    assert "on 2 of 2 cells at seed 0" in lines[-1]["summary"]
    assert shown.index("== prefix-ratio") < shown.index("== unique") < shown.index("runs kvroute p90")


def _judged(name: str, offset: int, kv: float, anchor: float, oracle: float, wasted: int = 0) -> dict:
    row = lambda p90, w=0: {"ttft_p90_s": p90, "wasted_prefill_tokens": w}  # noqa: E731
    return {"cell": name, "seed_offset": offset, "step_s": 0.014,
            "policies": {"cache_aware": row(kv, wasted), "smg_2026": row(anchor), "oracle": row(oracle)},
            "checks": {"within_5pct": kv <= 1.05 * anchor}}


def test_the_verdict_judges_medians_over_seeds_with_a_one_step_tie_and_oracle_as_a_reference():
    """The owner's rule: the median over the seeds a cell ran, a p90 within one engine step of the best anchor a
    tie, oracle a reference (its lower p90 is no miss); wasted prefill against that anchor's median."""
    tie = [_judged("chat", k, kv, 1.0, 0.5) for k, kv in enumerate((1.01, 1.013, 0.99, 1.2, 1.0))]
    miss = [_judged("agent", k, kv, 1.0, 0.5) for k, kv in enumerate((1.02, 1.03, 1.0, 1.05, 1.04))]
    wasteful = [_judged("rag", k, 0.9, 1.0, 0.5, wasted=10) for k in range(5)]
    v = sim_matrix.verdict([*tie, *miss, *wasteful])
    assert [m.split(" ")[0] for m in v["missed_targets"]] == ["agent", "rag"]
    assert "median over 5 seed(s)" in v["summary"] and "oracle" in v["summary"] and "1 of 3 cells met" in v["summary"]
