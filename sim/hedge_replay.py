"""Replay a workload's streams on hosted routes with and without hedging: the TTFT tail beside what it costs.

Every request goes, at its arrival (a follow-up at its predecessor's arrival plus its delay: no queueing on
hosted routes), to the cheapest route by input price. With a ``HedgeConfig`` the same ``policies.hedging.Hedger``
the proxy runs decides: a request whose first token would come after the route's delay gets a second request
on the route ``should_hedge`` picks, sent at that delay; the earlier first token answers, and the loser's cost
is its prompt at its route's price (it is closed before it produced output). The hedger learns a route's TTFT
only from the requests that route answered, as in the proxy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kvroute.billing.pricing import token_cost
from kvroute.policies.hedging import HedgeConfig, Hedger, HedgeRoute
from kvroute.sim.hosted import HostedBackend, HostedSpec
from kvroute.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class HedgeFigures:
    """One replay: TTFT quantiles (seconds), requests sent beyond one each, cost beyond the answers'."""

    setting: str
    requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_p999_s: float
    hedges: int
    hedge_wins: int
    cost: Decimal
    hedge_cost: Decimal

    def row(self) -> dict[str, Any]:
        """The figures as a table row (ms, percentages of requests and of the answers' cost)."""
        answers = self.cost - self.hedge_cost
        return {"setting": self.setting, "requests": self.requests,
                "ttft_p50_ms": round(self.ttft_p50_s * 1000, 1), "ttft_p90_ms": round(self.ttft_p90_s * 1000, 1),
                "ttft_p99_ms": round(self.ttft_p99_s * 1000, 1), "ttft_p999_ms": round(self.ttft_p999_s * 1000, 1),
                "hedges": self.hedges, "hedge_wins": self.hedge_wins,
                "extra_requests_pct": round(100 * self.hedges / self.requests, 2) if self.requests else 0.0,
                "extra_cost_pct": float(round(100 * self.hedge_cost / answers, 2)) if answers > 0 else 0.0,
                "cost": str(self.cost)}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


def _arrivals(workload: Workload) -> list[float]:
    """Each request's send time: its own arrival, or its predecessor's plus its delay."""
    out: list[float] = []
    for spec in workload.requests:
        out.append(out[spec.follows] + spec.delay if spec.follows is not None else spec.arrival)
    return out


def replay_hedged(workload: Workload, routes: Sequence[HostedSpec], hedge: HedgeConfig | None, *,
                  seed: int = 0) -> HedgeFigures:
    """Replay ``workload`` on ``routes`` (see the module docstring); ``hedge`` None: without hedging."""
    if not routes:
        raise ValueError("hedging needs at least one hosted route")
    backends = {s.name: HostedBackend(s, workload.block_tokens, seed) for s in routes}
    primary = min(routes, key=lambda s: (s.input_per_mtok, s.name)).name
    model_routes = [HedgeRoute(s.name, hosted=True, model="m", price=float(s.input_per_mtok)) for s in routes]
    by_name = {r.backend: r for r in model_routes}
    hedger = Hedger(hedge) if hedge is not None else None
    arrivals = _arrivals(workload)
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    ttfts: list[float] = []
    hedges = wins = 0
    cost = hedge_cost = Decimal(0)
    for i in order:
        spec, at = workload.requests[i], arrivals[i]
        first = backends[primary].attempt(at, spec.prompt_tokens, spec.output_tokens, spec.keys)
        if first.kind != "ok":
            continue
        answer, answered_by = first, primary
        if hedger is not None:
            hedger.on_request()
            delay = hedger.delay(primary, spec.prompt_tokens, at)
            target = None
            if delay is not None and first.first_token_at - at > delay:  # late: as the proxy's race sees it
                hedger.late(primary)
                target = hedger.should_hedge(by_name[primary], model_routes)
                hedger.settled(primary)  # (the replay sends one request at a time)
            if target is not None and delay is not None:
                hedges += 1
                second = backends[target.backend].attempt(at + delay, spec.prompt_tokens, spec.output_tokens,
                                                          spec.keys)
                if second.kind == "ok" and second.first_token_at < first.first_token_at:
                    loser, lost_cached, loser_name = first, first.cached_tokens, primary
                    answer, answered_by = second, target.backend
                    wins += 1
                else:
                    loser, lost_cached, loser_name = second, second.cached_tokens, target.backend
                if loser.kind == "ok":
                    lost = token_cost(backends[loser_name].rate, input_uncached=spec.prompt_tokens - lost_cached,
                                      cache_read=lost_cached)
                    hedge_cost += lost
                    cost += lost
            if answered_by == primary:
                hedger.learn(primary, spec.prompt_tokens, first.first_token_at - at, first.first_token_at)
        ttfts.append(answer.first_token_at - at)
        cost += answer.cost
    name = f"hedge {hedge.budget:.0%}" if hedge is not None else "off"
    return HedgeFigures(name, len(ttfts), _quantile(ttfts, 0.5), _quantile(ttfts, 0.9), _quantile(ttfts, 0.99),
                        _quantile(ttfts, 0.999), hedges, wins, cost, hedge_cost)
