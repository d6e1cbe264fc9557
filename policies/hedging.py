"""Hedged requests on hosted routes: when to send a second request, where, and how many (pure, no I/O).

A streamed request whose first token has not arrived after its route's own observed TTFT quantile for its
prompt-size class (``quantile``, clamped to ``[min_delay_s, max_delay_s]``; no hedge before ``min_samples``
answers of that class) gets a second request on another hosted route of the same model; the first to produce
content answers, the other is closed. ``HedgeBudget`` bounds hedges to ``budget`` of the group's requests plus
``floor``; ``Hedger.paused`` stops hedging while more than ``pause_share`` of the routes have a request waiting past
their own delay (a partial outage must not double the load). The plugin and the simulator drive the same object.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.policies.errors import ConfigError
from kvroute.policies.rolling import percentile

#: Prompt-size classes (tokens): a request's class is the first bound its prompt fits under.
SIZE_CLASSES = (512, 2048, 8192, 32768)
HEDGE_KEYS = ("budget", "quantile", "min_delay_ms", "max_delay_ms", "min_samples", "floor", "pause_share",
              "window_s")


@dataclass(frozen=True, slots=True)
class HedgeConfig:
    """A group's ``hedge:`` block (off unless set). ``budget``: the share of requests that may be hedged."""

    budget: float = 0.05
    quantile: float = 0.95
    min_delay_s: float = 0.2
    max_delay_s: float = 5.0
    min_samples: int = 20
    floor: float = 2.0
    pause_share: float = 0.5
    window_s: float = 600.0

    @classmethod
    def parse(cls, raw: Any, where: str = "hedge") -> HedgeConfig:
        """``{budget: "5%", quantile: 0.95, min_delay_ms: 200, ...}``; a bad key or value raises ``ConfigError``."""
        if raw is True:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(where, f"expected a mapping such as {{budget: \"5%\"}}, got {type(raw).__name__}")
        unknown = set(raw) - set(HEDGE_KEYS)
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", f"unknown key (known: {', '.join(HEDGE_KEYS)})")
        d = cls()
        budget = _share(raw.get("budget", d.budget), f"{where}.budget")
        quantile = _number(raw.get("quantile", d.quantile), f"{where}.quantile", 0.5, 0.999)
        lo = _number(raw.get("min_delay_ms", d.min_delay_s * 1000), f"{where}.min_delay_ms", 0, 600_000) / 1000
        hi = _number(raw.get("max_delay_ms", d.max_delay_s * 1000), f"{where}.max_delay_ms", 0, 600_000) / 1000
        if hi < lo:
            raise ConfigError(f"{where}.max_delay_ms", "is below min_delay_ms")
        samples = _number(raw.get("min_samples", d.min_samples), f"{where}.min_samples", 1, 100_000)
        if samples != int(samples):
            raise ConfigError(f"{where}.min_samples", f"must be a whole number, got {samples}")
        return cls(budget, quantile, lo, hi, int(samples),
                   _number(raw.get("floor", d.floor), f"{where}.floor", 0, 1000),
                   _share(raw.get("pause_share", d.pause_share), f"{where}.pause_share"),
                   _number(raw.get("window_s", d.window_s), f"{where}.window_s", 1, 86_400))


def _number(value: Any, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(where, f"expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(where, f"must be between {lo:g} and {hi:g}, got {value!r}")
    return float(value)


def _share(value: Any, where: str) -> float:
    """``"5%"`` or the fraction ``0.05`` (a bare number must be below 1)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ConfigError(where, f"expected a percent such as \"5%\", got {value!r}") from None
    return _number(value, where, 0.0, 0.999)


def size_class(prompt_tokens: int) -> int:
    """The prompt-size class of a prompt of ``prompt_tokens`` tokens (an index into ``SIZE_CLASSES``, or past it)."""
    for i, bound in enumerate(SIZE_CLASSES):
        if prompt_tokens <= bound:
            return i
    return len(SIZE_CLASSES)


class HedgeBudget:
    """A token bucket: each request adds ``budget`` tokens (at most ``max(floor, 1)`` held), a hedge spends one;
    so over ``n`` requests at most ``floor + budget × n`` are hedged."""

    __slots__ = ("budget", "cap", "hedges", "requests", "tokens")

    def __init__(self, budget: float, floor: float) -> None:
        self.budget, self.cap = budget, max(floor, 1.0)
        self.tokens = floor
        self.requests = self.hedges = 0

    def on_request(self) -> None:
        self.requests += 1
        self.tokens = min(self.cap, self.tokens + self.budget)

    def try_spend(self) -> bool:
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        self.hedges += 1
        return True


@dataclass(frozen=True, slots=True)
class HedgeRoute:
    """A candidate for the second request, as the plugin (or the simulator) sees it."""

    backend: str
    hosted: bool  # never a self-hosted replica
    model: str  # the served model: a hedge asks the same model
    breaker_closed: bool = True
    bills_loser_in_full: bool = False  # its provider keeps generating a cancelled call and bills it all
    expected_hit: float = 0.0  # the share of the prompt it likely holds cached
    price: float = 0.0  # its effective input price (lower is better)


class Hedger:
    """One group's hedging: TTFT samples per (route, prompt-size class), the budget, and who is late now."""

    def __init__(self, config: HedgeConfig) -> None:
        self.config = config
        self.budget = HedgeBudget(config.budget, config.floor)
        self._ttft: dict[tuple[str, int], deque[tuple[float, float]]] = {}
        self._late: dict[str, int] = {}  # backend -> requests now waiting past their delay

    # --- learning --------------------------------------------------------------------------------
    def learn(self, backend: str, prompt_tokens: int, ttft_s: float, now: float) -> None:
        """One first token: ``ttft_s`` after the request was sent to ``backend``."""
        if not (ttft_s >= 0 and math.isfinite(ttft_s)):
            return
        samples = self._ttft.setdefault((backend, size_class(prompt_tokens)), deque(maxlen=1024))
        samples.append((now, ttft_s))

    def delay(self, backend: str, prompt_tokens: int, now: float) -> float | None:
        """Seconds to wait for ``backend``'s first token before hedging (None: too few samples to judge)."""
        cfg = self.config
        samples = self._ttft.get((backend, size_class(prompt_tokens)))
        recent = sorted(v for t, v in samples if now - t <= cfg.window_s) if samples else []
        if len(recent) < cfg.min_samples:
            return None
        return min(cfg.max_delay_s, max(cfg.min_delay_s, percentile(recent, cfg.quantile)))

    # --- the decision ----------------------------------------------------------------------------
    def on_request(self) -> None:
        """A streamed request of the group arrived (the budget grows by ``budget``)."""
        self.budget.on_request()

    def late(self, backend: str) -> None:
        """A request on ``backend`` is now waiting past its delay."""
        self._late[backend] = self._late.get(backend, 0) + 1

    def settled(self, backend: str) -> None:
        """A request counted by ``late`` got its first token or ended."""
        n = self._late.get(backend, 0) - 1
        if n > 0:
            self._late[backend] = n
        else:
            self._late.pop(backend, None)

    def paused(self, routes: Iterable[str]) -> bool:
        """Whether more than ``pause_share`` of ``routes`` have a request waiting past its delay."""
        names = list(routes)
        if not names:
            return True
        late = sum(1 for b in names if self._late.get(b))
        return late / len(names) > self.config.pause_share

    def choose(self, primary: HedgeRoute, routes: Sequence[HedgeRoute]) -> HedgeRoute | None:
        """The route of a hedge for a request on ``primary``: another hosted route of the same model (one
        group: one isolation), breaker closed, not billing a loser in full; the likeliest to hold the prompt
        cached, then the cheapest (None: no such route)."""
        fit = [r for r in routes if r.backend != primary.backend and r.hosted and r.model == primary.model
               and r.breaker_closed and not r.bills_loser_in_full]
        if not fit:
            return None
        return min(fit, key=lambda r: (-r.expected_hit, r.price, r.backend))

    def should_hedge(self, primary: HedgeRoute, routes: Sequence[HedgeRoute]) -> HedgeRoute | None:
        """Called when a request on ``primary`` passed its delay: the hedge's route, spending one budget token,
        or None (no route, hedging paused, or the budget spent)."""
        if not primary.hosted:
            return None
        target = self.choose(primary, routes)
        if target is None or self.paused(r.backend for r in routes if r.hosted and r.model == primary.model):
            return None
        return target if self.budget.try_spend() else None
