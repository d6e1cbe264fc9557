"""The spike figures: four overflow strategies on the Azure arrival pattern ×3 for ten minutes.

    .venv/bin/python bench/hybrid_spike.py [--quick] [--json] [--seeds 3] [--replicas N] [--knob k=v ...]

Workload: the Azure 2023 conversation trace (Azure's ``AzureLLMInferenceTrace_conv``, read from ``TRACE``), 10 min
before, 10 min of spike (the trace's own arrivals plus two more stretches of it: ×3), 10 min after, with a
synthesised chat/agent prefix structure (``sim.spike``); seed k starts the stretch at 600 + 300·k s and draws
its own app/session assignment and provider TTFT samples. Fleet: Qwen3-32B on 2×H100 replicas
(``qwen3-32b-h100-tp2``), the smallest count that holds the target for >= 99 % of requests without the spike
(sized for the mean; printed). Hosted routes, target and queue cap: ``examples/hosted.yaml``. Self-hosted
cost: the preset's GPU-hour card (``sim.spend``). Figures are medians over the seeds; "hybrid" is the
``hybrid`` policy with its default knobs, "hybrid_no_margin" the same policy without its prediction margin
(``prediction_quantile: null``, the rule as first written), or "hybrid_knobs" with ``--knob k=v`` values.
``--quick``: 3-minute windows, one seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvroute.sim.cli import parse_params
from kvroute.sim.engine import FleetConfig
from kvroute.sim.hosted import load_hosted
from kvroute.sim.mixed_fleet import simulate_mixed
from kvroute.sim.overflow_report import print_table, to_json
from kvroute.sim.presets import get_preset
from kvroute.sim.spend import replica_rate_card
from kvroute.sim.spike import AZURE_CONV, azure_spike
from kvroute.sim.strategies import STRATEGIES, build_strategy, check_targets, figures, median_figures

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / AZURE_CONV
HOSTED = ROOT / "examples" / "hosted.yaml"
#: The second hybrid row: the policy without its prediction margin (as first committed), unless --knob is given.
NO_MARGIN = {"prediction_quantile": None}


def size_fleet(preset, windows, target_s: float, card, hosted, seed: int, start: int = 1, stop: int = 16) -> int:
    """Smallest replica count whose self-hosted-only run meets the target for >= 99 % without the spike."""
    wl, win = azure_spike(TRACE, factor=1, seed=seed, **windows)
    for n in range(start, stop + 1):
        fleet = FleetConfig(n, preset)
        result = simulate_mixed(wl, build_strategy("self_hosted", fleet, hosted, target_s=target_s, card=card),
                                fleet, hosted, card.cost_rate("self_hosted"), seed=seed)
        if figures(result, win, target_s).meet_all >= 0.99:
            return n
    raise SystemExit(f"no fleet of <= {stop} replicas holds the target at the mean load")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--hosted", type=Path, default=HOSTED)
    ap.add_argument("--knob", action="append", default=[], help="knobs of a second hybrid row, key=value (repeatable)")
    args = ap.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    span = 180.0 if args.quick else 600.0
    windows = {"before_s": span, "spike_s": span, "after_s": span}
    plan = load_hosted(args.hosted)
    tuned = parse_params(args.knob) if args.knob else dict(NO_MARGIN)
    alt = "hybrid_knobs" if args.knob else "hybrid_no_margin"
    preset = get_preset("qwen3-32b-h100-tp2")
    card = replica_rate_card(preset)
    target = plan.ttft_target_s
    t0 = time.perf_counter()
    replicas = args.replicas or size_fleet(preset, windows, target, card, plan.routes, seed=0)
    fleet = FleetConfig(replicas, preset)
    names = (*STRATEGIES, alt)
    runs = []
    notes: list[str] = []
    for seed in range(seeds):
        wl, win = azure_spike(TRACE, start_s=600.0 + 300.0 * seed, seed=seed, **windows)
        notes = [*notes[:seed], wl.notes[0], *wl.notes[1:]] if seed else list(wl.notes)
        per = []
        for name in names:
            strategy = build_strategy("hybrid" if name == alt else name, fleet, plan.routes,
                                      target_s=target, card=card, queue_limit=plan.queue_limit,
                                      hybrid_knobs=tuned if name == alt else plan.hybrid)
            strategy.name = name
            result = simulate_mixed(wl, strategy, fleet, plan.routes, card.cost_rate("self_hosted"), seed=seed)
            per.append(figures(result, win, target, card.currency))
        runs.append(per)
    med = median_figures(runs)
    by = {f.strategy: f for f in med}
    checks = check_targets(by)
    tuned_checks = check_targets({**by, "hybrid": by[alt]})
    meta = {"workload": notes, "replicas": replicas, "preset": preset.name, "seeds": seeds, "target_s": target,
            "self_hosted_card": {"gpu_hour": str(card.gpu_hour), "gpus": card.gpus,
                                 "prefill_tok_s": str(card.prefill_tok_s), "decode_tok_s": str(card.decode_tok_s),
                                 "input_per_mtok": str(card.input_per_mtok),
                                 "output_per_mtok": str(card.output_per_mtok)},
            "hosted": str(args.hosted.name), "second_hybrid": {"name": alt, "knobs": tuned},
            "second_hybrid_targets": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in tuned_checks],
            "per_seed": [[f.as_dict() for f in per] for per in runs], "wall_s": round(time.perf_counter() - t0, 1)}
    if args.json:
        sys.stdout.write(to_json(med, checks, meta) + "\n")
        return 0
    for line in notes:
        print(line)
    print(f"fleet: {replicas} x {preset.name} (smallest holding {target:g} s for >= 99 % without the spike); "
          f"self-hosted card {card.input_per_mtok}/{card.output_per_mtok} USD per Mtok in/out; "
          f"medians over {seeds} seed(s)")
    print_table(med, checks, f"azure spike x3, target {target:g} s (cost in {card.currency})", target)
    for c in tuned_checks:
        print(f"{'PASS' if c.passed else 'MISS'}  {alt} ({json.dumps(tuned)}) {c.name}: {c.detail}")
    print(f"wall {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
