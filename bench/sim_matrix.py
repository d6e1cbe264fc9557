"""The simulator matrix: every workload × every baseline, kvroute's ONE default config, in one run.

    .venv/bin/python bench/sim_matrix.py [--quick] [--json] [--only agent,kvct-60] [--policies a,b] [--seeds N]

Per cell (workload) and policy: TTFT p50/p90/mean, hit rate, output tok/s, hotspot (busy time max/mean),
wasted prefill (prompt tokens computed on a replica while another's cache held them at arrival) and the
floor (per request, the prefill of what no replica held at arrival, alone, no wait: its p90 and each policy's
TTFT p90 over it). Checks per cell: kvroute's TTFT p90 ≤ every anchor's (the 2025 and 2026 anchors, oracle
included), and where it is not, how many of its requests are short of it (the fewest that would have to come
down to the best anchor's p90 for kvroute's to); its wasted prefill ≤ the best anchor's (the anchor with the
lowest p90) and the lowest any anchor reaches; its gap to the floor; on ``one-shared-prefix`` its p90 ≤ round
robin's; gsp output throughput vs round robin. The upper references (``oracle_ttft``: exact cache and queues;
``kvroute_precise``: kvroute fed by simulated KV events) are reported beside the anchors and are not anchors in
the checks.
``--json`` prints one JSON object per cell (one per line) instead of the tables; ``--jsonl PATH`` writes
those lines to PATH as well as printing the tables. ``--seeds N`` also runs every generated and kv-cache-tester
cell at N−1 more seeds of its workload and prints each policy's median over the N runs beside the checks of the
matrix's own run: a cell whose ranking flips with the seed shows it there. ``--summary-of A.jsonl [B.jsonl ...]``
prints the tables of saved runs, one run split over processes (``--only``) put back together in cell order, and
with ``--jsonl OUT`` writes it there merged.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

from kvroute.policies import DEFAULT_POLICY
from kvroute.sim.engine import FleetConfig
from kvroute.sim.lineup import DEFAULT_LINEUP
from kvroute.sim.lineup import REFERENCES as SIM_REFERENCES
from kvroute.sim.metrics import requests_short
from kvroute.sim.presets import get_preset
from kvroute.sim.runner import compare
from kvroute.sim.workloads import GENERATORS

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
KVCT = SHARED / "kv-cache-tester" / "traces.tar.gz"
MOONCAKE = SHARED / "mooncake" / "synthetic_trace.jsonl"

# name: (preset, builder(block_tokens, quick) -> Workload[, replicas]); 8 replicas unless given
QWEN, LLAMA = "qwen3-32b-h100-tp2", "llama-3.1-8b-a100"


def _gen(name: str, full: dict, quick: dict):
    """Builder of a generated cell; ``offset`` shifts the generator's own default seed (0: the matrix's run)."""
    base = inspect.signature(GENERATORS[name]).parameters["seed"].default
    return lambda bt, q, offset=0: GENERATORS[name](bt, **(quick if q else full), seed=base + offset)


def _kvct(sessions: int):
    def build(bt: int, quick: bool, offset: int = 0):
        from kvroute.sim.traces import SessionArrivals, load_kvct

        return load_kvct(KVCT, arrivals=SessionArrivals(seed=offset), max_sessions=sessions)
    return build


def _mooncake(bt: int, quick: bool, offset: int = 0):
    """The trace's own timestamps: one run whatever the offset (``SEEDLESS``)."""
    from kvroute.sim.traces import load_mooncake

    return load_mooncake(MOONCAKE, limit=6000 if quick else None)


CELLS = {
    "gsp": (LLAMA, _gen("gsp", {}, {})),
    "one-shared-prefix": (QWEN, _gen("one-shared-prefix", {}, {}), 2),
    "llmd-ladder-capped": (QWEN, _gen("llmd-ladder", {"max_concurrency": 800},
                                      {"scale": 0.3, "max_concurrency": 800})),
    "prefix-repetition": (LLAMA, _gen("prefix-repetition", {}, {})),
    "prefix-ratio": (LLAMA, _gen("prefix-ratio", {"ratio": 0.5}, {"ratio": 0.5})),
    "chat": (QWEN, _gen("chat", {}, {"users": 200})),
    "rag": (LLAMA, _gen("rag", {"rate": 25.0}, {"requests": 1500, "rate": 25.0})),
    "agent": (QWEN, _gen("agent", {}, {"tasks": 150})),
    "unique": (LLAMA, _gen("unique", {"rate": 80.0}, {"requests": 2000, "rate": 80.0})),
    "mooncake": (QWEN, _mooncake),
    "kvct-30": (QWEN, _kvct(30)),
    "kvct-60": (QWEN, _kvct(60)),
    "kvct-100": (QWEN, _kvct(100)),
}
#: reported beside the anchors, never an anchor to beat: the simulator's upper references and ``oracle`` (exact,
#: instant engine state no router has)
REFERENCES = (*SIM_REFERENCES, "oracle")
#: how the matrix is judged: the median over this many workload seeds, p90 ties within one engine step
JUDGED_SEEDS = 5

#: cells whose workload has no seed to vary (run once under ``--seeds``)
SEEDLESS = frozenset({"mooncake"})


def run_cell(name: str, quick: bool, policies: list[str], offset: int = 0) -> dict:
    preset_name, build, *rest = CELLS[name]
    replicas = rest[0] if rest else 8
    preset = get_preset(preset_name)
    wl = build(preset.block_tokens, quick, offset)
    fleet = FleetConfig(replicas, preset)
    t0 = time.perf_counter()
    comp = compare(wl, fleet, policies)
    wall = time.perf_counter() - t0
    rows = {m.policy: {"ttft_p50_s": _r(m.ttft_p50_s), "ttft_p90_s": _r(m.ttft_p90_s), "ttft_mean_s": _r(m.ttft_mean_s),
                       "hit_rate": round(m.hit_rate, 4), "output_tok_s": round(m.output_tok_s, 1),
                       "hotspot": round(m.hotspot, 3), "dropped": m.dropped,
                       "wasted_prefill_tokens": m.wasted_prefill_tokens,
                       "wasted_prefill_share": round(m.wasted_prefill_share, 4),
                       "floor_p50_s": _r(m.floor_p50_s), "floor_p90_s": _r(m.floor_p90_s),
                       "gap_to_floor_p90": _r(m.gap_to_floor_p90)} for m in comp.metrics}
    by = comp.by_policy()
    d = by.get(DEFAULT_POLICY)
    baselines = [m for m in comp.metrics if m.policy != DEFAULT_POLICY and m.policy not in REFERENCES
                 and math.isfinite(m.ttft_p90_s)]
    cell: dict = {"cell": name, "preset": preset_name, "replicas": replicas, "requests": len(wl.requests),
                  "wall_s": round(wall, 1), "seed_offset": offset, "step_s": preset.cost.step_overhead_s,
                  "policies": rows}
    if d is not None and baselines:
        best = min(baselines, key=lambda m: m.ttft_p90_s)
        target = 0.8 if name.startswith("kvct") else 1.05
        ratio = d.ttft_p90_s / best.ttft_p90_s if best.ttft_p90_s > 0 else math.nan
        cell["checks"] = {
            "best_baseline": best.policy, "best_baseline_p90_s": _r(best.ttft_p90_s),
            "kvroute_p90_s": _r(d.ttft_p90_s), "ratio_to_best": round(ratio, 3), "target_ratio": target,
            "within_5pct": bool(ratio <= 1.05 + 1e-9), "meets_target": bool(ratio <= target + 1e-9),
            "hotspot": round(d.hotspot, 3), "hotspot_le_1_5": bool(d.hotspot <= 1.5),
        }
        least_waste = min(baselines, key=lambda m: (m.wasted_prefill_tokens, m.ttft_p90_s))
        floors = [m.floor_p90_s for m in comp.metrics if math.isfinite(m.floor_p90_s)]
        cell["checks"].update({
            "le_every_anchor_p90": bool(d.ttft_p90_s <= best.ttft_p90_s + 1e-9),
            # of kvroute's requests, how many would have to reach the best anchor's p90 for its p90 to (0: met)
            "requests_short_of_best_p90": requests_short(d.ttfts, 90, best.ttft_p90_s + 1e-9),
            "kvroute_wasted_tokens": d.wasted_prefill_tokens, "best_anchor_wasted_tokens": best.wasted_prefill_tokens,
            "wasted_le_best_anchor": bool(d.wasted_prefill_tokens <= best.wasted_prefill_tokens),
            "least_wasting_anchor": least_waste.policy, "least_anchor_wasted_tokens": least_waste.wasted_prefill_tokens,
            "wasted_le_every_anchor": bool(d.wasted_prefill_tokens <= least_waste.wasted_prefill_tokens),
            "kvroute_floor_p90_s": _r(d.floor_p90_s), "kvroute_gap_to_floor_p90": _r(d.gap_to_floor_p90),
            "best_anchor_gap_to_floor_p90": _r(best.gap_to_floor_p90),
            "cell_floor_p90_s": _r(min(floors)) if floors else None,
            "kvroute_p90_over_cell_floor_p90": _r(d.ttft_p90_s / min(floors)) if floors and min(floors) > 0 else None,
        })
        if name == "one-shared-prefix" and "round_robin" in by:
            rr = by["round_robin"]
            cell["checks"]["ratio_to_round_robin"] = round(d.ttft_p90_s / rr.ttft_p90_s, 3)
            cell["checks"]["le_round_robin"] = bool(d.ttft_p90_s <= rr.ttft_p90_s + 1e-9)
        for ref in REFERENCES:
            if ref in by:
                cell["checks"][f"ratio_to_{ref}"] = round(d.ttft_p90_s / by[ref].ttft_p90_s, 3)
        if name == "gsp" and "round_robin" in by:
            rr = by["round_robin"]
            cell["checks"]["throughput_vs_round_robin"] = round(d.output_tok_s / rr.output_tok_s, 3)
            cell["checks"]["round_robin_hit"] = round(rr.hit_rate, 3)
    return cell


def _r(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def _print(cell: dict) -> None:
    seed = f", seed +{cell['seed_offset']}" if cell.get("seed_offset") else ""
    print(f"\n== {cell['cell']} ({cell['preset']} x {cell['replicas']}, {cell['requests']:,} requests{seed}, "
          f"{cell['wall_s']} s) ==")
    print(f"  {'policy':24s} {'p50 s':>8s} {'p90 s':>8s} {'mean s':>8s} {'hit':>7s} {'out tok/s':>10s} {'hotspot':>7s} "
          f"{'wasted Mtok':>11s} {'wasted':>7s} {'floor p90':>9s} {'p90/floor':>9s}")
    for pol, row in cell["policies"].items():
        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:8.3f}"
        gap = row["gap_to_floor_p90"]
        print(f"  {pol:24s} {f(row['ttft_p50_s'])} {f(row['ttft_p90_s'])} {f(row['ttft_mean_s'])} "
              f"{row['hit_rate']:7.1%} {row['output_tok_s']:10,.0f} {row['hotspot']:7.2f} "
              f"{row['wasted_prefill_tokens'] / 1e6:11.3f} {row['wasted_prefill_share']:7.1%} "
              f"{f(row['floor_p90_s']):>9s} {'-' if gap is None else f'{gap:8.2f}x':>9s}")
    if "checks" in cell:
        print(f"  checks: {cell['checks']}", flush=True)


def summary(cells: list[dict]) -> list[str]:
    """One line per cell: kvroute's p90 vs the best anchor's (and how many of its requests stand between them),
    wasted prefill vs the best and the least-wasting anchor, and the gap to the floor."""
    out = [f"{'cell':20s} {'kvroute p90':>11s} {'best anchor':>26s} {'ratio':>6s} {'short':>7s} "
           f"{'wasted kvroute':>14s} {'best anchor':>12s} {'least (anchor)':>30s} {'floor p90':>9s} {'gap':>7s}"]
    for cell in cells:
        c = cell.get("checks")
        if not c:
            continue
        best = f"{c['best_baseline']} {c['best_baseline_p90_s']:.3f}"
        least = f"{c['least_anchor_wasted_tokens']:,} ({c['least_wasting_anchor']})"
        short = c.get("requests_short_of_best_p90")  # absent from runs saved before it was reported
        out.append(f"{cell['cell']:20s} {c['kvroute_p90_s']:11.3f} {best:>26s} {c['ratio_to_best']:6.3f} "
                   f"{'-' if short is None else format(short, ','):>7s} {c['kvroute_wasted_tokens']:14,} "
                   f"{c['best_anchor_wasted_tokens']:12,} {least:>30s} "
                   f"{c['kvroute_floor_p90_s']:9.3f} {c['kvroute_gap_to_floor_p90']:6.2f}x")
    return out


def _meets(c: dict) -> bool:
    return bool(c["le_every_anchor_p90"] and c["wasted_le_best_anchor"] and c.get("le_round_robin", True))


def over_seeds(cells: list[dict]) -> list[str]:
    """Per cell run at several seed offsets: each policy's median p90 and wasted prefill over the runs, kvroute's
    against the anchor with the lowest median p90, on how many runs kvroute met both targets, and its median
    rank by p90 among kvroute and the anchors (1: lowest)."""
    runs: dict[str, list[dict]] = {}
    for cell in cells:
        if cell.get("checks"):
            runs.setdefault(cell["cell"], []).append(cell)
    out = [f"{'cell':20s} {'runs':>4s} {'kvroute p90':>11s} {'best anchor (median)':>34s} {'ratio':>6s} "
           f"{'wasted kvroute':>14s} {'anchor':>12s} {'met':>5s} {'rank':>5s}"]
    for name, group in runs.items():
        if len(group) < 2:
            continue
        names = [p for p in group[0]["policies"] if p != DEFAULT_POLICY and p not in REFERENCES]

        def med(policy: str, field: str, group: list[dict] = group) -> float:
            return statistics.median(g["policies"][policy][field] for g in group)
        best = min(names, key=lambda p: med(p, "ttft_p90_s"))
        kv_p90, best_p90 = med(DEFAULT_POLICY, "ttft_p90_s"), med(best, "ttft_p90_s")
        ranks = [1 + sum(g["policies"][p]["ttft_p90_s"] < g["policies"][DEFAULT_POLICY]["ttft_p90_s"] for p in names)
                 for g in group]
        met = sum(_meets(g["checks"]) for g in group)
        out.append(f"{name:20s} {len(group):4d} {kv_p90:11.3f} {best + ' ' + format(best_p90, '.3f'):>34s} "
                   f"{kv_p90 / best_p90:6.3f} {med(DEFAULT_POLICY, 'wasted_prefill_tokens'):14,.0f} "
                   f"{med(best, 'wasted_prefill_tokens'):12,.0f} {f'{met}/{len(group)}':>5s} "
                   f"{statistics.median(ranks):5g}")
    return out


def verdict(cells: list[dict]) -> dict:
    """How the matrix is judged: per cell, kvroute's median TTFT p90 over the seeds it ran (the matrix's own run
    alone where a cell ran once) against the anchor with the lowest median, a tie within one engine step of the
    cell's preset counted as met, and its median wasted prefill against that anchor's; ``REFERENCES`` (oracle
    among them) are references, not anchors. Also: on how many cells kvroute is best or within 5 % at seed 0."""
    runs: dict[str, list[dict]] = {}
    for cell in cells:
        if cell.get("checks"):
            runs.setdefault(cell["cell"], []).append(cell)
    misses, seeds = [], set()
    for name, group in runs.items():
        seeds.add(len(group))
        anchors = [p for p in group[0]["policies"] if p != DEFAULT_POLICY and p not in REFERENCES]
        if not anchors:
            continue

        def med(policy: str, field: str, group: list[dict] = group) -> float:
            values = [g["policies"][policy][field] for g in group if g["policies"][policy][field] is not None]
            return statistics.median(values) if values else math.inf
        best = min(anchors, key=lambda p: med(p, "ttft_p90_s"))
        kv, best_p90 = med(DEFAULT_POLICY, "ttft_p90_s"), med(best, "ttft_p90_s")
        step = group[0].get("step_s", 0.0)
        wasted, best_wasted = med(DEFAULT_POLICY, "wasted_prefill_tokens"), med(best, "wasted_prefill_tokens")
        p90_met = kv <= best_p90 + step + 1e-9
        wasted_met = wasted <= best_wasted
        rr_met = name != "one-shared-prefix" or "round_robin" not in group[0]["policies"] or \
            kv <= med("round_robin", "ttft_p90_s") + step + 1e-9
        if not (p90_met and wasted_met and rr_met):
            misses.append(f"{name} (median p90 {kv:.4f} vs {best} {best_p90:.4f} s, step {step * 1000:g} ms; "
                          f"wasted {wasted:,.0f} vs {best_wasted:,.0f} tokens)")
    main = [c for c in cells if c.get("checks") and not c.get("seed_offset")]
    wins = sum(c["checks"]["within_5pct"] for c in main)
    judged = "/".join(str(n) for n in sorted(seeds)) or "0"
    return {"summary": f"kvroute best or within 5 % on {wins} of {len(main)} cells at seed 0; judged on the median "
                       f"over {judged} seed(s) (the owner's rule: {JUDGED_SEEDS}), a p90 within one engine step of "
                       f"the best anchor a tie; {', '.join(REFERENCES)} are references, not anchors: "
                       f"{len(runs) - len(misses)} of {len(runs)} cells met",
            "missed_targets": misses}


def _ending(cells: list[dict]) -> None:
    """The summary table, the medians over seeds (when a cell ran at several) and the verdict."""
    v = verdict(cells)
    print("\n" + "\n".join(summary([c for c in cells if not c.get("seed_offset")])))
    if any(c.get("seed_offset") for c in cells):
        print("\n" + "\n".join(over_seeds(cells)))
    print(f"\n{v['summary']}")
    if v["missed_targets"]:
        print("missed targets: " + "; ".join(v["missed_targets"]))


def merged(files: list[Path]) -> list[dict]:
    """The cells of several ``--jsonl`` files (e.g. one run split over processes), in the matrix's cell order and
    each cell's seed offsets in order."""
    cells = [c for f in files for c in map(json.loads, f.read_text(encoding="utf-8").splitlines()) if "cell" in c]
    order = list(CELLS)
    return sorted(cells, key=lambda c: (order.index(c["cell"]), c.get("seed_offset", 0)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Smaller generated workloads (trace cells unchanged "
                                                         "except mooncake, read to 6,000 requests).")
    ap.add_argument("--json", dest="json_out", action="store_true", help="One JSON object per cell per line.")
    ap.add_argument("--only", default="", help="Comma-separated cells (default: all).")
    ap.add_argument("--policies", default="", help="Comma-separated policies (default: all of them).")
    ap.add_argument("--jsonl", type=Path, default=None, help="Also write one JSON object per cell to this file.")
    ap.add_argument("--summary-of", type=Path, nargs="+", default=None,
                    help="Print the tables of --jsonl files (one run split over processes is put back together in "
                         "cell order; with --jsonl, written there merged) and exit.")
    ap.add_argument("--seeds", type=int, default=1, help="Run each cell at this many seed offsets of its workload "
                                                         "(0 = the matrix's own run; trace cells without a seed "
                                                         "once) and print each policy's median over them.")
    a = ap.parse_args()
    if a.summary_of is not None:
        cells = merged(a.summary_of)
        if a.jsonl is not None:
            a.jsonl.write_text("".join(json.dumps(c) + "\n" for c in [*cells, verdict(cells)]), encoding="utf-8")
        for cell in cells:
            _print(cell)
        _ending(cells)
        return 0
    if a.seeds < 1:
        print("error: --seeds must be >= 1", file=sys.stderr)
        return 2
    names = [n for n in a.only.split(",") if n] or list(CELLS)
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        print(f"error: unknown cell(s) {', '.join(unknown)}; known: {', '.join(CELLS)}", file=sys.stderr)
        return 2
    policies = [p for p in a.policies.split(",") if p] or [*DEFAULT_LINEUP, *REFERENCES]
    sink = a.jsonl.open("w", encoding="utf-8") if a.jsonl is not None else None
    cells = []
    for name, offset in [(n, k) for n in names for k in range(1 if n in SEEDLESS else a.seeds)]:
        cell = run_cell(name, a.quick, policies, offset)
        cells.append(cell)
        if sink is not None:
            sink.write(json.dumps(cell) + "\n")
            sink.flush()
        if a.json_out:
            sys.stdout.write(json.dumps(cell) + "\n")
            sys.stdout.flush()
        else:
            _print(cell)
    if sink is not None:
        sink.write(json.dumps(verdict(cells)) + "\n")
        sink.close()
    if a.json_out:
        sys.stdout.write(json.dumps(verdict(cells)) + "\n")
    else:
        _ending(cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
