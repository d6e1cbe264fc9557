"""``hybrid``: self-hosted replicas first, overflow to the cheapest hosted route that meets the latency target.

- routes on: the cache-aware predicted TTFT of the best self-hosted replica (seconds) against a target;
  each hosted route's observed TTFT (rolling quantile) and cache-adjusted price of this request
- use it when: one model group mixes self-hosted replicas and priced hosted deployments, and a spike should
  spill to a provider instead of queueing, within a spend guard
- cost: one ``cache_aware`` pick plus one price per hosted route

Rule, per request (``ratio`` = predicted self-hosted TTFT / target)::

    self-hosted    while ratio <= enter_ratio (normal mode) or ratio <= leave_ratio (overflow mode)
    overflow       else, to the cheapest hosted route whose observed TTFT meets the target, if the guard
                   (overflow share, hosted spend per hour, the marketplace's per-app max_price) allows it

Hysteresis: a ratio above ``enter_ratio`` starts overflow mode; in it requests above ``leave_ratio`` also
overflow, so the fleet drains below the target; the mode ends at a ratio <= ``leave_ratio`` no sooner than
``min_dwell_s`` after the last ratio above ``enter_ratio``. Session stickiness: a conversation the marketplace
pinned to a hosted provider (its cache is there) stays there while that route meets the target, the guard
allows it and its cache-adjusted price is no more than the self-hosted cost of recomputing it.
With no self-hosted candidate left (every breaker open) the cheapest acceptable hosted route serves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.cache_aware import CacheAware, CacheAwareConfig
from kvroute.policies.decision import Decision
from kvroute.policies.health import HealthBoard
from kvroute.policies.lifecycle import FleetView, RequestOutcome
from kvroute.policies.marketplace import Marketplace, MarketplaceConfig
from kvroute.policies.overflow_guard import OverflowGuard
from kvroute.policies.prediction_error import PredictionError
from kvroute.policies.rates import ProviderQuote, SelfHostedRate, to_price
from kvroute.policies.request import RoutingRequest

__all__ = ["HostedQuote", "Hybrid", "HybridConfig", "OverflowGuard"]

REASONS = ("self_hosted", "overflow_latency", "session_hosted", "guard_share", "guard_spend",
           "no_hosted_meets_target", "self_hosted_unavailable", "no_acceptable_provider:no_acceptable_route",
           "no_acceptable_provider:guard_spend")


def _target(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Latency target (seconds; per app and per request tag ``key:value``), hysteresis, guard and knobs.

    Prices are decimal strings per token in ``currency``; ``max_hosted_spend_per_hour`` is in ``currency``
    too. ``cache_aware`` holds the self-hosted policy's knobs, ``apps``/``quotes`` the marketplace's (per-app
    allow/deny/``max_price`` rules, rate cards). ``hosted`` names hosted backends that have no quote.
    """

    ttft_target_s: float = 1.0
    app_targets: Mapping[str, float] = field(default_factory=dict)
    tag_targets: Mapping[str, float] = field(default_factory=dict)
    enter_ratio: float = 1.0
    leave_ratio: float = 0.75
    min_dwell_s: float = 10.0
    max_overflow_share: float = 1.0
    share_window_s: float = 60.0
    share_min_requests: int = 20
    max_hosted_spend_per_hour: Any = None
    spend_window_s: float = 3600.0
    currency: str = "USD"
    hosted_ttft_quantile: float = 0.9
    hosted_prior_ttft_s: float | None = None
    self_hosted_input_price: Any = None
    self_hosted_output_price: Any = None
    sticky: bool = True
    hosted: tuple[str, ...] = ()
    cache_aware: Mapping[str, Any] = field(default_factory=dict)
    apps: Mapping[str, Any] = field(default_factory=dict)
    quotes: Mapping[str, Any] = field(default_factory=dict)
    max_routes_shown: int = 4
    prediction_quantile: float | None = 0.9
    prediction_window_s: float = 120.0

    def __post_init__(self) -> None:
        _target(self.ttft_target_s, "ttft_target_s")
        for name in ("app_targets", "tag_targets"):
            table = getattr(self, name)
            if not isinstance(table, Mapping):
                raise ValueError(f"{name} must map names to seconds")
            for k, v in table.items():
                _target(v, f"{name}.{k}")
        if not isinstance(self.tag_targets, Mapping) or any(":" not in str(k) for k in self.tag_targets):
            raise ValueError("tag_targets keys must be 'tag:value'")
        if not 0 < self.leave_ratio <= self.enter_ratio:
            raise ValueError("leave_ratio must be in (0, enter_ratio]")
        if not 0 <= self.max_overflow_share <= 1:
            raise ValueError("max_overflow_share must be in [0, 1]")
        for name in ("min_dwell_s",):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("share_window_s", "spend_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not isinstance(self.share_min_requests, int) or self.share_min_requests < 1:
            raise ValueError("share_min_requests must be an integer >= 1")
        if not 0 < self.hosted_ttft_quantile <= 1:
            raise ValueError("hosted_ttft_quantile must be in (0, 1]")
        if self.hosted_prior_ttft_s is not None and not self.hosted_prior_ttft_s >= 0:
            raise ValueError("hosted_prior_ttft_s must be >= 0 seconds")
        if not isinstance(self.currency, str) or not self.currency:
            raise ValueError("currency must be a currency code such as USD")
        for name in ("max_hosted_spend_per_hour", "self_hosted_input_price", "self_hosted_output_price"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, to_price(value, name))
                except Exception as exc:  # ConfigError: the registry names the knob
                    raise ValueError(f"{name}: {exc}") from None
        if not isinstance(self.hosted, list | tuple) or not all(isinstance(h, str) for h in self.hosted):
            raise ValueError("hosted must be a list of backend ids")
        object.__setattr__(self, "hosted", tuple(self.hosted))
        if not isinstance(self.max_routes_shown, int) or self.max_routes_shown < 0:
            raise ValueError("max_routes_shown must be an integer >= 0")
        try:
            CacheAwareConfig(**dict(self.cache_aware))  # validates the self-hosted knobs
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cache_aware: {exc}") from None
        try:
            MarketplaceConfig(apps=dict(self.apps), quotes=dict(self.quotes))  # validates rules and rate cards
        except (TypeError, ValueError) as exc:
            raise ValueError(f"apps/quotes: {exc}") from None

    def target_for(self, request: RoutingRequest) -> float:
        """The request's target: the first matching ``tag_targets`` entry, else its app's, else the group's."""
        for key, value in self.tag_targets.items():
            tag, _, want = str(key).partition(":")
            if request.tags.get(tag) == want:
                return float(value)
        if request.app is not None and request.app in self.app_targets:
            return float(self.app_targets[request.app])
        return float(self.ttft_target_s)


@dataclass(frozen=True, slots=True)
class HostedQuote:
    """One hosted route for one request: its cache-adjusted price (``currency``) and observed TTFT (seconds).

    ``ttft_s`` None: no sample yet (counts as meeting the target unless ``hosted_prior_ttft_s`` is set)."""

    backend: str
    price: Decimal
    ttft_s: float | None
    currency: str = "USD"

    def meets(self, target_s: float) -> bool:
        return self.ttft_s is None or self.ttft_s <= target_s


class Hybrid(Policy):
    """The ``hybrid`` policy. Feed it the fleet (``bind``: health, rate cards, hosted routes, self-hosted rates)
    and outcomes (``observe``); read ``snapshot`` for its state. One instance per model group."""

    name = "hybrid"

    def __init__(self, config: HybridConfig | None = None, *, health: HealthBoard | None = None,
                 guard: OverflowGuard | None = None) -> None:
        self.config = cfg = config or HybridConfig()
        self.self_policy = CacheAware(CacheAwareConfig(**dict(cfg.cache_aware)))
        self.market = Marketplace(MarketplaceConfig(apps=dict(cfg.apps), quotes=dict(cfg.quotes)), health=health)
        self.guard = guard or OverflowGuard(
            cfg.max_overflow_share, cfg.share_window_s, min_requests=cfg.share_min_requests,
            max_spend_per_hour=cfg.max_hosted_spend_per_hour, spend_window_s=cfg.spend_window_s,
            currency=cfg.currency)
        self._hosted: set[str] = set(cfg.hosted) | {q.backend for q in self.market.config.parsed_quotes()}
        self._rates: dict[str, SelfHostedRate] = {}
        self._default_rate = None
        if cfg.self_hosted_input_price is not None or cfg.self_hosted_output_price is not None:
            self._default_rate = SelfHostedRate(cfg.self_hosted_input_price or Decimal(0),
                                                cfg.self_hosted_output_price or Decimal(0), cfg.currency)
        self.overflowing = False
        self.reasons: Counter[str] = Counter()
        # called with (hosted backend, TTFT seconds) for every hosted response this instance sees (a fleet shares
        # them: ``observe_hosted_ttft`` on the other instances)
        self.ttft_listeners: list[Callable[[str, float], None]] = []
        self.last_why: dict[str, Any] | None = None
        self.errors = None if not cfg.prediction_quantile else PredictionError(cfg.prediction_quantile,
                                                                               cfg.prediction_window_s)

    # --- inputs ---------------------------------------------------------------------------------
    @property
    def health(self) -> HealthBoard | None:
        return self.market.health

    def bind(self, fleet: FleetView) -> None:
        """Keep one guard and marketplace per group (a rule's own hybrid spends and learns with the group's),
        take breakers and rate cards, learn which backends are hosted and what a replica's token costs, and
        join the fleet's spend window (``fleet.share``)."""
        if fleet.group_state is not None:
            self.guard, self.market = fleet.group_state.setdefault("hybrid", (self.guard, self.market))
        self.market.bind(fleet)
        self._hosted.update(q.backend for q in fleet.quotes)
        if fleet.sides is not None:
            sides = fleet.sides()
            self.mark_hosted(sides.hosted)
            for backend, rate in sides.self_hosted_rates.items():
                self.set_self_hosted_rate(backend, rate)
        if fleet.share is not None:
            fleet.share(self)

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        """A success is learnt (``record_success``); any other end releases the attempt's reservation."""
        if not outcome.ok:  # what a failed attempt was billed reaches the ledger, not here
            self.guard.release(request.request_id)
            if self.errors is not None:
                self.errors.forget(request.request_id)
        elif outcome.backend is not None:
            self.record_success(request, outcome.backend, outcome.at, cached_tokens=outcome.cached_tokens,
                                ttft_s=outcome.ttft_s, output_tokens=outcome.output_tokens,
                                duration_s=outcome.duration_s, prompt_tokens=outcome.prompt_tokens)

    def add_quotes(self, quotes: Iterable[ProviderQuote]) -> None:
        """Rate cards of hosted backends (quotes given in config win); a quoted backend is a hosted route."""
        quotes = list(quotes)
        self.market.add_quotes(quotes)
        self._hosted.update(q.backend for q in quotes)

    def mark_hosted(self, backends: Iterable[str]) -> None:
        """Backends that are hosted routes even without a quote (they never overflow: unpriced)."""
        self._hosted.update(backends)

    def set_self_hosted_rate(self, backend: str, rate: SelfHostedRate) -> None:
        """The cost per token of one self-hosted replica (the same unit as the hosted prices)."""
        self._rates[backend] = rate

    def is_hosted(self, backend: str) -> bool:
        return backend in self._hosted

    def record_success(self, request: RoutingRequest, backend: str, now: float, *,
                       cached_tokens: int | None = None, ttft_s: float | None = None,
                       output_tokens: int | None = None, duration_s: float | None = None,
                       prompt_tokens: int | None = None) -> None:
        """A response came back: a hosted one teaches the marketplace (TTFT, cache hits, the session's pin)
        and its cost (the rate card's, as the ledger prices it) replaces its reservation in the guard."""
        if not self.is_hosted(backend):
            self.guard.release(request.request_id)
            if self.errors is not None:
                self.errors.observe(request.request_id, ttft_s, now)
            return
        self.market.record_success(request, backend, now, cached_tokens=cached_tokens, ttft_s=ttft_s,
                                   output_tokens=output_tokens, duration_s=duration_s, prompt_tokens=prompt_tokens)
        if ttft_s is not None:
            for listener in self.ttft_listeners:
                listener(backend, ttft_s)
        q = self.market.quote(backend)
        if q is None or q.currency != self.config.currency:
            self.guard.release(request.request_id)
            return
        prompt = prompt_tokens if prompt_tokens is not None and prompt_tokens > 0 else request.prompt_tokens
        cached = min(max(0, cached_tokens or 0), prompt)
        assert q.cache_read_price is not None
        cost = q.input_price * (prompt - cached) + q.cache_read_price * cached + q.output_price * max(
            0, output_tokens or 0)
        self.guard.record_spend(now, cost, request.request_id)

    def record_extra_spend(self, now: float, backend: str, prompt_tokens: int, output_tokens: int,
                           spend_id: str) -> None:
        """Spend no request reserved (a hedge's losing attempt on hosted ``backend``, ``spend_id`` naming it): it
        counts in the cap, fleet-wide with shared state."""
        q = self.market.quote(backend)
        if not self.is_hosted(backend) or q is None or q.currency != self.config.currency:
            return
        cost = q.input_price * max(0, prompt_tokens) + q.output_price * max(0, output_tokens)
        self.guard.record_spend(now, cost, spend_id)

    def observe_hosted_ttft(self, backend: str, ttft_s: float, at: float) -> None:
        """Another instance saw ``ttft_s`` from hosted ``backend`` at ``at`` (this instance's clock)."""
        if self.is_hosted(backend):
            self.market.learn(backend, at, ttft_s=ttft_s)

    # --- prices and times -----------------------------------------------------------------------
    def self_rate(self, backend: str | None) -> SelfHostedRate | None:
        return self._rates.get(backend or "", self._default_rate)

    def predicted_self_s(self, decision: Decision, request: RoutingRequest, state: RoutingState,
                         now: float) -> float:
        """The self-hosted pick's TTFT in real seconds: the cost model's prior seconds times the learned
        factor, plus its real-second part; for a short prompt (no prediction) the work still queued at ``now``
        plus its prefill."""
        load = state.load
        backend = decision.backend or ""
        factor = load.factor(backend) or 1.0
        if decision.predicted_ttft_s > 0:
            return factor * decision.predicted_ttft_s + decision.fixed_wait_s
        speed = self.self_policy.speed
        return factor * (load.work_s(backend, now) + speed.prefill_s(request.prompt_tokens))

    def hosted_quotes(self, request: RoutingRequest, hosted: Sequence[str], now: float) -> tuple[
            list[HostedQuote], dict[str, int]]:
        """Acceptable hosted routes for this request, cheapest first, and why the others are not."""
        cfg = self.config
        market = self.market
        rule = market.config.rule(request.app)
        out_tokens = Decimal(str(round(market.expected_output_tokens, 3)))
        prompt = max(1, request.prompt_tokens)
        quotes: list[HostedQuote] = []
        rejected: Counter[str] = Counter()
        for b in hosted:
            q = market.quote(b)
            why = rule.admits(q, b)
            if why is None and q is None:
                why = "unpriced"
            if why is None and q is not None and q.currency != cfg.currency:
                why = "currency"
            if why is None and q is not None and q.max_context is not None and request.prompt_tokens > q.max_context:
                why = "context_too_long"
            if why is None and market.health is not None and not market.health.available(b, now):
                why = "unhealthy"
            if why is not None or q is None:
                rejected[why or "unpriced"] += 1
                continue
            price = market.effective_price(b) * prompt + q.output_price * out_tokens  # type: ignore[operator]
            ttft = market.observed_ttft(b, now, cfg.hosted_ttft_quantile)
            if ttft is None:
                ttft = cfg.hosted_prior_ttft_s
            quotes.append(HostedQuote(b, price, ttft, q.currency))
        quotes.sort(key=lambda q: (q.price, q.ttft_s if q.ttft_s is not None else 0.0, q.backend))
        return quotes, dict(rejected)

    # --- the decision ---------------------------------------------------------------------------
    def _mode(self, ratio: float, now: float) -> bool:
        """Advance the hysteresis with this request's ratio; True when it should overflow."""
        cfg = self.config
        if ratio > cfg.enter_ratio:
            self.guard.note_over(now)
            self.overflowing = True
            return True
        last_over = self.guard.over_at(now)  # the fleet's: one instance entering the mode enters it for all
        if not self.overflowing and now - last_over < cfg.min_dwell_s:
            self.overflowing = True
        if not self.overflowing:
            return False
        if ratio <= cfg.leave_ratio:
            if now - last_over >= cfg.min_dwell_s:
                self.overflowing = False
            return False
        return True

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        cfg = self.config
        hosted = [b for b in candidates if b in self._hosted]
        own = [b for b in candidates if b not in self._hosted]
        target = cfg.target_for(request)
        quotes, rejected = self.hosted_quotes(request, hosted, now) if hosted else ([], {})
        why: dict[str, Any] = {"target_s": target}
        if rejected:
            why["rejected"] = rejected
        if quotes and cfg.max_routes_shown:
            why["routes"] = {q.backend: {"price": str(q.price), "ttft_s": _round(q.ttft_s)}
                             for q in quotes[: cfg.max_routes_shown]}
        if not own:
            return self._failover(request, quotes, target, why, now)
        sd = self.self_policy.select(request, own, state, now)
        predicted = self.predicted_self_s(sd, request, state, now)
        margin = self.errors.margin(now) if self.errors is not None else 1.0
        ratio = predicted * margin / target
        rate = self.self_rate(sd.backend)
        self_price = rate.price(request.prompt_tokens, self.market.expected_output_tokens) \
            if rate is not None and rate.currency == cfg.currency else None
        why.update({"self_backend": sd.backend, "self_reason": sd.reason, "predicted_s": _round(predicted),
                    "margin": _round(margin), "ratio": _round(ratio)})
        if self_price is not None:
            why["self_price"] = str(self_price)
        if not quotes:
            self._mode(ratio, now)
            return self._self(sd, "self_hosted", why, now)
        if cfg.sticky:
            pinned = self.market.sticky_backend(request, now)
            pin = next((q for q in quotes if q.backend == pinned), None)
            if (pin is not None and pin.meets(target) and (self_price is None or pin.price <= self_price)
                    and self.guard.admit(request.request_id, now, pin.price) is None):
                self._mode(ratio, now)
                return self._hosted_pick(request, pin, "session_hosted", why, now)
        if not self._mode(ratio, now):
            return self._self(sd, "self_hosted", why, now)
        meeting = [q for q in quotes if q.meets(target)]
        if not meeting:
            return self._self(sd, "no_hosted_meets_target", why, now)
        best = meeting[0]
        blocked = self.guard.admit(request.request_id, now, best.price)
        if blocked is not None:
            return self._self(sd, blocked, why, now)
        return self._hosted_pick(request, best, "overflow_latency", why, now)

    def _failover(self, request: RoutingRequest, quotes: list[HostedQuote], target: float, why: dict[str, Any],
                  now: float) -> Decision:
        """No replica left: the cheapest acceptable hosted route that meets the target, else the cheapest one,
        within the spend cap (the share cap does not apply: the replicas cannot take the rest). Nothing
        acceptable or affordable: ``no_acceptable_provider:<why>`` with no backend (the proxy sends none, so
        LiteLLM ``fallbacks`` decide), never a route the app's rules or the spend cap refused."""
        if not quotes:
            return self._refuse(request, "no_acceptable_route", why, now)
        ordered = [q for q in quotes if q.meets(target)] + [q for q in quotes if not q.meets(target)]
        for q in ordered:
            if self.guard.admit(request.request_id, now, q.price, share=False) is None:
                return self._hosted_pick(request, q, "self_hosted_unavailable", why, now)
        return self._refuse(request, "guard_spend", why, now)

    def _refuse(self, request: RoutingRequest, why_word: str, why: dict[str, Any], now: float) -> Decision:
        why["refused"] = why_word
        return self._done(Decision(None, self.name, f"no_acceptable_provider:{why_word}",
                                   prompt_tokens=request.prompt_tokens, request_id=request.request_id),
                          why, now, hosted=False)

    def _self(self, decision: Decision, reason: str, why: dict[str, Any], now: float) -> Decision:
        if self.errors is not None and isinstance(why.get("predicted_s"), float):
            self.errors.record(decision.request_id, why["predicted_s"])
        decision.policy = self.name
        decision.reason = reason
        return self._done(decision, why, now, hosted=False)

    def _hosted_pick(self, request: RoutingRequest, quote: HostedQuote, reason: str, why: dict[str, Any],
                     now: float) -> Decision:
        """The hosted route (the guard's ``admit`` already holds its price)."""
        why["hosted_price"] = str(quote.price)
        decision = Decision(quote.backend, self.name, reason, prompt_tokens=request.prompt_tokens,
                            request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens,
                            scores={q: float(v["price"]) for q, v in (why.get("routes") or {}).items()})
        return self._done(decision, why, now, hosted=True)

    def _done(self, decision: Decision, why: dict[str, Any], now: float, *, hosted: bool) -> Decision:
        why["mode"] = "overflow" if self.overflowing else "normal"
        self.guard.record_decision(now, hosted)
        decision.why = why
        self.reasons[decision.reason] += 1
        self.last_why = {"reason": decision.reason, "backend": decision.backend, **why}
        return decision

    # --- introspection --------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        """Mode, overflow share, hosted spend (per hour, window budget), reason counts, the last decision's why."""
        budget = self.guard.budget()
        guard = self.guard
        scope = guard.scope
        if guard.fleet is not None:
            scope = "fleet" if guard.fleet.spent() is not None else "local_share"
            guard.scope = scope
        local = guard.local_budget()
        return {"mode": "overflow" if self.overflowing else "normal",
                "guard_scope": scope, "guard_instances": guard.fleet.instances() if guard.fleet else 1,
                "hosted_budget_local_share": None if local is None or scope == "local" else str(local),
                "overflow_share": round(self.guard.share(now), 4),
                "hosted_spend_per_hour": str(self.guard.spend_per_hour(now)),
                "hosted_spend_window": str(self.guard.spent(now)),
                "hosted_budget_window": None if budget is None else str(budget),
                "hosted_spend_total": str(self.guard.total_spent),
                "currency": self.config.currency, "reasons": dict(self.reasons), "last": self.last_why,
                "self_hosted_rates": {b: {"input": str(r.input_price), "output": str(r.output_price),
                                          "currency": r.currency} for b, r in sorted(self._rates.items())}}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
