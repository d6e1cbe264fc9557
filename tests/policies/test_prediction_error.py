"""The hybrid policy's prediction margin: a rolling quantile of observed / predicted self-hosted TTFT."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvroute.policies import RoutingRequest
from kvroute.policies.base import RoutingState
from kvroute.policies.decision import Decision
from kvroute.policies.hybrid import Hybrid, HybridConfig
from kvroute.policies.prediction_error import PredictionError
from kvroute.policies.rates import ProviderQuote


def test_margin_is_the_quantile_of_observed_over_predicted_in_the_window() -> None:
    e = PredictionError(0.9, 60.0, min_samples=10)
    for i in range(100):
        e.record(f"r{i}", 1.0)
        e.observe(f"r{i}", 1.0 + i / 100, now=float(i) * 0.1)  # ratios 1.00 .. 1.99
    assert e.margin(10.0) == pytest.approx(1.89)
    assert e.margin(200.0) == 1.0  # every sample left the window


def test_margin_needs_samples_ignores_unknown_ids_and_stays_in_bounds() -> None:
    e = PredictionError(0.5, 60.0, min_samples=3, max_margin=2.0)
    e.observe("never-picked", 5.0, 0.0)
    e.record("x", 0.0)  # no usable prediction
    e.observe("x", 1.0, 0.0)
    assert e.margin(0.0) == 1.0
    for i in range(3):
        e.record(f"a{i}", 0.1)
        e.observe(f"a{i}", 10.0, 1.0)  # 100x late: clamped
    assert e.margin(1.0) == 2.0
    e2 = PredictionError(0.5, 60.0, min_samples=3)
    for i in range(3):
        e2.record(f"b{i}", 2.0)
        e2.observe(f"b{i}", 0.5, 1.0)  # early: never below 1
    assert e2.margin(1.0) == 1.0
    e2.record("gone", 1.0)
    e2.forget("gone")
    e2.observe("gone", 9.0, 1.0)
    assert e2.margin(1.0) == 1.0
    with pytest.raises(ValueError):
        PredictionError(1.0)


class _Policy(Hybrid):
    """Hybrid with a fixed self-hosted prediction (the cache-aware model is tested elsewhere)."""

    predicted = 1.0

    def predicted_self_s(self, decision: Decision, request: RoutingRequest, state: RoutingState,
                         now: float) -> float:
        return self.predicted


def _request(i: int) -> RoutingRequest:
    return RoutingRequest(model="m", keys=[i + 1], block_tokens=16, prompt_tokens=100, request_id=f"q{i}")


def test_hybrid_overflows_earlier_once_predictions_run_late() -> None:
    from kvroute.policies import LoadTracker, PrefixIndex, PrefixIndexConfig

    state = RoutingState(index=PrefixIndex(PrefixIndexConfig()), load=LoadTracker())
    policy = _Policy(HybridConfig(ttft_target_s=2.0, hosted=("h",), min_dwell_s=0.0, prediction_window_s=60.0))
    policy.add_quotes([ProviderQuote("h", "h", "m", Decimal("1e-6"), Decimal("2e-6"))])
    policy.predicted = 1.5  # 0.75 × target: self-hosted while the model is trusted
    first = policy.select(_request(0), ["r0", "h"], state, 0.0)
    assert first.backend == "r0" and first.why["margin"] == 1.0
    for i in range(1, 40):  # every self-hosted pick came 2x later than predicted
        d = policy.select(_request(i), ["r0", "h"], state, float(i))
        if d.backend == "r0":
            policy.record_success(_request(i), "r0", float(i) + 0.1, ttft_s=2 * policy.predicted)
    late = policy.select(_request(99), ["r0", "h"], state, 50.0)
    assert late.backend == "h" and late.reason == "overflow_latency" and late.why["margin"] == pytest.approx(2.0)
    off = _Policy(HybridConfig(ttft_target_s=2.0, hosted=("h",), prediction_quantile=None))
    off.add_quotes([ProviderQuote("h", "h", "m", Decimal("1e-6"), Decimal("2e-6"))])
    off.predicted = 1.5
    assert off.select(_request(0), ["r0", "h"], state, 0.0).why["margin"] == 1.0
