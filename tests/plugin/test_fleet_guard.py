"""The fleet's spend window in a real Redis: atomic holds under concurrent threads of several instances, the
local share while Redis is away, and the window reconciled (settlements booked again) when it returns."""

from __future__ import annotations

import threading
import time
import uuid
from decimal import Decimal

from kvroute.plugin.state.fleet_guard import RedisSpend, from_units, to_units
from kvroute.plugin.state.shared_state import SharedStateConfig, connect
from kvroute.policies.overflow_guard import HOUR_S, OverflowGuard


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def instances(url: str, n: int, ns: str, **knobs):
    cfg = SharedStateConfig(namespace=ns, heartbeat_s=0.1, backoff_max_s=0.5, **knobs)
    shared = [connect(url, cfg, worker_id=f"i{k}") for k in range(n)]
    assert wait_for(lambda: all(s.connected for s in shared))
    assert wait_for(lambda: all(s.known_instances() == n for s in shared))
    return shared


def test_units_round_up_and_back():
    assert to_units(Decimal("0.0000000001")) == 1 and from_units(to_units(Decimal("0.05"))) == Decimal("0.05")


def test_concurrent_holds_from_three_instances_never_overrun_the_window(redis_url):
    shared = instances(redis_url, 3, f"kvtest-fg-{uuid.uuid4().hex[:8]}")
    try:
        spends = [RedisSpend(s, "g", window_s=600) for s in shared]
        budget, price = Decimal("1.00"), Decimal("0.07")
        granted: list[str] = []
        lock = threading.Lock()

        def worker(t: int) -> None:
            spend = spends[t % 3]
            for i in range(12):
                rid = f"t{t}-{i}"
                if spend.reserve(rid, price, budget):
                    with lock:
                        granted.append(rid)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(12)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(granted) == 14  # floor(1.00 / 0.07): not one more, whatever the interleaving
        paid, held = spends[0].refresh()
        assert paid == 0 and held == price * 14
        # billed for less than held: the difference frees room for exactly that much more
        for rid in granted:
            spends[int(rid[1:].split("-")[0]) % 3].settle(rid, Decimal("0.05"))
        assert spends[1].refresh() == (Decimal("0.70"), Decimal(0))
        assert [spends[2].reserve(f"more{i}", price, budget) for i in range(5)] == [True] * 4 + [False]
        spends[2].release("more0")
        assert spends[0].refresh() == (Decimal("0.70"), price * 3)
    finally:
        for s in shared:
            s.close()


def test_redis_away_means_the_local_share_then_the_window_reconciles(own_redis):
    ns = f"kvtest-fg-{uuid.uuid4().hex[:8]}"
    shared = instances(own_redis.url, 2, ns)
    try:
        guards = []
        for s in shared:
            g = OverflowGuard(max_spend_per_hour=Decimal("1.00"), spend_window_s=HOUR_S)
            fleet = RedisSpend(s, "g", window_s=HOUR_S)
            fleet.guard, g.fleet = g, fleet
            guards.append(g)
        price = Decimal("0.20")
        assert guards[0].admit("before", 0.0, price) is None
        guards[0].record_spend(0.0, price, "before")
        own_redis.stop()
        assert wait_for(lambda: not any(s.connected for s in shared))
        t0 = time.monotonic()
        verdicts = [guards[1].admit(f"out{i}", 1.0, price) for i in range(4)]
        assert time.monotonic() - t0 < 0.5  # no Redis round trip is waited for while it is known down
        assert verdicts == [None, None, "guard_spend", "guard_spend"]  # 1.00 / 2 instances = 0.50 each
        for i in (0, 1):
            guards[1].record_spend(2.0, price, f"out{i}")
        assert guards[1].scope == "local_share" and guards[1].local_budget() == Decimal("0.50")
        # guard 0 spent 0.20 before the outage: its own share leaves room for one more
        assert guards[0].admit("out-a", 1.0, price) is None and guards[0].admit("out-b", 1.0, price) == "guard_spend"
        guards[0].record_spend(2.0, price, "out-a")
        own_redis.start()  # empty: the window comes back from what each instance billed
        assert wait_for(lambda: all(s.connected for s in shared))
        assert wait_for(lambda: guards[0].fleet.refresh() == (Decimal("0.80"), Decimal(0)), timeout=15)
        assert guards[1].admit("after", 3.0, price) is None and guards[1].admit("after2", 3.0, price) == "guard_spend"
        assert guards[1].scope == "fleet"
    finally:
        for s in shared:
            s.close()


def test_hosted_ttft_share_and_overflow_clock_reach_the_other_instances(redis_url):
    from kvroute.plugin.adapter.hybrid import share_guard
    from kvroute.policies.hybrid import Hybrid, HybridConfig
    from kvroute.policies.request import RoutingRequest

    shared = instances(redis_url, 2, f"kvtest-fg-{uuid.uuid4().hex[:8]}")
    try:
        a, b = (Hybrid(HybridConfig(hosted=("h",), min_dwell_s=30.0)) for _ in shared)
        share_guard(a, shared[0], "g")
        share_guard(b, shared[1], "g")
        req = RoutingRequest(model="g", keys=[], block_tokens=64.0, prompt_tokens=100, request_id="r1")
        a.record_success(req, "h", shared[0].clock(), ttft_s=3.5, output_tokens=4)
        for _ in range(5):
            a.guard.record_decision(shared[0].clock(), True)
        a._mode(2.0, shared[0].clock())  # a sees a ratio above enter_ratio: the fleet overflows
        assert wait_for(lambda: b.market.observed_ttft("h", shared[1].clock(), 0.9) == 3.5)
        assert wait_for(lambda: b.guard.share(shared[1].clock()) == 1.0)
        assert b._mode(0.9, shared[1].clock()) is True and b.overflowing
        status = shared[1].peer_status[shared[0].worker_id]
        assert "replication" in status and status["fp"] is None
    finally:
        for s in shared:
            s.close()
