"""Per-policy figures from one run: hit rate, TTFT percentiles, throughput, queue, hotspot, cost per task.

Two figures judge placement against the limit. *Wasted prefill*: prompt tokens a replica computed although
another replica's prefix cache held them when the request arrived (exact engine caches; a block enters a cache
when the step computing it is scheduled, as in vLLM V1). *The floor*: per request, the TTFT of prefilling only
what no replica's cache held at arrival, alone on an idle replica of the fleet's speed model, with no wait; no
router beats it on that run, and ``gap_to_floor_p90`` = TTFT p90 / floor p90 says how close a policy came.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from kvroute.sim.engine import FleetConfig, RunResult
from kvroute.sim.workload import Workload


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of a non-empty list; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def requests_short(sorted_values: Sequence[float], q: float, target: float) -> int | None:
    """The fewest of these values (ascending) that would have to come down to ``target`` for their
    ``percentile(q)`` to be ≤ it (the largest go first): 0 when it already is; None when empty or not finite."""
    xs = sorted_values
    n = len(xs)
    if not n or not math.isfinite(target):
        return None
    below = bisect.bisect_right(xs, target)  # values already ≤ target
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)

    def at(i: int, k: int) -> float:
        """The i-th value once the k largest are lowered to ``target`` (they sort right after the ones below it)."""
        return xs[i] if i < below else (target if i < below + k else xs[i - k])

    def met(k: int) -> bool:
        return at(lo, k) + (at(hi, k) - at(lo, k)) * (pos - lo) <= target

    # all of them at the latest (the default only guards a rounding of the last interpolation)
    return next((k for k in range(n - below + 1) if met(k)), n - below)


@dataclass(slots=True)
class PolicyMetrics:
    """What one policy achieved on one workload (times in seconds, money in ``currency``)."""

    policy: str
    requests: int
    completed: int
    dropped: int
    hit_rate: float
    first_pass_hit_rate: float | None
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    output_tok_s: float
    queue_depth_mean: float
    queue_depth_max: int
    hotspot: float
    cost_per_task: Decimal
    currency: str
    makespan_s: float
    preemptions: int
    evictions: int
    wall_s: float
    router_errors: int
    wasted_prefill_tokens: int = 0
    wasted_prefill_share: float = 0.0
    floor_p50_s: float = math.nan
    floor_p90_s: float = math.nan
    reasons: dict[str, int] = field(default_factory=dict)
    stage_ttft_p90: list[tuple[str, float]] = field(default_factory=list)
    #: every completed request's TTFT, ascending, 8 bytes each (for ``requests_short``; not in ``public``)
    ttfts: array = field(default_factory=lambda: array("d"), repr=False)

    def public(self) -> dict[str, float]:
        """This policy's figures in ``kvroute simulate --json`` (``report.to_json``)."""
        return {
            "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_s": _r(self.ttft_p50_s),
            "ttft_p90_s": _r(self.ttft_p90_s),
            "ttft_p99_s": _r(self.ttft_p99_s),
            "ttft_mean_s": _r(self.ttft_mean_s),
            "output_tok_s": round(self.output_tok_s, 1),
            "hotspot": round(self.hotspot, 3),
            "cost_per_task": float(self.cost_per_task),
            "wasted_prefill_tokens": self.wasted_prefill_tokens,
            "wasted_prefill_share": round(self.wasted_prefill_share, 4),
            "floor_p50_s": _r(self.floor_p50_s),
            "floor_p90_s": _r(self.floor_p90_s),
            "gap_to_floor_p90": _r(self.gap_to_floor_p90),
        }

    @property
    def gap_to_floor_p90(self) -> float:
        """TTFT p90 over the floor's p90 (≥ 1: the floor is below every request's TTFT, so its p90 is too)."""
        if not (math.isfinite(self.ttft_p90_s) and math.isfinite(self.floor_p90_s)) or self.floor_p90_s <= 0:
            return math.nan
        return self.ttft_p90_s / self.floor_p90_s


def _r(x: float) -> float:
    return round(x, 4) if math.isfinite(x) else x


def summarize(result: RunResult, workload: Workload, fleet: FleetConfig) -> PolicyMetrics:
    """Aggregate a run. Hit rate is token-weighted over completed requests (cached prompt / prompt tokens)."""
    done = [r for r in result.requests if r.first_token_at >= 0]
    prompt = sum(r.prompt for r in done)
    hit = sum(max(0, r.hit_tokens) for r in done)
    first_pass = None
    if workload.first_pass:
        fp = [r for r in done if r.idx < workload.first_pass]
        fp_prompt = sum(r.prompt for r in fp)
        first_pass = sum(max(0, r.hit_tokens) for r in fp) / fp_prompt if fp_prompt else None
    ttfts = [r.first_token_at - r.arrival for r in done]
    wasted = sum(max(0, r.held_elsewhere - max(0, r.hit_tokens)) for r in done)
    floors = [r.floor_s for r in done if r.floor_s >= 0]
    start = min((r.arrival for r in result.requests), default=0.0)
    end = max((r.done_at for r in result.requests), default=start)
    makespan = max(end - start, 1e-9)
    output = sum(r.output for r in done)
    busy = result.replica_busy
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    hotspot = max(busy) / mean_busy if mean_busy > 0 else 1.0
    preset = fleet.preset
    cost = (preset.usd_per_gpu_hour * preset.gpus * fleet.replicas * Decimal(str(makespan)) / Decimal(3600))
    per_task = (cost / len(done)).quantize(Decimal("0.000001"), ROUND_HALF_UP) if done else Decimal(0)
    stage_p90: list[tuple[str, float]] = []
    if workload.stages:
        by_stage: dict[int, list[float]] = {}
        for r, st in zip(result.requests, result.stages, strict=True):
            if r.first_token_at >= 0:
                by_stage.setdefault(st, []).append(r.first_token_at - r.arrival)
        stage_p90 = [(workload.stages[s][0], percentile(v, 90)) for s, v in sorted(by_stage.items())]
    qs = result.queue_samples
    return PolicyMetrics(
        policy=result.policy,
        requests=len(result.requests),
        completed=len(done),
        dropped=result.dropped,
        hit_rate=hit / prompt if prompt else 0.0,
        first_pass_hit_rate=first_pass,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        output_tok_s=output / makespan,
        queue_depth_mean=sum(qs) / len(qs) / fleet.replicas if qs else 0.0,
        queue_depth_max=max(qs) if qs else 0,
        hotspot=hotspot,
        cost_per_task=per_task,
        currency="USD",
        makespan_s=makespan,
        preemptions=result.preemptions,
        evictions=result.evictions,
        wall_s=result.wall_s,
        router_errors=result.router_errors,
        wasted_prefill_tokens=wasted,
        wasted_prefill_share=wasted / prompt if prompt else 0.0,
        floor_p50_s=percentile(floors, 50),
        floor_p90_s=percentile(floors, 90),
        reasons=dict(result.reasons),
        stage_ttft_p90=stage_p90,
        ttfts=array("d", sorted(ttfts)),
    )
