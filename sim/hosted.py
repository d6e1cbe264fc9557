"""Simulated hosted providers: a TTFT distribution, output speed, a price with a cache-read discount, rate
limits and outages.

A request sent to a ``HostedBackend`` at ``now``:

- inside an outage window: fails after ``error_latency_s`` (a 5xx);
- over ``rpm`` requests or ``tpm`` tokens (prompt + output) in the last 60 s: a 429 after
  ``reject_latency_s`` with Retry-After = seconds until the window's oldest entry leaves it;
- else its first token comes after a lognormal TTFT (``ttft_p50_s``/``ttft_p90_s``, plus
  ``uncached / prefill_tok_s`` when set) and the rest at ``output_tok_s``.

Cache-hit model (OpenAI/DeepSeek-style implicit caching, as OpenRouter documents it): the provider keeps the
prompt blocks of requests it served for ``cache_ttl_s`` after their last use; a prompt's leading run of such
blocks is read from cache with probability ``cache_hit_prob`` (the provider's own replica routing) when it is at
least ``cache_min_tokens`` long. Cached tokens cost ``cached_per_mtok``; prices are Decimal per million tokens.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from statistics import NormalDist
from typing import Any

from kvroute.billing.pricing import CostRate, token_cost
from kvroute.policies.errors import ConfigError
from kvroute.policies.marketplace import MILLION
from kvroute.policies.rates import ProviderQuote, to_price

_Z90 = NormalDist().inv_cdf(0.9)
_EPOCH_RATE = "1970-01-01"


@dataclass(frozen=True, slots=True)
class HostedSpec:
    """One hosted route as the simulator sees it (prices per million tokens, ``Decimal``)."""

    name: str
    ttft_p50_s: float
    ttft_p90_s: float
    output_tok_s: float
    input_per_mtok: Decimal
    output_per_mtok: Decimal
    cached_per_mtok: Decimal | None = None
    currency: str = "USD"
    prefill_tok_s: float | None = None
    cache_min_tokens: int = 1024
    cache_ttl_s: float = 300.0
    cache_hit_prob: float = 0.9
    rpm: int | None = None
    tpm: int | None = None
    outages: tuple[tuple[float, float], ...] = ()
    error_latency_s: float = 0.3
    reject_latency_s: float = 0.05
    uptime_tier: str = "standard"
    #: a heavy tail: this share of requests waits a Pareto delay (scale, shape, cap) more for its first token
    stall_share: float = 0.0
    stall_scale_s: float = 0.4
    stall_alpha: float = 1.2
    stall_max_s: float = 5.0

    def __post_init__(self) -> None:
        where = f"hosted.{self.name}"
        if not 0 <= self.stall_share <= 1 or not 0 < self.stall_scale_s <= self.stall_max_s or self.stall_alpha <= 0:
            raise ConfigError(f"{where}.stall", "needs 0 <= share <= 1, 0 < scale_s <= max_s and alpha > 0")
        if not self.name:
            raise ConfigError("hosted", "every route needs a name")
        if not 0 < self.ttft_p50_s <= self.ttft_p90_s or not math.isfinite(self.ttft_p90_s):
            raise ConfigError(f"{where}.ttft_p90_s", "need 0 < ttft_p50_s <= ttft_p90_s (seconds)")
        if not self.output_tok_s > 0:
            raise ConfigError(f"{where}.output_tok_s", "must be positive")
        if self.prefill_tok_s is not None and not self.prefill_tok_s > 0:
            raise ConfigError(f"{where}.prefill_tok_s", "must be positive")
        for name in ("input_per_mtok", "output_per_mtok", "cached_per_mtok"):
            value = getattr(self, name)
            if value is None:
                value = self.input_per_mtok
            object.__setattr__(self, name, to_price(value, f"{where}.{name}"))
        if not 0 <= self.cache_hit_prob <= 1:
            raise ConfigError(f"{where}.cache_hit_prob", "must be in [0, 1]")
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{where}.{name}", "must be a positive integer (per minute) or absent")
        for i, window in enumerate(self.outages):
            if len(window) != 2 or not 0 <= window[0] < window[1]:
                raise ConfigError(f"{where}.outages[{i}]", "must be [start_s, end_s] with start < end")
        for name in ("cache_ttl_s", "error_latency_s", "reject_latency_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{where}.{name}", "must be >= 0")

    @classmethod
    def parse(cls, name: str, raw: Any) -> HostedSpec:
        """From a YAML mapping (``price: {input, cached, output}`` per Mtok; ``ttft: {p50, p90}``; limits)."""
        where = f"hosted.{name}"
        if not isinstance(raw, Mapping):
            raise ConfigError(where, "must be a mapping (price, ttft, output_tok_s, rpm, tpm, outages, ...)")
        known = {"price", "ttft", "output_tok_s", "prefill_tok_s", "currency", "cache_min_tokens", "cache_ttl_s",
                 "cache_hit_prob", "rpm", "tpm", "outages", "error_latency_s", "uptime_tier", "stall"}
        for key in raw:
            if key not in known:
                raise ConfigError(f"{where}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
        for key in ("price", "ttft", "output_tok_s"):
            if key not in raw:
                raise ConfigError(f"{where}.{key}", "required")
        price, ttft = raw["price"], raw["ttft"]
        if not isinstance(price, Mapping) or not {"input", "output"} <= set(price) \
                or set(price) - {"input", "cached", "output"}:
            raise ConfigError(f"{where}.price", "must be {input, output[, cached]} per million tokens")
        if not isinstance(ttft, Mapping) or set(ttft) != {"p50", "p90"}:
            raise ConfigError(f"{where}.ttft", "must be {p50, p90} in seconds")
        fields: dict[str, Any] = {k: raw[k] for k in known - {"price", "ttft", "outages", "stall"} if k in raw}
        stall = raw.get("stall") or {}
        if not isinstance(stall, Mapping) or set(stall) - {"share", "scale_s", "alpha", "max_s"}:
            raise ConfigError(f"{where}.stall", "must be {share, scale_s, alpha, max_s} (share required)")
        fields.update({f"stall_{k}": float(v) for k, v in stall.items()})
        try:
            outages = tuple((float(a), float(b)) for a, b in raw.get("outages", ()))
            spec = cls(name=name, ttft_p50_s=float(ttft["p50"]), ttft_p90_s=float(ttft["p90"]),
                       input_per_mtok=price["input"], output_per_mtok=price["output"],
                       cached_per_mtok=price.get("cached"), outages=outages,
                       **{k: (float(v) if k in ("output_tok_s", "prefill_tok_s", "cache_ttl_s", "cache_hit_prob",
                                                "error_latency_s") else v) for k, v in fields.items()})
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(where, f"bad value: {exc}") from None
        return spec

    def quote(self) -> ProviderQuote:
        """The marketplace rate card (per-token prices) the routing policies rank by."""
        assert self.cached_per_mtok is not None
        return ProviderQuote(self.name, self.name, "sim", self.input_per_mtok / MILLION,
                             self.output_per_mtok / MILLION, cache_read_price=self.cached_per_mtok / MILLION,
                             uptime_tier=self.uptime_tier, currency=self.currency)

    def cost_rate(self) -> CostRate:
        """The ledger's rate card for this route (what ``token_cost`` charges)."""
        from datetime import UTC, datetime
        assert self.cached_per_mtok is not None
        return CostRate(self.name, datetime(1970, 1, 1, tzinfo=UTC), self.currency,
                        input_per_mtok=self.input_per_mtok, cache_read_per_mtok=self.cached_per_mtok,
                        output_per_mtok=self.output_per_mtok)

    @property
    def ttft_sigma(self) -> float:
        return math.log(self.ttft_p90_s / self.ttft_p50_s) / _Z90


@dataclass(slots=True)
class HostedAttempt:
    """What one attempt came to: ``ok`` (first token / done times, cached tokens, cost), ``rate_limited``
    (429, ``retry_after_s``) or ``error`` (5xx); ``answered_at`` is when the client learns of a failure."""

    kind: str
    answered_at: float
    first_token_at: float = math.nan
    done_at: float = math.nan
    cached_tokens: int = 0
    cost: Decimal = Decimal(0)
    retry_after_s: float | None = None


class HostedBackend:
    """Runtime state of one hosted route: its 60-second rate window and its prefix cache."""

    def __init__(self, spec: HostedSpec, block_tokens: int, seed: int = 0) -> None:
        self.spec = spec
        self.block_tokens = block_tokens
        self.rate = spec.cost_rate()
        self.rng = random.Random(f"{spec.name}:{seed}")
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        self._cache: OrderedDict[int, float] = OrderedDict()
        self.served = self.rate_limited = self.errors = 0

    def _in_outage(self, now: float) -> bool:
        return any(a <= now < b for a, b in self.spec.outages)

    def _trim(self, now: float) -> None:
        w = self._window
        while w and w[0][0] <= now - 60.0:
            self._window_tokens -= w.popleft()[1]
        c, ttl = self._cache, self.spec.cache_ttl_s
        while c:
            key, at = next(iter(c.items()))
            if at >= now - ttl:
                break
            del c[key]

    def _cached_tokens(self, keys: Sequence[int], prompt: int) -> int:
        n = 0
        for k in keys:
            if k not in self._cache:
                break
            n += 1
        tokens = min(prompt - 1, n * self.block_tokens)
        if tokens < self.spec.cache_min_tokens or self.rng.random() >= self.spec.cache_hit_prob:
            return 0
        return max(0, tokens)

    def attempt(self, now: float, prompt: int, output: int, keys: Sequence[int]) -> HostedAttempt:
        """Send one request now (see the module docstring); a success is counted in the rate window."""
        spec = self.spec
        self._trim(now)
        if self._in_outage(now):
            self.errors += 1
            return HostedAttempt("error", now + spec.error_latency_s)
        tokens = prompt + output
        over = (spec.rpm is not None and len(self._window) >= spec.rpm) or (
            spec.tpm is not None and self._window and self._window_tokens + tokens > spec.tpm)
        if over:
            self.rate_limited += 1
            retry = max(0.001, self._window[0][0] + 60.0 - now)
            return HostedAttempt("rate_limited", now + spec.reject_latency_s, retry_after_s=retry)
        self._window.append((now, tokens))
        self._window_tokens += tokens
        cached = self._cached_tokens(keys, prompt)
        ttft = self.rng.lognormvariate(math.log(spec.ttft_p50_s), spec.ttft_sigma)
        if spec.stall_share > 0 and self.rng.random() < spec.stall_share:  # no draw at all without a tail
            ttft += min(spec.stall_max_s, spec.stall_scale_s * (1.0 - self.rng.random()) ** (-1.0 / spec.stall_alpha))
        if spec.prefill_tok_s is not None:
            ttft += (prompt - cached) / spec.prefill_tok_s
        first = now + ttft
        done = first + max(0, output - 1) / spec.output_tok_s
        for k in keys:
            self._cache[k] = now
            self._cache.move_to_end(k)
        self.served += 1
        cost = token_cost(self.rate, input_uncached=prompt - cached, cache_read=cached, output=output)
        return HostedAttempt("ok", first, first, done, cached, cost)


@dataclass(frozen=True, slots=True)
class HostedPlan:
    """A ``--hosted`` file: the routes, the latency target, the hybrid policy's knobs, the replicas' queue cap
    for the fallback-on-error strategy."""

    routes: tuple[HostedSpec, ...]
    ttft_target_s: float = 2.0
    hybrid: Mapping[str, Any] | None = None
    queue_limit: int = 8
    hedge: Mapping[str, Any] | None = None  # a group's ``hedge:`` block, for ``simulate --hedge``

def read_hosted(data: Any) -> HostedPlan:
    """Validate a ``--hosted`` document::

        ttft_target_s: 2.0
        queue_limit: 8                          # fallback-on-error: a replica answers 429 past this queue
        hybrid: {enter_ratio: 0.6}              # knobs of the hybrid policy (default: its defaults)
        routes:
          fast: {price: {input: "0.40", cached: "0.10", output: "1.20"}, ttft: {p50: 0.35, p90: 0.8},
                 output_tok_s: 80, rpm: 1200, tpm: 2000000, outages: [[900, 960]],
                 stall: {share: 0.02, scale_s: 0.4, alpha: 1.2, max_s: 5}}   # a heavy first-token tail
        hedge: {budget: "5%"}                   # simulate --hedge: the hosted streams with and without it
    """
    if not isinstance(data, Mapping):
        raise ConfigError("hosted", "must be a mapping with routes (and ttft_target_s, hybrid, queue_limit)")
    unknown = set(data) - {"routes", "ttft_target_s", "hybrid", "queue_limit", "hedge"}
    if unknown:
        raise ConfigError(str(sorted(unknown)[0]),
                          "unknown key (known: hedge, hybrid, queue_limit, routes, ttft_target_s)")
    routes = data.get("routes")
    if not isinstance(routes, Mapping) or not routes:
        raise ConfigError("routes", "must map at least one route name to its price, ttft and limits")
    target = data.get("ttft_target_s", 2.0)
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target < math.inf:
        raise ConfigError("ttft_target_s", f"must be a positive number of seconds, got {target!r}")
    knobs = data.get("hybrid")
    if knobs is not None and not isinstance(knobs, Mapping):
        raise ConfigError("hybrid", "must be a mapping of the hybrid policy's knobs")
    limit = data.get("queue_limit", 8)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError("queue_limit", f"must be an integer >= 1, got {limit!r}")
    specs = tuple(HostedSpec.parse(str(n), raw) for n, raw in routes.items())
    hedge = data.get("hedge")
    if hedge is not None and not isinstance(hedge, Mapping):
        raise ConfigError("hedge", "must be a group's hedge block, e.g. {budget: \"5%\"}")
    return HostedPlan(specs, float(target), dict(knobs) if knobs else None, limit, dict(hedge) if hedge else None)


def load_hosted(path: str | Any) -> HostedPlan:
    """Read a ``--hosted`` YAML file; errors name the file and the key."""
    from pathlib import Path

    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), f"not valid YAML: {exc}") from None
    try:
        return read_hosted(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc.key}", exc.message) from None
