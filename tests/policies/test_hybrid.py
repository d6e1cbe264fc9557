"""The hybrid overflow decision: target, cheapest hosted route that meets it, hysteresis, guard, stickiness."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import FleetView, Router, build_policy
from kvroute.policies.errors import ConfigError
from kvroute.policies.health import BreakerConfig, HealthBoard, Outcome
from kvroute.policies.hybrid import Hybrid, HybridConfig, OverflowGuard
from kvroute.policies.rates import ProviderQuote, SelfHostedRate
from kvroute.policies.request import RoutingRequest

SELF = ["s1", "s2"]
KEYS = list(range(101, 118))  # 17 blocks of 64 tokens: above cache_aware's 256-token floor


def quote(backend, inp="0.000002", out="0.000008", read=None):
    return ProviderQuote(backend, backend, "m", Decimal(inp), Decimal(out),
                         Decimal(read) if read is not None else None)


def req(rid="r", session=None, app=None, tags=None, prompt=4000, keys=None):
    return RoutingRequest(model="m", keys=list(KEYS if keys is None else keys), block_tokens=64.0,
                          prompt_tokens=prompt, session_key=session, app=app, tags=tags or {}, request_id=rid)


def setup(quotes=(quote("h1"), quote("h2", inp="0.000004")), **knobs):
    knobs.setdefault("min_dwell_s", 5.0)
    hy = Hybrid(HybridConfig(**knobs))
    hy.add_quotes(quotes)
    router = Router(clock=lambda: 0.0)
    router.set_policy_object("m", hy)
    return hy, router


def queue(router, seconds, backends=SELF, now=0.0):
    """Charge ``seconds`` of outstanding prior-second prefill work to each self-hosted backend."""
    for b in backends:
        router.load.start(f"q-{b}-{seconds}-{now}", b, 1000, now, work_s=seconds)


def drain(router, seconds, backends=SELF, now=0.0):
    for b in backends:
        router.load.release(f"q-{b}-{seconds}-{now}")


def teach_ttft(hy, backend, ttft, now=0.0, n=10):
    for _ in range(n):
        hy.market.learn(backend, now, ttft_s=ttft)


def pick(hy, router, request, candidates=("s1", "s2", "h1", "h2"), now=0.0):
    return hy.select(request, list(candidates), router.state, now)


def test_config_is_validated_and_names_the_knob():
    with pytest.raises(ConfigError, match="ttft_target_s"):
        build_policy("hybrid", {"ttft_target_s": 0}, where="groups.g")
    with pytest.raises(ConfigError, match="leave_ratio"):
        build_policy("hybrid", {"enter_ratio": 1.0, "leave_ratio": 1.5})
    with pytest.raises(ConfigError, match="max_overflow_share"):
        build_policy("hybrid", {"max_overflow_share": 1.5})
    with pytest.raises(ConfigError, match="max_hosted_spend_per_hour"):
        build_policy("hybrid", {"max_hosted_spend_per_hour": "-1"})
    with pytest.raises(ConfigError, match="tag_targets"):
        build_policy("hybrid", {"tag_targets": {"interactive": 0.5}})
    with pytest.raises(ConfigError, match=r"groups\.g\.bogus"):
        build_policy("hybrid", {"bogus": 1}, where="groups.g")
    with pytest.raises(ConfigError, match="cache_aware"):
        build_policy("hybrid", {"cache_aware": {"nope": 1}})
    hy = build_policy("hybrid", {"max_hosted_spend_per_hour": "2.50", "hosted": ["x"]})
    assert isinstance(hy, Hybrid) and hy.config.max_hosted_spend_per_hour == Decimal("2.50")
    assert hy.is_hosted("x") and not hy.is_hosted("s1")


def test_self_hosted_wins_while_it_meets_the_target():
    _, router = setup(ttft_target_s=1.0)
    d = router.pick(req(), ["s1", "s2", "h1", "h2"], group="m")
    assert d.backend in SELF and d.reason == "self_hosted" and d.policy == "hybrid"
    assert d.why["predicted_s"] < 1.0 and d.why["target_s"] == 1.0 and d.why["mode"] == "normal"
    assert set(d.why["routes"]) == {"h1", "h2"} and d.predicted_ttft_s > 0  # the load tracker learns from it


def test_overflow_goes_to_the_cheapest_hosted_route_that_meets_the_target():
    hy, router = setup(ttft_target_s=1.0)
    teach_ttft(hy, "h1", 3.0)  # cheapest but too slow
    teach_ttft(hy, "h2", 0.3)
    queue(router, 5.0)
    d = pick(hy, router, req())
    assert (d.backend, d.reason) == ("h2", "overflow_latency")
    assert d.why["predicted_s"] > 1.0 and d.why["hosted_price"] == d.why["routes"]["h2"]["price"]
    assert d.predicted_ttft_s == 0 and d.work_s == 0  # a hosted TTFT never teaches the fleet's speed factor
    teach_ttft(hy, "h2", 3.0, n=40)
    d = pick(hy, router, req("r2"))
    assert d.backend in SELF and d.reason == "no_hosted_meets_target"


def test_price_is_cache_adjusted_and_exact():
    hy, router = setup(quotes=[quote("h1", inp="0.000002", read="0.0000002"), quote("h2", inp="0.0000015")])
    for _ in range(30):
        hy.market.learn("h1", 0.0, prompt_tokens=1000, cached_tokens=900)
    queue(router, 5.0)
    d = pick(hy, router, req())
    assert d.backend == "h1"  # 2e-6 list price, but 90 % cached: cheaper than h2's 1.5e-6
    price = Decimal(d.why["routes"]["h1"]["price"])
    assert isinstance(price, Decimal) and price < Decimal(d.why["routes"]["h2"]["price"])


def test_hysteresis_band_and_minimum_dwell():
    hy, router = setup(ttft_target_s=1.0, enter_ratio=1.0, leave_ratio=0.5, min_dwell_s=5.0)
    queue(router, 0.6)  # ratio ~0.8: inside the band, normal mode keeps it self-hosted
    assert pick(hy, router, req("a")).reason == "self_hosted"
    queue(router, 5.0, now=1.0)
    assert pick(hy, router, req("b"), now=1.0).reason == "overflow_latency"
    drain(router, 5.0, now=1.0)
    drain(router, 0.6)  # queued work drains with time: the t=0 charge is done by t=2, so the band is charged anew
    queue(router, 0.6, now=2.0)
    d = pick(hy, router, req("c"), now=2.0)  # back in the band: overflow mode still overflows it
    assert d.reason == "overflow_latency" and d.why["mode"] == "overflow"
    drain(router, 0.6, now=2.0)
    d = pick(hy, router, req("d"), now=3.0)  # below leave, but the dwell is not over
    assert d.reason == "self_hosted" and hy.overflowing
    d = pick(hy, router, req("e"), now=6.5)
    assert d.reason == "self_hosted" and not hy.overflowing


def test_hysteresis_bounds_flapping():
    """A predicted TTFT oscillating around the target switches the mode far less often than it crosses it."""
    hy, router = setup(ttft_target_s=1.0, leave_ratio=0.6, min_dwell_s=3.0)
    switches, crossings, last_mode, last_side = 0, 0, False, False
    for i in range(200):
        now = i * 0.1
        load = 0.95 if i % 2 else 0.75  # ratio ~1.2 / ~1.0: crosses the target every request
        queue(router, load, now=now)
        pick(hy, router, req(f"r{i}"), now=now)
        drain(router, load, now=now)
        side = load > 0.9
        crossings += side != last_side
        switches += hy.overflowing != last_mode
        last_side, last_mode = side, hy.overflowing
    assert crossings >= 190 and switches <= 2


def test_share_guard_caps_the_overflow_share():
    hy, router = setup(max_overflow_share=0.25, share_window_s=60.0, share_min_requests=4)
    queue(router, 5.0)
    reasons = [pick(hy, router, req(f"r{i}"), now=i * 0.01).reason for i in range(40)]
    hosted = sum(r == "overflow_latency" for r in reasons)
    assert reasons.count("guard_share") > 0 and hosted / len(reasons) <= 0.25
    assert hy.guard.share(0.5) <= 0.25


def test_spend_guard_stops_overflow_and_counts_reservations():
    hy, router = setup(max_hosted_spend_per_hour="3.6", spend_window_s=60.0)  # 0.06 per 60 s window
    queue(router, 5.0)
    d = pick(hy, router, req("a"))
    price = Decimal(d.why["hosted_price"])
    assert d.reason == "overflow_latency" and hy.guard.spent(0.0) == price  # reserved before it is billed
    n = 1
    while pick(hy, router, req(f"b{n}")).reason == "overflow_latency":
        n += 1
    assert n == int(Decimal("0.06") / price) > 1 and hy.reasons["guard_spend"] == 1
    hy.record_success(req("a"), "h1", 1.0, cached_tokens=0, output_tokens=10, prompt_tokens=4000)
    assert hy.guard.total_spent == Decimal("0.000002") * 4000 + Decimal("0.000008") * 10
    queue(router, 5.0, now=120.0)  # still 5 s behind at 120 s (the t=0 charge has drained by then)
    assert pick(hy, router, req("late"), now=120.0).reason == "overflow_latency"  # the window moved on


def test_session_stays_where_its_cache_makes_it_cheaper():
    quotes = [quote("h1", inp="0.000002", out="0.000002", read="0.0000001")]
    hy, router = setup(quotes=quotes, self_hosted_input_price="0.0000005", self_hosted_output_price="0.000002")
    hy.market.learn("h1", 0.0, prompt_tokens=1000, cached_tokens=990)
    for _ in range(40):
        hy.market.learn("h1", 0.0, prompt_tokens=1000, cached_tokens=990)
    hy.record_success(req("x", session="s"), "h1", 0.0, cached_tokens=3900, prompt_tokens=4000)
    d = pick(hy, router, req("y", session="s"), candidates=["s1", "s2", "h1"], now=1.0)
    assert d.backend == "h1" and d.reason == "session_hosted"
    assert Decimal(d.why["hosted_price"]) <= Decimal(d.why["self_price"])
    hy.set_self_hosted_rate("s1", SelfHostedRate(Decimal("0.0000000001"), Decimal(0)))
    hy.set_self_hosted_rate("s2", SelfHostedRate(Decimal("0.0000000001"), Decimal(0)))
    d = pick(hy, router, req("z", session="s"), candidates=["s1", "s2", "h1"], now=2.0)
    assert d.backend in SELF and d.reason == "self_hosted"  # self-hosted recompute is cheaper now


def test_targets_per_app_and_per_tag():
    hy, router = setup(ttft_target_s=10.0, app_targets={"chat": 1.0}, tag_targets={"workload:voice": 0.2})
    queue(router, 0.9)
    assert pick(hy, router, req("a")).reason == "self_hosted"
    d = pick(hy, router, req("b", app="chat"))
    assert d.reason == "overflow_latency" and d.why["target_s"] == 1.0
    assert pick(hy, router, req("c", tags={"workload": "voice"}), now=0.1).why["target_s"] == 0.2


def test_hosted_serves_when_no_self_hosted_replica_is_left():
    board = HealthBoard(BreakerConfig(min_requests=1, consecutive_failures=1))
    hy, router = setup()
    hy.bind(FleetView(health=board))
    d = pick(hy, router, req(), candidates=["h1", "h2"])
    assert (d.backend, d.reason) == ("h1", "self_hosted_unavailable")
    for _ in range(5):
        board.record("h1", Outcome.PROVIDER_FAILURE, 0.0)
        board.record("h2", Outcome.PROVIDER_FAILURE, 0.0)
    d = pick(hy, router, req(), candidates=["h1", "h2"], now=0.1)
    assert d.backend is None and d.reason == "no_acceptable_provider:no_acceptable_route"
    assert d.why["rejected"] == {"unhealthy": 2}


def test_failover_with_no_replica_left_keeps_the_spend_cap_and_the_app_rules_not_the_share_cap():
    # a window budget of 0.03: about three 4000-token requests at h1's price (~0.0096 each with its output)
    hy, router = setup(max_overflow_share=0.1, max_hosted_spend_per_hour="0.03", spend_window_s=3600.0,
                       apps={"strict": {"deny": ["h1", "h2"]}, "no-h1": {"deny": ["h1"]}})
    teach_ttft(hy, "h1", 0.4)
    teach_ttft(hy, "h2", 0.4)
    d = pick(hy, router, req("only-h2", app="no-h1"), candidates=["h1", "h2"])
    assert (d.backend, d.reason) == ("h2", "self_hosted_unavailable")  # the app's deny holds in failover
    d = pick(hy, router, req("strict", app="strict"), candidates=["h1", "h2"])
    assert d.backend is None and d.reason == "no_acceptable_provider:no_acceptable_route"
    served, refused = [], []
    for i in range(8):  # the share cap (10 %) would refuse these at once; the spend cap stops them when spent
        d = pick(hy, router, req(f"f{i}"), candidates=["h1", "h2"], now=0.01 * i)
        (served if d.backend else refused).append(d)
    assert served and refused and all(d.reason == "self_hosted_unavailable" for d in served)
    assert all(d.reason == "no_acceptable_provider:guard_spend" and d.why["refused"] == "guard_spend"
               for d in refused)
    assert hy.guard.spent(0.1) <= hy.guard.budget()
    assert served[0].backend == "h1"  # cheapest route meeting the target first


def test_failover_takes_a_route_missing_the_target_before_refusing():
    hy, router = setup()
    teach_ttft(hy, "h1", 9.0)  # the cheap route misses the 1.5 s target, the dear one meets it
    teach_ttft(hy, "h2", 0.4)
    assert pick(hy, router, req("a"), candidates=["h1", "h2"]).backend == "h2"
    hy.bind(FleetView(health=HealthBoard(BreakerConfig(min_requests=1, consecutive_failures=1))))
    for _ in range(5):
        hy.health.record("h2", Outcome.PROVIDER_FAILURE, 0.0)
    d = pick(hy, router, req("b"), candidates=["h1", "h2"], now=0.1)
    assert (d.backend, d.reason) == ("h1", "self_hosted_unavailable")  # late beats no answer


def test_max_price_rule_and_unpriced_routes_never_overflow():
    hy, router = setup(apps={"*": {"max_price": {"prompt": "3"}}})  # USD per Mtok: h2 (4/Mtok) is out
    hy.mark_hosted(["h3"])
    queue(router, 5.0)
    d = pick(hy, router, req(), candidates=["s1", "s2", "h2", "h3"])
    assert d.backend in SELF and d.why["rejected"] == {"over_max_price": 1, "unpriced": 1}


def test_short_prompt_uses_queued_work_as_its_prediction():
    hy, router = setup(ttft_target_s=1.0)
    queue(router, 5.0)
    d = pick(hy, router, req(keys=[1, 2], prompt=100))
    assert d.reason == "overflow_latency" and d.why["self_reason"] == "least_load" and d.why["predicted_s"] > 5


def test_guard_reservations_expire_and_release():
    g = OverflowGuard(max_spend_per_hour=Decimal("3.6"), spend_window_s=10.0, reservation_ttl_s=5.0)
    assert g.budget() == Decimal("0.01")
    g.reserve("a", 0.0, Decimal("0.008"))
    assert g.check(0.0, Decimal("0.003")) == "guard_spend" and g.check(0.0, Decimal("0.002")) is None
    assert g.check(6.0, Decimal("0.003")) is None  # the reservation expired unbilled
    g.record_spend(7.0, Decimal("0.004"), "a")
    assert g.spend_per_hour(7.0) == Decimal("0.004") * 360 and g.spent(18.0) == 0


@given(st.lists(st.tuples(st.integers(1, 50), st.booleans(), st.floats(0.0, 5.0)), min_size=1, max_size=200),
       st.floats(0.05, 1.0), st.integers(1, 30))
@settings(max_examples=60, deadline=None)
def test_guard_never_lets_share_or_spend_past_its_caps(steps, max_share, min_requests):
    """Overflow only when ``check`` allows it: the window's spend (billed + reserved) stays within the budget, and
    the share of hosted decisions stays within the cap once the window holds ``min_requests`` decisions."""
    g = OverflowGuard(max_share, 30.0, min_requests=min_requests, max_spend_per_hour=Decimal("0.36"),
                      spend_window_s=100.0)
    now = 0.0
    for i, (cents, bill, dt) in enumerate(steps):
        now += dt
        price = Decimal(cents) / 10_000
        ok = g.check(now, price) is None
        g.record_decision(now, ok)
        if ok:
            g.reserve(f"r{i}", now, price)
            if bill:
                g.record_spend(now, price, f"r{i}")
        assert g.spent(now) <= g.budget()
        n = len(g._decisions)
        assert g._hosted <= max(max_share * max(n, min_requests), 0) + 1e-9


def test_a_hedges_losing_attempt_counts_in_the_spend_cap():
    hy, _ = setup(max_hosted_spend_per_hour="3.6", spend_window_s=60.0)
    hy.record_extra_spend(1.0, "h1", 4000, 3, "r:2:hedge_lost")
    assert hy.guard.total_spent == Decimal("0.000002") * 4000 + Decimal("0.000008") * 3
    assert hy.guard.spent(1.0) == hy.guard.total_spent  # inside the window: it holds back the next overflow
    hy.record_extra_spend(1.0, "s1", 4000, 3, "r:3:hedge_lost")  # a replica is not hosted spend
    assert hy.guard.total_spent == Decimal("0.000002") * 4000 + Decimal("0.000008") * 3
