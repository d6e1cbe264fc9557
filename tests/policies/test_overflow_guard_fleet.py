"""The overflow guard with a fleet: one atomic hold on the shared window, the local share while it is away,
the other instances' decisions in the share, and their over-target time in the overflow mode."""

from __future__ import annotations

import threading
from decimal import Decimal

from kvroute.policies.hybrid import Hybrid, HybridConfig
from kvroute.policies.overflow_guard import HOUR_S, OverflowGuard


class FakeFleet:
    """A ``FleetSpend`` in memory: an atomic window shared by every guard given the same object."""

    def __init__(self, instances: int = 3) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, Decimal] = {}
        self.paid = Decimal(0)
        self.up = True
        self.n = instances
        self.peers = (0, 0)
        self.over_ago: float | None = None

    def reserve(self, request_id, amount, budget):
        if not self.up:
            return None
        with self.lock:
            if self.paid + sum(self.held.values()) + amount > budget:
                return False
            self.held[request_id] = amount
            return True

    def settle(self, request_id, amount):
        with self.lock:
            self.held.pop(request_id, None)
            self.paid += amount

    def release(self, request_id):
        with self.lock:
            self.held.pop(request_id, None)

    def spent(self):
        return (self.paid, sum(self.held.values(), Decimal(0))) if self.up else None

    def instances(self):
        return self.n

    def peer_decisions(self):
        return self.peers

    def peer_over_ago(self):
        return self.over_ago


def guard(fleet: FakeFleet, cap: str = "1.00") -> OverflowGuard:
    return OverflowGuard(max_spend_per_hour=Decimal(cap), spend_window_s=HOUR_S, fleet=fleet)


def test_three_guards_on_one_window_never_pass_the_cap_together():
    fleet = FakeFleet()
    guards = [guard(fleet) for _ in range(3)]
    price = Decimal("0.07")
    admitted = 0
    for i in range(60):
        g = guards[i % 3]
        if g.admit(f"r{i}", float(i), price) is None:
            admitted += 1
            g.record_spend(float(i), price, f"r{i}")
    assert admitted == 14 and fleet.paid == price * 14 <= Decimal("1.00")
    assert all(g.spent(60.0) == fleet.paid for g in guards)


def test_while_the_fleet_is_away_each_spends_only_its_share_then_the_fleet_window_again():
    fleet = FakeFleet(instances=4)
    g = guard(fleet)
    fleet.up = False
    price = Decimal("0.10")
    admitted = [i for i in range(10) if g.admit(f"r{i}", float(i), price) is None]
    for i in admitted:
        g.record_spend(float(i), price, f"r{i}")
    assert g.local_budget() == Decimal("0.25") and len(admitted) == 2 and g.scope == "local_share"
    assert g.local_spent(20.0) <= Decimal("0.25")
    fleet.up = True
    assert g.admit("back", 30.0, price) is None and g.scope == "fleet"
    assert fleet.paid == Decimal("0.20")  # the outage's settlements reached the fleet window


def test_the_share_counts_the_other_instances_decisions():
    fleet = FakeFleet()
    g = OverflowGuard(max_share=0.2, min_requests=10, fleet=fleet)
    g.record_decision(0.0, False)
    assert g.check(1.0, Decimal(0)) is None  # 1 hosted of at least 10
    fleet.peers = (3, 5)  # the others already sent 3 of their 5 hosted
    assert g.share(1.0) == 0.5 and g.check(1.0, Decimal(0)) == "guard_share"
    fleet.peers = (0, 20)
    assert g.check(1.0, Decimal(0)) is None


def test_overflow_mode_entered_by_another_instance_holds_here_for_the_dwell():
    fleet = FakeFleet()
    policy = Hybrid(HybridConfig(min_dwell_s=10.0), guard=OverflowGuard(fleet=fleet))
    assert policy._mode(0.9, 100.0) is False  # between leave and enter: stays normal
    fleet.over_ago = 2.0  # another instance saw a ratio above enter_ratio two seconds ago
    assert policy._mode(0.9, 100.0) is True and policy.overflowing
    assert policy._mode(0.5, 105.0) is False and policy.overflowing  # below leave, within the dwell
    fleet.over_ago = 20.0
    assert policy._mode(0.5, 120.0) is False and not policy.overflowing


def test_no_fleet_keeps_the_local_guard_as_before():
    g = OverflowGuard(max_spend_per_hour=Decimal("0.10"), spend_window_s=HOUR_S)
    assert g.admit("a", 0.0, Decimal("0.06")) is None
    assert g.admit("b", 0.0, Decimal("0.06")) == "guard_spend"  # the first one's hold counts
    g.record_spend(1.0, Decimal("0.03"), "a")
    assert g.admit("b", 1.0, Decimal("0.06")) is None and g.scope == "local"
