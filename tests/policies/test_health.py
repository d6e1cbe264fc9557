"""The breaker's word as a view of the one failure classifier, the breaker state machine (with property tests)
and latency degradation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies.health import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    HealthBoard,
    Outcome,
    Transition,
)
from kvroute.policies.outcomes import FailureKind, classify_fields, typed_kind

# --- the breaker's word: a view of the one classifier -------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type", "expected"),
    [
        (500, None, Outcome.PROVIDER_FAILURE),
        (502, None, Outcome.PROVIDER_FAILURE),
        (529, None, Outcome.PROVIDER_FAILURE),
        (None, "APIConnectionError", Outcome.PROVIDER_FAILURE),
        (None, "Timeout", Outcome.PROVIDER_FAILURE),
        (408, None, Outcome.PROVIDER_FAILURE),
        (429, None, Outcome.CAPACITY),
        (503, None, Outcome.PROVIDER_FAILURE),
        (None, "provider_overloaded", Outcome.CAPACITY),
        (None, "RateLimitError", Outcome.CAPACITY),
        (401, None, Outcome.CONFIG_FAILURE),
        (402, None, Outcome.CONFIG_FAILURE),
        (403, None, Outcome.CONFIG_FAILURE),
        (404, None, Outcome.CONFIG_FAILURE),
        (None, "AuthenticationError", Outcome.CONFIG_FAILURE),
        (400, None, Outcome.CLIENT_ERROR),
        (413, None, Outcome.CLIENT_ERROR),
        (422, None, Outcome.CLIENT_ERROR),
        (400, "ContextWindowExceededError", Outcome.CLIENT_ERROR),
        (None, "asyncio.CancelledError", Outcome.CANCELLED),
        (499, None, Outcome.CANCELLED),
        (None, "SomethingUnknown", Outcome.PROVIDER_FAILURE),
    ],
)
def test_the_breakers_word_is_the_classifiers_verdict_seen_through_its_table(status, error_type, expected):
    assert classify_fields(status, error_type).outcome is expected


def test_type_words_name_a_kind_from_a_class_or_a_name_and_only_a_cancellation_once_streaming():
    class RateLimitError(Exception):
        pass

    assert typed_kind(RateLimitError) is FailureKind.CAPACITY
    assert typed_kind("provider_overloaded") is FailureKind.CAPACITY
    assert typed_kind("AuthenticationError") is FailureKind.BACKEND_CONFIG
    assert typed_kind("ContextWindowExceededError") is FailureKind.REQUEST_INVALID
    assert typed_kind("Cancelled") is FailureKind.CANCELLED
    assert typed_kind(TimeoutError) is None and typed_kind(ConnectionRefusedError) is None  # the backend's own
    assert typed_kind("ServiceUnavailableError") is None and typed_kind("SomethingUnknown") is None
    assert typed_kind(None) is None
    assert typed_kind(RateLimitError, mid_stream=True) is None  # a started stream that fails is a cut
    assert typed_kind("CancelledError", mid_stream=True) is FailureKind.CANCELLED


# --- breaker ------------------------------------------------------------------------------------

FAST = BreakerConfig(jitter=0.0, eval_interval_s=0.0)


def test_consecutive_failures_open_then_half_open_single_probe_then_close():
    events: list[Transition] = []
    br = CircuitBreaker("b", FAST, on_transition=events.append)
    for i in range(4):
        assert br.record(Outcome.PROVIDER_FAILURE, float(i)) is BreakerState.CLOSED
    assert br.record(Outcome.PROVIDER_FAILURE, 4.0) is BreakerState.OPEN
    assert br.reason == "consecutive_failures"
    assert br.until == pytest.approx(14.0)
    assert not br.allow(10.0) and not br.available(13.9)
    assert br.available(14.0)
    assert br.allow(14.0)  # the probe
    assert br.state is BreakerState.HALF_OPEN
    assert not br.allow(14.1) and not br.available(14.1)  # exactly one probe in flight
    br.record(Outcome.SUCCESS, 15.0)
    assert br.state is BreakerState.HALF_OPEN  # needs two good probes
    assert br.allow(15.1) and not br.allow(15.2)
    br.record(Outcome.SUCCESS, 16.0)
    assert br.state is BreakerState.CLOSED and br.level == 0
    assert [(e.old, e.new) for e in events] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]


def test_error_rate_needs_minimum_count():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=100))
    t = 0.0
    for _ in range(4):  # 4 failures + 4 successes: rate 0.5 is not > 0.5
        br.record(Outcome.SUCCESS, t)
        br.record(Outcome.PROVIDER_FAILURE, t + 0.1)
        t += 1
    assert br.state is BreakerState.CLOSED
    br.record(Outcome.PROVIDER_FAILURE, t)  # 5/9, but n < 10
    assert br.state is BreakerState.CLOSED
    br.record(Outcome.PROVIDER_FAILURE, t + 0.1)  # 6/10 > 0.5 with n >= 10
    assert br.state is BreakerState.OPEN and br.reason == "error_rate"


def test_old_failures_leave_the_window():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=100))
    for i in range(9):
        br.record(Outcome.SUCCESS, float(i))
        br.record(Outcome.PROVIDER_FAILURE, float(i) + 0.5)
    assert br.state is BreakerState.CLOSED  # 9 of 18: not above 50 %
    # 70 s later the old buckets are gone: 1 failure of 1 is below the minimum count.
    br.record(Outcome.PROVIDER_FAILURE, 80.0)
    assert br.state is BreakerState.CLOSED


def test_exponential_cooldown_is_capped_and_resets_on_close():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=1, max_cooldown_s=35.0))
    br.record(Outcome.PROVIDER_FAILURE, 0.0)
    assert br.until == 10.0
    cooldowns = []
    now = 10.0
    for _ in range(4):
        assert br.allow(now)
        br.record(Outcome.PROVIDER_FAILURE, now)
        cooldowns.append(br.until - now)
        now = br.until
    assert cooldowns == [20.0, 35.0, 35.0, 35.0]
    assert br.allow(now)
    br.record(Outcome.SUCCESS, now)
    assert br.allow(now + 1)
    br.record(Outcome.SUCCESS, now + 1)
    assert br.state is BreakerState.CLOSED
    br.record(Outcome.PROVIDER_FAILURE, now + 2)
    assert br.until - (now + 2) == 10.0


def test_jitter_is_seeded_and_bounded():
    cfg = BreakerConfig(consecutive_failures=1, jitter=0.2)
    a = CircuitBreaker("b", cfg, rng=random.Random(7))
    b = CircuitBreaker("b", cfg, rng=random.Random(7))
    a.record(Outcome.PROVIDER_FAILURE, 0.0)
    b.record(Outcome.PROVIDER_FAILURE, 0.0)
    assert a.until == b.until
    assert 8.0 <= a.until <= 12.0


def test_capacity_honours_retry_after_and_closes_without_probe():
    br = CircuitBreaker("b", FAST)
    br.record(Outcome.CAPACITY, 0.0, retry_after_s=3.0)
    assert br.state is BreakerState.OPEN and br.until == 3.0
    assert not br.allow(2.9)
    assert br.allow(3.0) and br.allow(3.0)  # straight back to closed (no single-probe throttle)
    assert br.state is BreakerState.CLOSED
    br.record(Outcome.CAPACITY, 10.0, retry_after_s=1e6)
    assert br.until == 70.0  # clamped to capacity_max_s
    br2 = CircuitBreaker("c", FAST)
    br2.record(Outcome.CAPACITY, 0.0)
    assert br2.until == 10.0  # default without Retry-After


def test_capacity_does_not_count_against_uptime_or_error_rate():
    br = CircuitBreaker("b", FAST)
    br.record(Outcome.CAPACITY, 0.0, retry_after_s=1)
    snap = br.snapshot(0.5)
    assert snap["window"] == {"successes": 0, "failures": 0}
    assert snap["uptime"] is None


def test_config_failure_opens_for_long_cooldown():
    br = CircuitBreaker("b", FAST)
    br.record(Outcome.CONFIG_FAILURE, 0.0)
    assert br.state is BreakerState.OPEN and br.until == 900.0 and br.reason == "config_failure"
    assert not br.available(899.0)


def test_neutral_outcomes_never_trip_and_release_the_probe():
    br = CircuitBreaker("b", FAST)
    for i in range(50):
        br.record(Outcome.CLIENT_ERROR, float(i))
        br.record(Outcome.CANCELLED, float(i))
    assert br.state is BreakerState.CLOSED
    br.record(Outcome.CONFIG_FAILURE, 100.0)
    assert br.allow(1000.0)
    assert not br.allow(1000.0)
    br.record(Outcome.CANCELLED, 1001.0)  # the probe was cancelled: no verdict, another may go
    assert br.state is BreakerState.HALF_OPEN
    assert br.allow(1001.0)


def test_stale_outcomes_do_not_move_the_state():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=1))
    br.record(Outcome.PROVIDER_FAILURE, 5.0)
    assert br.allow(15.0)
    # A request that started before the opening fails late: it is not the probe's verdict.
    br.record(Outcome.PROVIDER_FAILURE, 15.5, started_at=4.0)
    assert br.state is BreakerState.HALF_OPEN
    br.record(Outcome.SUCCESS, 16.0, started_at=15.0)
    assert br.state is BreakerState.HALF_OPEN and br.probe_successes == 1


def test_lost_probe_times_out():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=1, probe_timeout_s=30.0))
    br.record(Outcome.PROVIDER_FAILURE, 0.0)
    assert br.allow(10.0)
    assert not br.allow(39.0)
    assert br.allow(40.0)


def test_release_probe():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=1))
    br.record(Outcome.PROVIDER_FAILURE, 0.0)
    assert br.allow(10.0)
    br.release_probe()
    assert br.allow(10.0)


def test_force_open_and_close_are_reported_as_remote():
    events: list[Transition] = []
    br = CircuitBreaker("b", FAST, on_transition=events.append)
    br.force_open(0.0, 30.0, level=2, reason="error_rate")
    assert br.state is BreakerState.OPEN and br.until == 30.0 and br.level == 2
    br.force_open(1.0, 20.0)  # an earlier until never shortens a local opening
    assert br.until == 30.0
    br.force_close(2.0)
    assert br.state is BreakerState.CLOSED
    assert [e.origin for e in events] == ["remote", "remote"]


def test_listener_errors_never_break_routing():
    def bad(_: Transition) -> None:
        raise RuntimeError("metrics down")

    board = HealthBoard(FAST, listeners=[bad])
    board.record("b", Outcome.CONFIG_FAILURE, 0.0)
    assert board.state("b") is BreakerState.OPEN
    assert board.listener_errors == 1


# --- degradation --------------------------------------------------------------------------------


def test_latency_threshold_lowers_rank_without_opening():
    br = CircuitBreaker("b", BreakerConfig(ttft_slo_s=1.0, eval_interval_s=0.0))
    for i in range(10):
        br.record(Outcome.SUCCESS, float(i), ttft_s=0.5)
    assert br.penalty(10.0) == pytest.approx(0.05)  # only "insufficient data" for the uptime tier
    for i in range(10, 30):
        br.record(Outcome.SUCCESS, float(i), ttft_s=3.0)
    pen = br.penalty(30.0)
    assert 0.5 <= pen <= 1.0
    assert br.state is BreakerState.CLOSED
    assert br.snapshot(30.0)["latency_degraded"] is True


def test_latency_against_own_baseline():
    br = CircuitBreaker("b", BreakerConfig(eval_interval_s=0.0))
    t = 0.0
    while t < 1200:  # 20 minutes at 0.2 s TTFT build the baseline
        br.record(Outcome.SUCCESS, t, ttft_s=0.2)
        t += 5
    assert br.penalty(t) < 0.5
    while t < 1320:  # two minutes at 1.0 s: 5× the backend's own p90
        br.record(Outcome.SUCCESS, t, ttft_s=1.0)
        t += 5
    snap = br.snapshot(t)
    assert snap["ttft"]["baseline_p90"] == pytest.approx(0.2)
    assert snap["penalty"] >= 0.5 and snap["state"] == "closed"
    # Recovery: latency back to normal for a full window removes the penalty.
    end = t + 400
    while t < end:
        br.record(Outcome.SUCCESS, t, ttft_s=0.2)
        t += 5
    assert br.penalty(t) < 0.5


def test_uptime_tiers():
    br = CircuitBreaker("b", BreakerConfig(consecutive_failures=1000, min_requests=10_000, eval_interval_s=0.0))
    for i in range(90):
        br.record(Outcome.SUCCESS, i * 0.5)
    for i in range(10):
        br.record(Outcome.PROVIDER_FAILURE, 50 + i * 0.5)
    ratio, tier = br.uptime(60.0)
    assert ratio == pytest.approx(0.9) and tier == "degraded"
    assert br.penalty(60.0) == pytest.approx(0.75)
    for i in range(100):
        br.record(Outcome.PROVIDER_FAILURE, 61 + i * 0.1)
    assert br.uptime(80.0)[1] == "down" and br.penalty(80.0) == 1.0


def test_penalty_is_cached_between_evaluations():
    br = CircuitBreaker("b", BreakerConfig(ttft_slo_s=1.0, eval_interval_s=1.0))
    assert br.penalty(0.0) == pytest.approx(0.05)  # no data yet: "insufficient data" tier
    for i in range(10):
        br.record(Outcome.SUCCESS, 0.1 + i * 0.01, ttft_s=5.0)
    assert br.penalty(0.5) == pytest.approx(0.05)  # cached
    assert br.penalty(1.0) > 0.5


# --- board --------------------------------------------------------------------------------------


def test_board_filter_snapshot_soonest_and_overrides():
    board = HealthBoard(BreakerConfig(jitter=0.0, consecutive_failures=1))
    board.configure("fast", {"base_cooldown_s": 2.0})
    board.record("slow", Outcome.PROVIDER_FAILURE, 0.0)
    board.record("fast", Outcome.PROVIDER_FAILURE, 0.0)
    assert board.filter(["slow", "fast", "new"], 1.0) == ["new"]
    assert board.soonest(["slow", "fast"], 1.0) == ("fast", 1.0)
    assert board.filter(["slow", "fast"], 2.0) == ["fast"]
    assert board.state("fast", 2.0) is BreakerState.HALF_OPEN
    snap = board.snapshot(2.0)
    assert set(snap) == {"slow", "fast"}
    assert snap["slow"]["state"] == "open" and snap["slow"]["remaining_s"] == pytest.approx(8.0)
    assert board.allow("fast", 2.0) and not board.allow("fast", 2.0)
    board.remove_backend("slow")
    assert board.state("slow") is BreakerState.CLOSED


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="error_rate"):
        BreakerConfig(error_rate=1.5)
    with pytest.raises(ValueError, match="base_cooldown_s"):
        BreakerConfig(base_cooldown_s=500.0)


# --- property tests -----------------------------------------------------------------------------

OUTCOMES = list(Outcome)
steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=40.0, allow_nan=False),
        st.sampled_from(["allow", "allow", "available", "release", *OUTCOMES]),
        st.one_of(st.none(), st.floats(min_value=0.0, max_value=120.0, allow_nan=False)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(min_value=0, max_value=2**16))
def test_breaker_invariants(ops, seed):
    cfg = BreakerConfig(consecutive_failures=3, min_requests=4, base_cooldown_s=5.0, max_cooldown_s=60.0,
                        half_open_successes=2, probe_timeout_s=30.0, eval_interval_s=0.0)
    events: list[Transition] = []
    br = CircuitBreaker("b", cfg, rng=random.Random(seed), on_transition=events.append)
    now = 0.0
    probes_out = 0  # admitted in half-open and not yet answered
    last_probe = 0.0
    for dt, op, arg in ops:
        now += dt
        before = br.state
        if op == "allow":
            ok = br.allow(now)
            if br.state is BreakerState.HALF_OPEN and ok:
                # Exactly one probe: a second admission needs an answer, a release or the probe timeout.
                assert probes_out == 0 or now - last_probe >= cfg.probe_timeout_s
                probes_out, last_probe = 1, now
            if br.state is BreakerState.OPEN:
                assert not ok and now < br.until
            if br.state is BreakerState.CLOSED:
                assert ok
        elif op == "available":
            peek = br.available(now)
            assert peek == (br.state is BreakerState.CLOSED or (br.state is BreakerState.HALF_OPEN and (
                probes_out == 0 or now - last_probe >= cfg.probe_timeout_s)))
        elif op == "release":
            br.release_probe()
            probes_out = 0
        else:
            outcome = Outcome(op)
            after = br.record(outcome, now, retry_after_s=arg)
            if before is BreakerState.HALF_OPEN or after is not BreakerState.HALF_OPEN:
                probes_out = 0
            if outcome in (Outcome.SUCCESS, Outcome.CLIENT_ERROR, Outcome.CANCELLED):
                assert after is not BreakerState.OPEN or before in (BreakerState.OPEN,)
            if outcome is Outcome.CONFIG_FAILURE and before is not BreakerState.OPEN:
                assert after is BreakerState.OPEN
                assert br.until - now == pytest.approx(cfg.config_failure_cooldown_s)
            if outcome is Outcome.CAPACITY and before is not BreakerState.OPEN:
                assert after is BreakerState.OPEN
                assert cfg.capacity_min_s - 1e-6 <= br.until - now <= cfg.capacity_max_s + 1e-6
        # Never closed or half-open while cooling down; an open breaker always has an end.
        if br.state is BreakerState.OPEN:
            assert br.until is not None and br.opened_at is not None
            cool = br.until - br.opened_at
            assert cool <= max(cfg.config_failure_cooldown_s, cfg.max_cooldown_s * (1 + cfg.jitter)) + 1e-9
        else:
            assert br.until is None or now >= br.until
        assert 0.0 <= br.penalty(now) <= 1.0
    # Transitions chain: each starts where the previous one ended; no self-loops.
    state = BreakerState.CLOSED
    for e in events:
        assert e.old is state and e.new is not e.old
        state = e.new
    assert state is br.state


def test_half_open_hands_out_one_probe_across_threads():
    import threading

    for _ in range(20):
        br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=1))
        br.record(Outcome.PROVIDER_FAILURE, 0.0)
        start = threading.Barrier(8)
        admitted: list[bool] = []

        def worker(br: CircuitBreaker, start: threading.Barrier, admitted: list[bool]) -> None:
            start.wait()
            admitted.append(br.allow(10.0))

        threads = [threading.Thread(target=worker, args=(br, start, admitted)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert admitted.count(True) == 1


def test_snapshot_defaults_to_the_latest_time_seen():
    board = HealthBoard(BreakerConfig(jitter=0.0))
    board.record("x", Outcome.CONFIG_FAILURE, 100.0)
    board.allow("y", 160.0)
    assert board.snapshot()["x"]["remaining_s"] == pytest.approx(840.0)


def test_slow_probe_does_not_close():
    br = CircuitBreaker("b", BreakerConfig(jitter=0.0, consecutive_failures=1, ttft_slo_s=2.0))
    br.record(Outcome.PROVIDER_FAILURE, 0.0)
    assert br.allow(10.0)
    br.record(Outcome.SUCCESS, 15.0, ttft_s=5.0)
    assert br.state is BreakerState.OPEN and br.reason == "probe_failed" and br.level == 1
