"""``marketplace``: rank hosted providers by cache-adjusted price, speed, uptime tier and health.

Filters: per-app allow/deny lists, a hard max price (USD per million tokens, on list prices), max context,
breaker state. Provider stickiness comes first when it pays: a session (or prefix) stays on the provider
that last served it successfully (idle TTL 10 min; only where cache reads are cheaper than input; errors
never overwrite it; it yields to health). Otherwise the lowest score wins::

    score = w_price·ln(price / cheapest) + w_ttft·ln(ttft_p50 / fastest) + w_tput·ln(best_tput / tput)
            + w_tier·tier_penalty + w_health·health_penalty   (+ unpriced_penalty without a quote)

with ``price = (input·(1−hit) + cache_read·hit)·prompt_tokens + output·expected_output`` and ``hit`` the
backend's learned (EWMA) share of cached prompt tokens. An app's ``order`` list ranks before the score.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kvroute.policies.base import Policy, RoutingState
from kvroute.policies.decision import Decision
from kvroute.policies.errors import ConfigError
from kvroute.policies.health import HealthBoard
from kvroute.policies.lifecycle import FleetView, RequestOutcome
from kvroute.policies.rates import ProviderQuote, to_price
from kvroute.policies.request import RoutingRequest
from kvroute.policies.rolling import RollingLatency, percentile

MILLION = Decimal(1_000_000)


@dataclass(frozen=True, slots=True)
class AppRule:
    """Per-app routing rule: providers/backends allowed, denied, preferred order; price caps per Mtok."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    order: tuple[str, ...] = ()
    max_prompt_price: Decimal | None = None
    max_completion_price: Decimal | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> AppRule:
        if not isinstance(raw, Mapping):
            raise ConfigError(where, "must be a mapping with allow/deny/order/max_price")
        unknown = set(raw) - {"allow", "deny", "order", "max_price"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown key (known: allow, deny, max_price, order)")
        lists: dict[str, tuple[str, ...]] = {}
        for key in ("allow", "deny", "order"):
            value = raw.get(key, ())
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise ConfigError(f"{where}.{key}", "must be a list of provider or backend names")
            lists[key] = tuple(str(v) for v in value)
        caps = raw.get("max_price") or {}
        if not isinstance(caps, Mapping) or set(caps) - {"prompt", "completion"}:
            raise ConfigError(f"{where}.max_price", "must be a mapping with prompt and/or completion (USD per Mtok)")
        prompt = to_price(caps["prompt"], f"{where}.max_price.prompt") if "prompt" in caps else None
        completion = to_price(caps["completion"], f"{where}.max_price.completion") if "completion" in caps else None
        return cls(lists["allow"], lists["deny"], lists["order"], prompt, completion)

    @staticmethod
    def _names(quote: ProviderQuote | None, backend: str) -> set[str]:
        return {backend} if quote is None else {backend, quote.provider}

    def admits(self, quote: ProviderQuote | None, backend: str) -> str | None:
        """None when the backend is acceptable, else the reason it is not."""
        names = self._names(quote, backend)
        if self.allow and not names & set(self.allow):
            return "not_allowed"
        if names & set(self.deny):
            return "denied"
        if self.max_prompt_price is not None or self.max_completion_price is not None:
            if quote is None:
                return "unpriced"
            if self.max_prompt_price is not None and quote.input_price * MILLION > self.max_prompt_price:
                return "over_max_price"
            if self.max_completion_price is not None and quote.output_price * MILLION > self.max_completion_price:
                return "over_max_price"
        return None

    def rank(self, quote: ProviderQuote | None, backend: str) -> int:
        """Position in ``order`` (backend id or provider name); unlisted backends come after."""
        names = self._names(quote, backend)
        for i, name in enumerate(self.order):
            if name in names:
                return i
        return len(self.order)


DEFAULT_TIERS: Mapping[str, float] = {"premium": 0.0, "standard": 0.05, "best_effort": 0.25}


@dataclass(frozen=True, slots=True)
class MarketplaceConfig:
    """Knobs of the ranking, learning and stickiness; ``apps`` maps app name (or ``*``) to an ``AppRule``."""

    price_weight: float = 1.0
    ttft_weight: float = 0.5
    throughput_weight: float = 0.25
    tier_weight: float = 1.0
    health_weight: float = 2.0
    unpriced_penalty: float = 0.5
    hit_alpha: float = 0.2
    prior_hit: float = 0.0
    expected_output_tokens: float = 256.0
    output_alpha: float = 0.05
    window_s: float = 300.0
    max_samples: int = 256
    sticky_ttl_s: float = 600.0
    sticky_prefix_tokens: int = 1024
    sticky_max_entries: int = 100_000
    sticky_drop_penalty: float = 1.0
    sticky_needs_hit_without_session: bool = True
    eval_interval_s: float = 1.0
    tiers: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    apps: Mapping[str, Any] = field(default_factory=dict)
    quotes: Mapping[str, Any] = field(default_factory=dict)
    max_scores: int = 8
    _rules: Mapping[str, AppRule] = field(default_factory=dict, init=False, repr=False, compare=False)
    _quotes: tuple[ProviderQuote, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("price_weight", "ttft_weight", "throughput_weight", "tier_weight", "health_weight",
                     "unpriced_penalty", "expected_output_tokens", "eval_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("hit_alpha", "output_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if not 0 <= self.prior_hit <= 1:
            raise ValueError("prior_hit must be in [0, 1]")
        for name in ("window_s", "sticky_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_samples", "sticky_prefix_tokens", "sticky_max_entries", "max_scores"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        if not isinstance(self.tiers, Mapping) or any(not 0 <= float(v) <= 10 for v in self.tiers.values()):
            raise ValueError("tiers must map tier names to penalties in [0, 10]")
        if not isinstance(self.apps, Mapping):
            raise ValueError("apps must map app names to rules")
        if not isinstance(self.quotes, Mapping):
            raise ValueError("quotes must map backend ids to rate cards")
        object.__setattr__(self, "_rules", {str(a): AppRule.parse(r, f"apps.{a}") for a, r in self.apps.items()})
        parsed = tuple(ProviderQuote.parse(str(b), raw, f"quotes.{b}") for b, raw in self.quotes.items())
        for q in parsed:
            if q.uptime_tier not in self.tiers:
                raise ConfigError(f"quotes.{q.backend}.uptime_tier", f"unknown tier {q.uptime_tier!r}")
        object.__setattr__(self, "_quotes", parsed)

    def rule(self, app: str | None) -> AppRule:
        """The app's rule, else the ``*`` rule, else no restriction."""
        return self._rules.get(app or "", self._rules.get("*", _NO_RULE))

    def parsed_quotes(self) -> list[ProviderQuote]:
        """The rate cards given in the ``quotes`` knob, validated."""
        return list(self._quotes)


_NO_RULE = AppRule()


class _Stats:
    """What the marketplace has learned about one backend."""

    __slots__ = ("hit", "hits_seen", "throughput", "ttft")

    def __init__(self, cfg: MarketplaceConfig) -> None:
        self.hit = cfg.prior_hit
        self.hits_seen = 0
        self.ttft = RollingLatency(cfg.window_s, cfg.window_s * 12, cfg.max_samples)
        self.throughput = RollingLatency(cfg.window_s, cfg.window_s * 12, cfg.max_samples)


@dataclass(slots=True)
class _Sticky:
    backend: str
    provider: str
    at: float


class Marketplace(Policy):
    """The ``marketplace`` policy; feed it quotes (``set_quotes`` or ``bind``), outcomes (``observe``) and health."""

    name = "marketplace"

    def __init__(self, config: MarketplaceConfig | None = None, *, health: HealthBoard | None = None) -> None:
        self.config = config or MarketplaceConfig()
        self.health = health
        self._quotes: dict[str, ProviderQuote] = {}
        self._stats: dict[str, _Stats] = {}
        self._sticky: OrderedDict[tuple[str, str, str], _Sticky] = OrderedDict()
        self._output_tokens = self.config.expected_output_tokens
        self._speed_cache: dict[str, tuple[float, float | None, float | None]] = {}
        if self.config.parsed_quotes():
            self.set_quotes(self.config.parsed_quotes())

    # --- inputs ---------------------------------------------------------------------------------
    def bind(self, fleet: FleetView) -> None:
        """Take the fleet's breakers (unless it has its own) and its rate cards (quotes already set win)."""
        if self.health is None and fleet.health is not None:
            self.health = fleet.health
        if fleet.quotes:
            self.add_quotes(fleet.quotes)

    def observe(self, request: RoutingRequest, outcome: RequestOutcome) -> None:
        """A success teaches it (``record_success``); a failure never moves a pin."""
        if outcome.ok and outcome.backend is not None:
            self.record_success(request, outcome.backend, outcome.at, cached_tokens=outcome.cached_tokens,
                                ttft_s=outcome.ttft_s, output_tokens=outcome.output_tokens,
                                duration_s=outcome.duration_s, prompt_tokens=outcome.prompt_tokens)

    def set_quotes(self, quotes: Iterable[ProviderQuote]) -> None:
        """Replace the rate cards; a tier not in ``config.tiers`` raises ``ConfigError``."""
        self._quotes = {}
        self.add_quotes(quotes)

    def add_quotes(self, quotes: Iterable[ProviderQuote]) -> None:
        """Add rate cards for backends not priced yet; quotes already set (config) win."""
        for q in quotes:
            if q.backend in self._quotes:
                continue
            if q.uptime_tier not in self.config.tiers:
                raise ConfigError(f"quotes.{q.backend}.uptime_tier",
                                  f"unknown tier {q.uptime_tier!r} (known: {', '.join(sorted(self.config.tiers))})")
            self._quotes[q.backend] = q

    def quote(self, backend: str) -> ProviderQuote | None:
        return self._quotes.get(backend)

    def _stat(self, backend: str) -> _Stats:
        s = self._stats.get(backend)
        if s is None:
            s = self._stats[backend] = _Stats(self.config)
        return s

    def learn(self, backend: str, now: float, *, prompt_tokens: int | None = None,
                cached_tokens: int | None = None, ttft_s: float | None = None,
                output_tokens: int | None = None, duration_s: float | None = None) -> None:
        """Learn from one successful response: cache hit share (EWMA), TTFT and throughput windows."""
        cfg = self.config
        s = self._stat(backend)
        if prompt_tokens and prompt_tokens > 0 and cached_tokens is not None:
            share = min(1.0, max(0.0, cached_tokens / prompt_tokens))
            s.hit += cfg.hit_alpha * (share - s.hit)
            s.hits_seen += 1
        if ttft_s is not None:
            s.ttft.add(now, float(ttft_s))
        if output_tokens and output_tokens > 0:
            self._output_tokens += cfg.output_alpha * (output_tokens - self._output_tokens)
            if duration_s and duration_s > 0:
                s.throughput.add(now, output_tokens / duration_s)
        self._speed_cache.pop(backend, None)

    def expected_hit(self, backend: str) -> float:
        s = self._stats.get(backend)
        return self.config.prior_hit if s is None else s.hit

    @property
    def expected_output_tokens(self) -> float:
        """Completion tokens expected per request (learned, EWMA over successes)."""
        return self._output_tokens

    def observed_ttft(self, backend: str, now: float, q: float = 0.5) -> float | None:
        """The ``q`` quantile of the backend's TTFT samples in the recent window (None without samples)."""
        s = self._stats.get(backend)
        samples = s.ttft.recent(now) if s is not None else []
        return percentile(samples, q) if samples else None

    def effective_price(self, backend: str) -> Decimal | None:
        """Cache-adjusted price per prompt token (None for a backend without a quote)."""
        q = self._quotes.get(backend)
        return None if q is None else q.effective_input_price(self.expected_hit(backend))

    # --- stickiness -----------------------------------------------------------------------------
    def sticky_key(self, request: RoutingRequest) -> tuple[str, str, str] | None:
        """(app, model, session key or the key of the first ``sticky_prefix_tokens`` tokens)."""
        if request.session_key:
            conv = "s:" + request.session_key
        else:
            key = request.prefix_key(self.config.sticky_prefix_tokens)
            if key is None:
                return None
            conv = f"p:{key:016x}"
        return (request.app or "", request.model, conv)

    def record_success(self, request: RoutingRequest, backend: str, now: float, *,
                       cached_tokens: int | None = None, ttft_s: float | None = None,
                       output_tokens: int | None = None, duration_s: float | None = None,
                       prompt_tokens: int | None = None) -> None:
        """A response came back from ``backend``: learn from it and (re)pin the conversation there.

        ``prompt_tokens``: the response's own count (default: the request's estimate). Failures are never
        reported here, so an error never moves a pin; the next success re-pins."""
        prompt = prompt_tokens if prompt_tokens is not None and prompt_tokens > 0 else request.prompt_tokens
        self.learn(backend, now, prompt_tokens=prompt, cached_tokens=cached_tokens,
                     ttft_s=ttft_s, output_tokens=output_tokens, duration_s=duration_s)
        key = self.sticky_key(request)
        quote = self._quotes.get(backend)
        if key is None or quote is None or not quote.caching_pays:
            return
        if (not request.session_key and self.config.sticky_needs_hit_without_session
                and not (cached_tokens and cached_tokens > 0) and key not in self._sticky):
            return  # OpenRouter: without a session id, stickiness starts after an observed cache hit
        self._sticky[key] = _Sticky(backend, quote.provider, now)
        self._sticky.move_to_end(key)
        while len(self._sticky) > self.config.sticky_max_entries:
            self._sticky.popitem(last=False)

    def _live_sticky(self, request: RoutingRequest, now: float) -> _Sticky | None:
        """The request's sticky entry unless it idled past ``sticky_ttl_s`` (then it is dropped)."""
        key = self.sticky_key(request)
        entry = self._sticky.get(key) if key is not None else None
        if entry is not None and now - entry.at > self.config.sticky_ttl_s:
            del self._sticky[key]
            return None
        return entry

    def sticky_backend(self, request: RoutingRequest, now: float) -> str | None:
        entry = self._live_sticky(request, now)
        return entry.backend if entry is not None else None

    def _sticky_pick(self, request: RoutingRequest, eligible: Sequence[str], now: float) -> str | None:
        entry = self._live_sticky(request, now)
        if entry is None:
            return None
        same = [entry.backend] if entry.backend in eligible else []
        if not same:  # the endpoint is gone: another endpoint of the same provider keeps its cache domain
            same = [b for b in eligible if (q := self._quotes.get(b)) is not None and q.provider == entry.provider]
        ok = []
        for b in same:
            q = self._quotes.get(b)
            if q is None or not q.caching_pays:
                continue
            if self.health is not None and self.health.penalty(b, now) >= self.config.sticky_drop_penalty:
                continue
            ok.append(b)
        if not ok:
            return None
        return entry.backend if entry.backend in ok else ok[0]

    # --- ranking --------------------------------------------------------------------------------
    def _speed(self, backend: str, now: float) -> tuple[float | None, float | None]:
        cached = self._speed_cache.get(backend)
        if cached is not None and cached[0] <= now < cached[0] + self.config.eval_interval_s:
            return cached[1], cached[2]
        s = self._stats.get(backend)
        ttft = tput = None
        if s is not None:
            t = s.ttft.recent(now)
            ttft = percentile(t, 0.5) if t else None
            r = s.throughput.recent(now)
            tput = percentile(r, 0.5) if r else None
        self._speed_cache[backend] = (now, ttft, tput)
        return ttft, tput

    def scores(self, request: RoutingRequest, backends: Sequence[str], now: float) -> dict[str, float]:
        """Score per backend (lower is better); floats, not money."""
        cfg = self.config
        prompt = max(1, request.prompt_tokens)
        out = Decimal(str(round(self._output_tokens, 3)))
        prices: dict[str, float | None] = {}
        for b in backends:
            q = self._quotes.get(b)
            if q is None:
                prices[b] = None
            else:
                prices[b] = float(self.effective_price(b) * prompt + q.output_price * out)  # type: ignore[operator]
        known = [p for p in prices.values() if p is not None]
        cheapest = min(known) if known else None
        dearest = max(known) if known else None
        speeds = {b: self._speed(b, now) for b in backends}
        ttfts = [t for t, _ in speeds.values() if t is not None and t > 0]
        tputs = [r for _, r in speeds.values() if r is not None and r > 0]
        fastest = min(ttfts) if ttfts else None
        best_tput = max(tputs) if tputs else None
        result: dict[str, float] = {}
        for b in backends:
            score = 0.0
            price = prices[b] if prices[b] is not None else dearest  # an unpriced backend counts as the dearest
            if price is not None and cheapest is not None:
                score += cfg.price_weight * _log_ratio(price, cheapest)
            ttft, tput = speeds[b]
            if ttft is not None and fastest is not None:
                score += cfg.ttft_weight * _log_ratio(ttft, fastest)
            if tput is not None and best_tput is not None:
                score += cfg.throughput_weight * _log_ratio(best_tput, tput)
            q = self._quotes.get(b)
            if q is not None:
                score += cfg.tier_weight * float(cfg.tiers.get(q.uptime_tier, 0.0))
            else:
                score += cfg.unpriced_penalty
            if self.health is not None:
                score += cfg.health_weight * self.health.penalty(b, now)
            result[b] = score
        return result

    def select(self, request: RoutingRequest, candidates: Sequence[str], state: RoutingState,
               now: float) -> Decision:
        """The best route the app's rules admit whose breaker is closed; with every admitted route's breaker open,
        the one whose cooldown ends first (``breakers_open``: a failed request is certain, a try may succeed)."""
        rule = self.config.rule(request.app)
        eligible: list[str] = []
        open_only: list[str] = []  # admitted by every rule but the breaker
        rejected: dict[str, int] = {}
        for b in candidates:
            q = self._quotes.get(b)
            why = rule.admits(q, b)
            if why is None and q is not None and q.max_context is not None and request.prompt_tokens > q.max_context:
                why = "context_too_long"
            if why is None and self.health is not None and not self.health.available(b, now):
                why = "unhealthy"
                open_only.append(b)
            if why is None:
                eligible.append(b)
            else:
                rejected[why] = rejected.get(why, 0) + 1
        if not eligible and open_only and self.health is not None:  # every route open: try the one back soonest
            backend, _ = self.health.soonest(open_only, now)  # rather than fail the request for certain
            return Decision(backend, self.name, "breakers_open", prompt_tokens=request.prompt_tokens,
                            request_id=request.request_id, predicted_prefill_tokens=request.prompt_tokens)
        if not eligible:
            reason = max(rejected, key=lambda k: rejected[k]) if rejected else "no_candidates"
            return Decision(None, self.name, f"no_acceptable_provider:{reason}", prompt_tokens=request.prompt_tokens,
                            request_id=request.request_id)
        sticky = None if rule.order else self._sticky_pick(request, eligible, now)
        scores = self.scores(request, eligible, now)
        if sticky is not None:
            backend, reason = sticky, "provider_sticky"
        else:
            down = self.config.sticky_drop_penalty

            def key(b: str) -> tuple[bool, int, float, str]:
                fallback_only = self.health is not None and self.health.penalty(b, now) >= down
                return (fallback_only, rule.rank(self._quotes.get(b), b), scores[b], b)

            backend = min(eligible, key=key)
            reason = "app_order" if rule.order and rule.rank(self._quotes.get(backend), backend) < len(rule.order) \
                else "best_score"
        shown = scores if len(scores) <= self.config.max_scores else dict(
            sorted(scores.items(), key=lambda kv: kv[1])[: self.config.max_scores])
        return Decision(backend, self.name, reason, prompt_tokens=request.prompt_tokens, scores=shown,
                        skipped="app_order" if rule.order else None, request_id=request.request_id,
                        predicted_prefill_tokens=request.prompt_tokens)


def _log_ratio(value: float, best: float) -> float:
    if best <= 0 or value <= 0:
        return 0.0 if value <= best else math.log1p(value - best)
    return max(0.0, math.log(value / best))
