"""The four overflow strategies of a self-hosted fleet with hosted overflow and their figures on one workload.

================== ====================================================== ===========================
strategy           tiers (tried in order)                                 overflows when
================== ====================================================== ===========================
self_hosted        replicas (``cache_aware``)                             never (requests queue)
fallback_on_error  replicas (``cache_aware``), then hosted (marketplace)  a replica answers 429 (its
                                                                          queue cap): LiteLLM fallbacks
always_hosted      hosted (``marketplace``)                               always
hybrid             replicas + hosted (``hybrid``, the real policy)        predicted TTFT > target
================== ====================================================== ===========================

Figures per strategy: TTFT p90 inside and outside the spike, the share of requests whose TTFT meets the
target (a failed request never does), cost per 1,000 requests (self-hosted tokens at the GPU-hour card plus
hosted tokens at their prices, ``Decimal``), and the hosted share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kvroute.billing.pricing import GpuRateCard
from kvroute.policies import FleetView, Marketplace, MarketplaceConfig, RouteSides
from kvroute.policies.hybrid import Hybrid, HybridConfig
from kvroute.policies.rates import SelfHostedRate
from kvroute.policies.rolling import percentile
from kvroute.sim.engine import FleetConfig, make_policy
from kvroute.sim.hosted import HostedSpec
from kvroute.sim.mixed_fleet import MixedResult, Strategy, Tier, replica_names, simulate_mixed
from kvroute.sim.spike import SpikeWindow
from kvroute.sim.workload import Workload

STRATEGIES = ("self_hosted", "fallback_on_error", "always_hosted", "hybrid")


def _market(hosted: Sequence[HostedSpec]) -> Marketplace:
    market = Marketplace(MarketplaceConfig())
    market.set_quotes([h.quote() for h in hosted])
    return market


def build_strategy(name: str, fleet: FleetConfig, hosted: Sequence[HostedSpec], *, target_s: float,
                   card: GpuRateCard, queue_limit: int = 8, hybrid_knobs: Mapping[str, Any] | None = None) -> Strategy:
    """One strategy with fresh policy objects; unknown names raise ``ValueError`` listing the known ones."""
    replicas = tuple(replica_names(fleet))
    routes = tuple(h.name for h in hosted)
    if name == "self_hosted":
        return Strategy(name, (Tier(replicas, make_policy("cache_aware")),))
    if name == "fallback_on_error":
        return Strategy(name, (Tier(replicas, make_policy("cache_aware")), Tier(routes, _market(hosted))),
                        queue_limit=queue_limit)
    if name == "always_hosted":
        return Strategy(name, (Tier(routes, _market(hosted)),))
    if name == "hybrid":
        policy = Hybrid(HybridConfig(**{"ttft_target_s": target_s, "hosted": routes, **dict(hybrid_knobs or {})}))
        rate = SelfHostedRate(*card.per_token(), card.currency)
        sides = RouteSides(frozenset(routes), dict.fromkeys(replicas, rate))
        policy.bind(FleetView(quotes=tuple(h.quote() for h in hosted), sides=lambda: sides))
        return Strategy(name, (Tier(replicas + routes, policy),))
    raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")


@dataclass(slots=True)
class Figures:
    """One strategy's figures on one run (seconds, shares in [0, 1], money in the card's currency)."""

    strategy: str
    requests: int
    ttft_p90_in_s: float
    ttft_p90_out_s: float
    meet_in: float
    meet_out: float
    meet_all: float
    cost_per_1k: Decimal
    cost_per_1k_in: Decimal
    cost_per_1k_out: Decimal
    hosted_share: float
    hosted_share_in: float
    failed: int
    currency: str = "USD"
    reasons: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        for k, v in out.items():
            if isinstance(v, Decimal):
                out[k] = str(v.quantize(Decimal("0.000001")))
            elif isinstance(v, float) and not math.isfinite(v):
                out[k] = None
        return out


def _per_1k(costs: list[Decimal]) -> Decimal:
    return (sum(costs, Decimal(0)) * 1000 / len(costs)).quantize(Decimal("1e-10")) if costs else Decimal(0)


def figures(result: MixedResult, window: SpikeWindow, target_s: float, currency: str = "USD") -> Figures:
    """Aggregate one run: inside = requests that arrived in the spike window (first send)."""
    inside = [t for t in result.tracks if window.inside(t.arrival)]
    outside = [t for t in result.tracks if not window.inside(t.arrival)]

    def p90(ts: list) -> float:
        return percentile(sorted(t.ttft for t in ts), 0.9) if ts else math.nan

    def meet(ts: list) -> float:
        return sum(t.ttft <= target_s for t in ts) / len(ts) if ts else math.nan

    tracks = result.tracks
    return Figures(
        result.strategy, len(tracks), p90(inside), p90(outside), meet(inside), meet(outside), meet(tracks),
        _per_1k([t.cost for t in tracks]), _per_1k([t.cost for t in inside]), _per_1k([t.cost for t in outside]),
        sum(t.hosted for t in tracks) / len(tracks) if tracks else 0.0,
        sum(t.hosted for t in inside) / len(inside) if inside else 0.0,
        sum(not math.isfinite(t.first_token_at) for t in tracks), currency,
        dict(result.reasons.most_common(8)), dict(result.failures.most_common(8)))


def run_strategies(workload: Workload, window: SpikeWindow, fleet: FleetConfig, hosted: Sequence[HostedSpec],
                   card: GpuRateCard, *, target_s: float, names: Sequence[str] = STRATEGIES, seed: int = 0,
                   queue_limit: int = 8, hybrid_knobs: Mapping[str, Any] | None = None) -> list[Figures]:
    """Replay ``workload`` once per strategy (fresh policies, replicas and providers each time)."""
    built = [build_strategy(n, fleet, hosted, target_s=target_s, card=card, queue_limit=queue_limit,
                            hybrid_knobs=hybrid_knobs) for n in names]  # validates every name first
    rate = card.cost_rate("self_hosted")
    return [figures(simulate_mixed(workload, s, fleet, hosted, rate, seed=seed), window, target_s, card.currency)
            for s in built]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    detail: str


def check_targets(figs: Mapping[str, Figures]) -> list[Check]:
    """The targets ``hybrid`` must meet: >= 99 % of requests meet the TTFT target through the spike, cheaper
    than always-hosted, within 10 % of self-hosted-only cost outside the spike."""
    out: list[Check] = []
    h = figs.get("hybrid")
    if h is None:
        return out
    out.append(Check("meets target through the spike >= 99 %", h.meet_in >= 0.99, f"{h.meet_in:.2%}"))
    a = figs.get("always_hosted")
    if a is not None:
        out.append(Check("cheaper than always-hosted", h.cost_per_1k < a.cost_per_1k,
                         f"{h.cost_per_1k:.4f} vs {a.cost_per_1k:.4f} per 1k"))
    s = figs.get("self_hosted")
    if s is not None and s.cost_per_1k_out > 0:
        ratio = h.cost_per_1k_out / s.cost_per_1k_out
        out.append(Check("within 10 % of self-hosted-only cost outside the spike", ratio <= Decimal("1.10"),
                         f"{float(ratio):.3f}x"))
    return out


def median_figures(runs: Sequence[Sequence[Figures]]) -> list[Figures]:
    """Per strategy, the median of every figure over the runs (one run per seed, same strategy order)."""
    from statistics import median

    out = []
    for per_seed in zip(*runs, strict=True):
        first = per_seed[0]
        values: dict[str, Any] = {}
        for name in first.__slots__:  # type: ignore[attr-defined]
            v = getattr(first, name)
            if isinstance(v, Decimal | float | int) and not isinstance(v, bool) and name != "requests":
                values[name] = median(getattr(f, name) for f in per_seed)
            else:
                values[name] = v
        values["requests"] = int(median(f.requests for f in per_seed))
        values["failed"] = int(median(f.failed for f in per_seed))
        out.append(Figures(**values))
    return out
