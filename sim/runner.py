"""Run one workload under several policies and judge whether cache-aware routing pays off."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.policies import DEFAULT_POLICY
from kvroute.sim.engine import FleetConfig, make_policy, simulate
from kvroute.sim.metrics import PolicyMetrics, summarize
from kvroute.sim.workload import Workload


@dataclass(slots=True)
class Verdict:
    """How much kvroute's default policy gains over round robin, and whether that is worth deploying."""

    worth_it: bool
    summary: str
    hit_rate_gain: float
    ttft_p90_speedup: float
    throughput_gain: float
    best_ttft_p90_policy: str


@dataclass(slots=True)
class Comparison:
    workload: Workload
    fleet: FleetConfig
    metrics: list[PolicyMetrics]
    verdict: Verdict | None = None
    notes: list[str] = field(default_factory=list)

    def by_policy(self) -> dict[str, PolicyMetrics]:
        return {m.policy: m for m in self.metrics}


def _ratio(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return math.nan
    return a / b


def judge(metrics: Sequence[PolicyMetrics], default: str = DEFAULT_POLICY, baseline: str = "round_robin") -> Verdict:
    """Worth it when the default policy reuses ≥ 5 points more prompt tokens than round robin *and*
    improves TTFT p90 by ≥ 10 % or output throughput by ≥ 5 %; otherwise say why not."""
    by = {m.policy: m for m in metrics}
    finite = [m for m in metrics if math.isfinite(m.ttft_p90_s)]
    best = min(finite, key=lambda m: m.ttft_p90_s).policy if finite else ""
    if default not in by or baseline not in by:
        return Verdict(False, f"needs both {default} and {baseline} in the run to judge", math.nan, math.nan,
                       math.nan, best)
    d, b = by[default], by[baseline]
    hit_gain = d.hit_rate - b.hit_rate
    speed = _ratio(b.ttft_p90_s, d.ttft_p90_s)
    thr = _ratio(d.output_tok_s, b.output_tok_s)
    ceiling = max(m.hit_rate for m in metrics)
    if ceiling < 0.05:
        return Verdict(False, "skip cache-aware routing: prompts share almost no prefix (best policy reuses "
                       f"{ceiling:.0%}); use least-load, and run `kvroute lint` to find what breaks reuse",
                       hit_gain, speed, thr, best)
    worth = hit_gain >= 0.05 and ((speed >= 1.10) or (thr >= 1.05))
    if worth:
        text = (f"worth it: {default} reuses {d.hit_rate:.0%} of prompt tokens vs {b.hit_rate:.0%} for "
                f"{baseline}; TTFT p90 {speed:.2f}x faster, output {thr:.2f}x")
    else:
        text = (f"marginal: {default} reuses {d.hit_rate:.0%} vs {b.hit_rate:.0%} ({baseline}); TTFT p90 "
                f"{speed:.2f}x, output {thr:.2f}x — not enough to justify the change on this workload")
    return Verdict(worth, text, hit_gain, speed, thr, best)


def compare(workload: Workload, fleet: FleetConfig, policies: Sequence[str],
            progress: Callable[[str, int, int], None] | None = None) -> Comparison:
    """Simulate ``workload`` once per policy (each with a fresh router and fresh replicas)."""
    built = [(name, make_policy(name)) for name in policies]  # validates every name before any run
    metrics = []
    for name, policy in built:
        cb = None if progress is None else (lambda done, total, _n=name: progress(_n, done, total))
        result = simulate(workload, policy, fleet, cb)
        result.policy = name
        metrics.append(summarize(result, workload, fleet))
    comp = Comparison(workload, fleet, metrics)
    comp.verdict = judge(metrics)
    return comp
