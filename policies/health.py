"""Backend health: classified outcomes feed one circuit breaker per backend (provider, model, endpoint).

Closed → open on an error rate over a sliding window (with a minimum count) or on N consecutive provider
failures; open → half-open when the (exponential, jittered) cooldown ends; half-open admits exactly one
probe at a time and closes after ``half_open_successes`` good probes. 429s open for their Retry-After;
401/402/403/404 open for a long cooldown; client errors and cancellations are neutral. Slow backends are
not opened: ``penalty()`` in [0, 1] lowers their rank. Time is always passed in as ``now`` (seconds).
Defaults follow the gateways' breakers: a 50 % error rate per minute (LiteLLM's router cooldown) over at least
10 requests (Portkey's ``minimum_requests``), a doubling cooldown from 10 s capped at 300 s, and OpenRouter's
uptime tiers (30 min window, at least 100 attempts, healthy ≥ 95 %, fallback-only < 80 %).
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvroute.policies.rolling import RollingLatency, SlidingCounts, percentile


class Outcome(StrEnum):
    """What one upstream attempt tells us about the backend."""

    SUCCESS = "success"
    PROVIDER_FAILURE = "provider_failure"
    CAPACITY = "capacity"
    CONFIG_FAILURE = "config_failure"
    CLIENT_ERROR = "client_error"
    CANCELLED = "cancelled"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


NEUTRAL = frozenset({Outcome.CLIENT_ERROR, Outcome.CANCELLED})

@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Every breaker knob; defaults: 60 s/6-bucket error window, 5 consecutive failures, doubling cooldown, ..."""

    window_s: float = 60.0
    window_buckets: int = 6
    min_requests: int = 10
    error_rate: float = 0.5
    consecutive_failures: int = 5
    base_cooldown_s: float = 10.0
    cooldown_multiplier: float = 2.0
    max_cooldown_s: float = 300.0
    jitter: float = 0.2
    half_open_successes: int = 2
    probe_timeout_s: float = 120.0
    capacity_default_s: float = 10.0
    capacity_min_s: float = 1.0
    capacity_max_s: float = 60.0
    capacity_half_open: bool = False
    config_failure_cooldown_s: float = 900.0
    uptime_window_s: float = 1800.0
    uptime_buckets: int = 30
    uptime_min_requests: int = 100
    uptime_healthy: float = 0.95
    uptime_down: float = 0.80
    ttft_slo_s: float | None = None
    latency_slo_s: float | None = None
    latency_window_s: float = 300.0
    baseline_window_s: float = 3600.0
    baseline_factor: float = 2.0
    baseline_min_minutes: int = 3
    latency_min_samples: int = 5
    latency_max_samples: int = 512
    latency_penalty: float = 0.5
    degraded_penalty: float = 0.75
    down_penalty: float = 1.0
    insufficient_penalty: float = 0.05
    eval_interval_s: float = 1.0

    def __post_init__(self) -> None:
        positive = ("window_s", "base_cooldown_s", "max_cooldown_s", "capacity_default_s", "capacity_min_s",
                    "capacity_max_s", "config_failure_cooldown_s", "uptime_window_s", "latency_window_s",
                    "baseline_window_s", "probe_timeout_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number")
        for name in ("window_buckets", "uptime_buckets", "min_requests", "consecutive_failures",
                     "half_open_successes", "latency_min_samples", "latency_max_samples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        for name in ("error_rate", "jitter", "uptime_healthy", "uptime_down", "latency_penalty",
                     "degraded_penalty", "down_penalty", "insufficient_penalty"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.cooldown_multiplier < 1.0:
            raise ValueError("cooldown_multiplier must be >= 1")
        if self.base_cooldown_s > self.max_cooldown_s:
            raise ValueError("base_cooldown_s must be <= max_cooldown_s")
        if self.capacity_min_s > self.capacity_max_s:
            raise ValueError("capacity_min_s must be <= capacity_max_s")
        if self.uptime_down > self.uptime_healthy:
            raise ValueError("uptime_down must be <= uptime_healthy")
        if self.baseline_factor < 1.0:
            raise ValueError("baseline_factor must be >= 1")
        for name in ("ttft_slo_s", "latency_slo_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None")
        if self.eval_interval_s < 0:
            raise ValueError("eval_interval_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Transition:
    """One breaker state change, handed to listeners (metrics, shared state). ``origin``: local/remote."""

    backend: str
    old: BreakerState
    new: BreakerState
    reason: str
    at: float
    until: float | None = None
    level: int = 0
    origin: str = "local"


@dataclass(slots=True)
class _Eval:
    at: float = -math.inf
    penalty: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


class CircuitBreaker:
    """One backend's breaker; thread-safe. ``allow`` hands out the single half-open probe token."""

    def __init__(
        self,
        backend: str,
        config: BreakerConfig | None = None,
        *,
        rng: random.Random | None = None,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        self.backend = backend
        self.config = cfg = config or BreakerConfig()
        self.rng = rng or random.Random(0)
        self.on_transition = on_transition
        self.state = BreakerState.CLOSED
        self.reason = ""
        self.opened_at: float | None = None
        self.until: float | None = None
        self.level = 0  # consecutive re-opens; the next provider-failure cooldown is base × mult^level
        self.consecutive = 0
        self.probe_out_since: float | None = None
        self.probe_successes = 0
        self._errors = SlidingCounts(cfg.window_s, cfg.window_buckets)
        self._uptime = SlidingCounts(cfg.uptime_window_s, cfg.uptime_buckets)
        self.ttft = RollingLatency(cfg.latency_window_s, cfg.baseline_window_s, cfg.latency_max_samples)
        self.latency = RollingLatency(cfg.latency_window_s, cfg.baseline_window_s, cfg.latency_max_samples)
        self._eval = _Eval()
        self._lock = threading.RLock()
        self.transitions = 0

    # --- admission ------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        if self.state is BreakerState.OPEN and self.until is not None and now >= self.until:
            if self.reason == Outcome.CAPACITY.value and not self.config.capacity_half_open:
                self._close(now, "capacity_cooldown_over")
            else:
                self._move(BreakerState.HALF_OPEN, now, "cooldown_over")
                self.probe_out_since = None
                self.probe_successes = 0

    def _probe_free(self, now: float) -> bool:
        since = self.probe_out_since
        return since is None or now - since >= self.config.probe_timeout_s or now < since

    def available(self, now: float) -> bool:
        """Would ``allow`` admit a request now? (A peek: takes no probe token.)"""
        with self._lock:
            self._advance(now)
            if self.state is BreakerState.CLOSED:
                return True
            return self.state is BreakerState.HALF_OPEN and self._probe_free(now)

    def allow(self, now: float) -> bool:
        """Admit one request: always when closed, never while open, one probe at a time when half-open."""
        with self._lock:
            self._advance(now)
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.HALF_OPEN and self._probe_free(now):
                self.probe_out_since = now
                return True
            return False

    def release_probe(self) -> None:
        """The admitted probe was never sent (the router chose elsewhere): let another one through."""
        with self._lock:
            self.probe_out_since = None

    # --- outcomes -------------------------------------------------------------------------------
    def record(
        self,
        outcome: Outcome,
        now: float,
        *,
        retry_after_s: float | None = None,
        ttft_s: float | None = None,
        latency_s: float | None = None,
        started_at: float | None = None,
    ) -> BreakerState:
        """Feed one classified attempt; ``started_at`` before the last opening makes it a stale outcome
        that updates statistics but never the state. Returns the state afterwards."""
        outcome = Outcome(outcome)
        with self._lock:
            self._advance(now)
            if ttft_s is not None and outcome is Outcome.SUCCESS:
                self.ttft.add(now, float(ttft_s))
            if latency_s is not None and outcome is Outcome.SUCCESS:
                self.latency.add(now, float(latency_s))
            if outcome in (Outcome.SUCCESS, Outcome.PROVIDER_FAILURE, Outcome.CONFIG_FAILURE):
                self._uptime.add(now, outcome is Outcome.SUCCESS)
            stale = started_at is not None and self.opened_at is not None and started_at < self.opened_at
            if outcome in NEUTRAL:
                if self.state is BreakerState.HALF_OPEN and not stale:
                    self.probe_out_since = None  # the probe ended without a verdict: let another through
                return self.state
            if self.state is BreakerState.OPEN or stale:
                return self.state
            if self.state is BreakerState.HALF_OPEN:
                slo = self.config.ttft_slo_s
                if outcome is Outcome.SUCCESS and slo is not None and ttft_s is not None and ttft_s > slo:
                    outcome = Outcome.PROVIDER_FAILURE  # a probe must also meet the TTFT SLO to close
                self._record_probe(outcome, now, retry_after_s)
            else:
                self._record_closed(outcome, now, retry_after_s)
            return self.state

    def _record_probe(self, outcome: Outcome, now: float, retry_after_s: float | None) -> None:
        self.probe_out_since = None
        if outcome is Outcome.SUCCESS:
            self.probe_successes += 1
            if self.probe_successes >= self.config.half_open_successes:
                self._close(now, "probe_succeeded")
            return
        if outcome is Outcome.CAPACITY:
            self._open(now, self._capacity_cooldown(retry_after_s), Outcome.CAPACITY.value)
        elif outcome is Outcome.CONFIG_FAILURE:
            self._open(now, self.config.config_failure_cooldown_s, Outcome.CONFIG_FAILURE.value)
        else:
            self.level += 1
            self._open(now, self._cooldown(), "probe_failed")

    def _record_closed(self, outcome: Outcome, now: float, retry_after_s: float | None) -> None:
        cfg = self.config
        if outcome is Outcome.SUCCESS:
            self.consecutive = 0
            self._errors.add(now, True)
            return
        if outcome is Outcome.CAPACITY:
            self._open(now, self._capacity_cooldown(retry_after_s), Outcome.CAPACITY.value)
            return
        if outcome is Outcome.CONFIG_FAILURE:
            self._open(now, cfg.config_failure_cooldown_s, Outcome.CONFIG_FAILURE.value)
            return
        self.consecutive += 1
        self._errors.add(now, False)
        s, f = self._errors.totals(now)
        if self.consecutive >= cfg.consecutive_failures:
            self._open(now, self._cooldown(), "consecutive_failures")
        elif s + f >= cfg.min_requests and f / (s + f) > cfg.error_rate:
            self._open(now, self._cooldown(), "error_rate")

    def _capacity_cooldown(self, retry_after_s: float | None) -> float:
        cfg = self.config
        if retry_after_s is None or not math.isfinite(retry_after_s):
            return cfg.capacity_default_s
        return min(cfg.capacity_max_s, max(cfg.capacity_min_s, float(retry_after_s)))

    def _cooldown(self) -> float:
        cfg = self.config
        base = min(cfg.max_cooldown_s, cfg.base_cooldown_s * cfg.cooldown_multiplier ** min(self.level, 64))
        return base * (1.0 + cfg.jitter * (2.0 * self.rng.random() - 1.0))

    # --- transitions ----------------------------------------------------------------------------
    def _open(self, now: float, cooldown_s: float, reason: str) -> None:
        self.opened_at = now
        self.until = now + max(0.0, cooldown_s)
        self.probe_out_since = None
        self.probe_successes = 0
        self._move(BreakerState.OPEN, now, reason)

    def _close(self, now: float, reason: str) -> None:
        self.level = 0
        self.consecutive = 0
        self.until = None
        self.probe_out_since = None
        self.probe_successes = 0
        self._errors.clear()
        self._move(BreakerState.CLOSED, now, reason)

    def _move(self, new: BreakerState, now: float, reason: str, origin: str = "local") -> None:
        old = self.state
        self.state = new
        self.reason = reason
        self.transitions += 1
        if self.on_transition is not None:
            event = Transition(self.backend, old, new, reason, now, self.until, self.level, origin)
            with contextlib.suppress(Exception):  # a listener (metrics) must never break routing
                self.on_transition(event)

    def force_open(self, now: float, until: float, *, level: int = 0, reason: str = "remote",
                   origin: str = "remote") -> None:
        """Adopt an opening decided elsewhere (another worker); keeps a later local ``until``."""
        with self._lock:
            if self.state is BreakerState.OPEN and self.until is not None and self.until >= until:
                return
            self.opened_at = now
            self.until = max(now, until)
            self.level = max(0, int(level))
            self.probe_out_since = None
            self.probe_successes = 0
            self._move(BreakerState.OPEN, now, reason, origin)

    def force_close(self, now: float, *, reason: str = "remote", origin: str = "remote") -> None:
        """Adopt a closing decided elsewhere (another worker's probe succeeded)."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return
            self.level = 0
            self.consecutive = 0
            self.until = None
            self.probe_out_since = None
            self.probe_successes = 0
            self._errors.clear()
            self._move(BreakerState.CLOSED, now, reason, origin)

    # --- degradation ----------------------------------------------------------------------------
    def uptime(self, now: float) -> tuple[float | None, str]:
        """(success share over the uptime window or None, tier: healthy/insufficient_data/degraded/down)."""
        s, f = self._uptime.totals(now)
        if s + f == 0:
            return None, "insufficient_data"
        ratio = s / (s + f)
        if s + f < self.config.uptime_min_requests:
            return ratio, "insufficient_data"
        if ratio >= self.config.uptime_healthy:
            return ratio, "healthy"
        return ratio, ("degraded" if ratio >= self.config.uptime_down else "down")

    def _latency_penalty(self, samples: RollingLatency, slo: float | None, now: float) -> tuple[float, dict]:
        cfg = self.config
        recent = samples.recent(now)
        base, minutes = samples.baseline(now)
        info: dict[str, Any] = {"n": len(recent)}
        if recent:
            info["p50"] = percentile(recent, 0.5)
            info["p90"] = percentile(recent, 0.9)
        limits = []
        if slo is not None:
            limits.append(slo)
        if base is not None and minutes >= cfg.baseline_min_minutes:
            info["baseline_p90"] = base
            limits.append(cfg.baseline_factor * base)
        if not limits or len(recent) < cfg.latency_min_samples:
            return 0.0, info
        limit = max(limits)
        info["limit"] = limit
        p90 = info["p90"]
        if limit <= 0 or p90 <= limit:
            return 0.0, info
        return min(1.0, cfg.latency_penalty * p90 / limit), info

    def penalty(self, now: float) -> float:
        """Rank penalty in [0, 1] from latency degradation and the uptime tier; never opens the breaker."""
        with self._lock:
            ev = self._eval
            if ev.at <= now < ev.at + self.config.eval_interval_s:
                return ev.penalty  # evaluated at most once per eval_interval_s (sorting is not free)
            cfg = self.config
            ttft_pen, ttft_info = self._latency_penalty(self.ttft, cfg.ttft_slo_s, now)
            lat_pen, lat_info = self._latency_penalty(self.latency, cfg.latency_slo_s, now)
            ratio, tier = self.uptime(now)
            tier_pen = {"healthy": 0.0, "insufficient_data": cfg.insufficient_penalty,
                        "degraded": cfg.degraded_penalty, "down": cfg.down_penalty}[tier]
            pen = max(ttft_pen, lat_pen, tier_pen)
            self._eval = _Eval(now, pen, {"ttft": ttft_info, "latency": lat_info, "uptime": ratio, "tier": tier,
                                          "latency_degraded": max(ttft_pen, lat_pen) > 0})
            return pen

    # --- inspection -----------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        """Plain dict for ``kvroute status``, ``/health`` and metrics."""
        pen = self.penalty(now)
        with self._lock:
            self._advance(now)
            s, f = self._errors.totals(now)
            detail = self._eval.detail
            return {
                "state": self.state.value,
                "reason": self.reason,
                "opened_at": self.opened_at,
                "until": self.until,
                "remaining_s": max(0.0, self.until - now) if self.until is not None else 0.0,
                "level": self.level,
                "consecutive_failures": self.consecutive,
                "window": {"successes": s, "failures": f},
                "probe_outstanding": self.probe_out_since is not None,
                "uptime": detail.get("uptime"),
                "tier": detail.get("tier"),
                "ttft": detail.get("ttft", {}),
                "latency": detail.get("latency", {}),
                "latency_degraded": detail.get("latency_degraded", False),
                "penalty": pen,
            }


class HealthBoard:
    """Breakers by backend id (created on first use), transition listeners and a read-only snapshot."""

    def __init__(
        self,
        config: BreakerConfig | None = None,
        *,
        rng: random.Random | None = None,
        listeners: Iterable[Callable[[Transition], None]] = (),
    ) -> None:
        self.config = config or BreakerConfig()
        self.rng = rng or random.Random(0)
        self._overrides: dict[str, BreakerConfig] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._listeners: list[Callable[[Transition], None]] = list(listeners)
        self._lock = threading.RLock()
        self.listener_errors = 0
        self.last_now = 0.0  # the latest time any caller passed in (the default for ``snapshot``)

    def configure(self, backend: str, config: BreakerConfig | Mapping[str, Any]) -> None:
        """Per-backend knobs (e.g. self-hosted replicas cool down faster than hosted providers)."""
        cfg = config if isinstance(config, BreakerConfig) else replace(self.config, **dict(config))
        with self._lock:
            self._overrides[backend] = cfg
            if backend in self._breakers:
                self._breakers[backend].config = cfg

    def add_listener(self, listener: Callable[[Transition], None]) -> None:
        self._listeners.append(listener)

    def _notify(self, event: Transition) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                self.listener_errors += 1

    def breaker(self, backend: str) -> CircuitBreaker:
        b = self._breakers.get(backend)
        if b is None:
            with self._lock:
                b = self._breakers.get(backend)
                if b is None:
                    cfg = self._overrides.get(backend, self.config)
                    b = CircuitBreaker(backend, cfg, rng=self.rng, on_transition=self._notify)
                    self._breakers[backend] = b
        return b

    def known(self) -> list[str]:
        return list(self._breakers)

    def allow(self, backend: str, now: float) -> bool:
        """Admit a request to ``backend`` (takes the half-open probe token)."""
        self.last_now = max(self.last_now, now)
        return self.breaker(backend).allow(now)

    def available(self, backend: str, now: float) -> bool:
        """Peek: would ``allow`` admit now? Unknown backends are available."""
        b = self._breakers.get(backend)
        return True if b is None else b.available(now)

    def filter(self, backends: Iterable[str], now: float) -> list[str]:
        """The backends a request may go to now (closed, or half-open with the probe free)."""
        return [b for b in backends if self.available(b, now)]

    def release_probe(self, backend: str) -> None:
        b = self._breakers.get(backend)
        if b is not None:
            b.release_probe()

    def record(
        self,
        backend: str,
        outcome: Outcome | str,
        now: float,
        retry_after_s: float | None = None,
        ttft_s: float | None = None,
        latency_s: float | None = None,
        *,
        started_at: float | None = None,
    ) -> BreakerState:
        """Feed one classified attempt to the backend's breaker; returns its state afterwards."""
        self.last_now = max(self.last_now, now)
        return self.breaker(backend).record(Outcome(outcome), now, retry_after_s=retry_after_s, ttft_s=ttft_s,
                                            latency_s=latency_s, started_at=started_at)

    def state(self, backend: str, now: float | None = None) -> BreakerState:
        """Current state (advanced to ``now`` when given: an elapsed cooldown reads as half-open)."""
        b = self._breakers.get(backend)
        if b is None:
            return BreakerState.CLOSED
        if now is not None:
            with b._lock:
                b._advance(now)
        return b.state

    def penalty(self, backend: str, now: float) -> float:
        b = self._breakers.get(backend)
        return 0.0 if b is None else b.penalty(now)

    def soonest(self, backends: Iterable[str], now: float) -> tuple[str | None, float]:
        """The backend whose cooldown ends first and the seconds until then (for Retry-After)."""
        best: tuple[str | None, float] = (None, math.inf)
        for name in backends:
            b = self._breakers.get(name)
            wait = 0.0 if b is None or b.until is None else max(0.0, b.until - now)
            if b is not None and b.state is BreakerState.CLOSED:
                wait = 0.0
            if wait < best[1]:
                best = (name, wait)
        return best

    def remove_backend(self, backend: str) -> None:
        with self._lock:
            self._breakers.pop(backend, None)

    def snapshot(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Every breaker's state and windows, keyed by backend id (at ``now``, else the latest time seen)."""
        at = self.last_now if now is None else now
        return {name: b.snapshot(at) for name, b in sorted(self._breakers.items())}
